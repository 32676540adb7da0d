"""OpenAI's error envelope, `{"error": {"message", "type", "param", "code"}}`, for every failure.

Messages never carry tracebacks, object reprs or file paths: unexpected exceptions are
logged here and answered with a fixed message.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.errors import EngineDeadError, RequestFailedError

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 431: "invalid_request_error",
          503: "service_unavailable_error"}
_MAX_MESSAGE_CHARS = 1000
_FIELD = re.compile(r"^([a-z_][a-z0-9_]*)(?::|\s)")


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message[:_MAX_MESSAGE_CHARS], "type": kind, "param": param,
                      "code": code if code is not None else str(status)}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def from_value_error(exc: ValueError, known_fields: frozenset[str],
                     aliases: Mapping[str, str] | None = None) -> APIError:
    """The engine's ValueErrors start with the field they are about: that becomes `param`.
    `aliases`: engine fields the request calls otherwise (chat's logprobs are `top_logprobs`),
    renamed in the message too."""
    message = str(exc).split("\n", 1)[0]
    match = _FIELD.match(message)
    param = match.group(1) if match and match.group(1) in known_fields else None
    if param is not None and aliases and param in aliases:
        message = aliases[param] + message[len(param):]
        param = aliases[param]
    return APIError(400, message, param=param)


def from_exception(exc: BaseException) -> APIError:
    """Any failure as the APIError the client sees (logged when unexpected)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(503, "the engine is not running", code="engine_dead")
    if isinstance(exc, RequestFailedError):  # this request alone; its message names no internals
        return APIError(500, str(exc), code="request_failed")
    logger.error("request failed", exc_info=exc)
    return APIError(500, "internal server error", code="internal_error")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_union_tag(str(part))]
    param = ".".join(loc) or None
    if param is None and first.get("type") in ("model_attributes_type", "missing", "dict_type"):
        return "the request body must be a JSON object (Content-Type: application/json)", None
    msg = str(first.get("msg", "invalid value"))
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return (f"{param}: {msg}{more}" if param else f"{msg}{more}"), param


def _is_union_tag(part: str) -> bool:
    """pydantic names the member of a union in `loc` ("str", "list[int]", "TextContentPart")."""
    return "[" in part or part in ("str", "int", "float", "bool") or part[:1].isupper()


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "error"
        return error_response(exc.status_code, phrase, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        err = from_exception(exc)
        return error_response(err.status, err.message, err.param, err.code)
