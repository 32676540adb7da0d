"""The OpenAI-compatible HTTP server (`tokenmill serve`): FastAPI app, schemas, serving handlers."""
