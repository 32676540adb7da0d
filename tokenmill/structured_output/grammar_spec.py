"""A request's constraint as the text its grammar is named by (and cached by)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenmill.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # json | json_object | regex | choice | grammar
    text: str  # a JSON schema's canonical text, the regex, the EBNF grammar, or the choices as JSON
    any_whitespace: bool = True  # JSON: bounded free whitespace (False: none at all)


def canonical(so: StructuredOutputsParams) -> StructuredOutputsParams:
    """`so` with a dict schema as compact JSON text (its key order kept: properties come in schema order)."""
    if isinstance(so.json, dict):
        import msgspec
        return msgspec.structs.replace(so, json=json.dumps(so.json, separators=(",", ":")))
    return so


def grammar_spec(so: StructuredOutputsParams, max_bytes: int) -> GrammarSpec:
    """The spec of a checked (`SamplingParams.validate`), canonical `so`; ValueError naming the
    field when its text is larger than `max_bytes`."""
    kind = so.kind()
    if kind == "json_object":
        text = '{"type":"object"}'
    elif kind == "json":
        text = so.json if isinstance(so.json, str) else json.dumps(so.json, separators=(",", ":"))
    elif kind == "choice":
        text = json.dumps(list(so.choice))
    else:
        text = getattr(so, kind)
    size = len(text.encode())
    if size > max_bytes:
        raise ValueError(f"structured_outputs.{'json' if kind == 'json_object' else kind} is {size} bytes, more "
                         f"than the limit of {max_bytes} (--structured-outputs-max-schema-bytes)")
    return GrammarSpec(kind, text, not so.disable_any_whitespace)


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar accepting exactly one of `choices` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
