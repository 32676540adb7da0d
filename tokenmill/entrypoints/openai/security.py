"""The ASGI guard in front of every route: header size, API key, body size.

Runs before FastAPI parses anything, so oversized or unauthenticated requests cost no
work. The body is read here (up to the limit) and replayed to the app; afterwards the
app's `receive` is the server's again, so client disconnects are still seen.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.entrypoints.openai.args import ServerSettings
from tokenmill.entrypoints.openai.errors import error_body


def key_matches(provided: str, expected: str) -> bool:
    # Hash first so the comparison takes the same time whatever the lengths.
    a = hashlib.sha256(provided.encode("utf-8", "surrogateescape")).digest()
    b = hashlib.sha256(expected.encode("utf-8", "surrogateescape")).digest()
    return hmac.compare_digest(a, b)


class GuardMiddleware:
    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app = app
        self.settings = settings
        public = {"/health"}
        if settings.public_metrics:
            public.add("/metrics")
        self.public_paths = frozenset(public)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        s = self.settings
        headers = scope["headers"]
        if sum(len(k) + len(v) for k, v in headers) > s.max_header_bytes:
            await _reply(send, 431, f"request headers exceed {s.max_header_bytes} bytes", "headers_too_large")
            return
        if s.api_key is not None and scope["path"] not in self.public_paths and not self._authorized(headers):
            await _reply(send, 401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                         "invalid_api_key", {"www-authenticate": "Bearer"})
            return
        declared = next((v for k, v in headers if k == b"content-length"), None)
        if declared is not None and (not declared.isdigit() or int(declared) > s.max_body_bytes):
            await _reply(send, 413, f"request body exceeds {s.max_body_bytes} bytes", "request_too_large")
            return
        body, more = await _read_body(receive, s.max_body_bytes)
        if more:
            await _reply(send, 413, f"request body exceeds {s.max_body_bytes} bytes", "request_too_large")
            return
        await self.app(scope, _replay(body, receive), send)

    def _authorized(self, headers) -> bool:
        value = next((v for k, v in headers if k == b"authorization"), None)
        if value is None:
            return False
        scheme, _, token = value.decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and key_matches(token.strip(), self.settings.api_key or "")


async def _read_body(receive: Receive, limit: int) -> tuple[bytes, bool]:
    """(body, True when it went past `limit`); a disconnect ends it early."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), False
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return b"", True
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), False


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _reply(send: Send, status: int, message: str, code: str, extra: dict[str, str] | None = None) -> None:
    payload = json.dumps(error_body(status, message, None, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               (b"connection", b"close")]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
