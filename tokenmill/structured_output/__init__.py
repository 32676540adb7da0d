"""Structured outputs: grammars (JSON schema, regex, choice, EBNF) compiled by XGrammar.

`grammar_spec` turns a request's `StructuredOutputsParams` into the text a grammar is named and
cached by; `backend` wraps the grammar library; `compiles` compiles off the caller's thread,
once per text, within a time limit. The front-end compiles to check a request (its errors are
the request's 400); the engine core compiles again (a cache hit after the first) to own the
matchers that make each step's token bitmask (`tokenmill.core.grammar_masks`). Nothing here
imports the grammar library until a grammar is first compiled.
"""
