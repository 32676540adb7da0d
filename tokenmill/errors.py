"""Engine errors, and exceptions carried across process boundaries by name (never pickled)."""

from __future__ import annotations

import traceback

from tokenmill.protocol import ErrorReport


class EngineDeadError(RuntimeError):
    """The engine core or a worker died: every in-flight and later request fails with this."""


class RequestFailedError(RuntimeError):
    """This request alone failed inside the engine (its row of a step: non-finite logits, a
    sampling error); the engine and every other request go on. The message is safe to show."""


# Exceptions re-raised as themselves on the other side; anything else becomes a RuntimeError
# naming its type. Kept to builtins whose constructor takes one message.
_REBUILDABLE: dict[str, type[BaseException]] = {
    cls.__name__: cls for cls in (ValueError, TypeError, KeyError, NotImplementedError,
                                  FileNotFoundError, MemoryError, OSError, RuntimeError)
}


def error_report(exc: BaseException) -> ErrorReport:
    return ErrorReport(type(exc).__name__, str(exc),
                       "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


def exception_from_report(report: ErrorReport, where: str) -> BaseException:
    """The exception to raise here for `report`; `where` names the process it came from."""
    if report.exc_type == EngineDeadError.__name__:
        return EngineDeadError(report.message)
    cls = _REBUILDABLE.get(report.exc_type)
    if cls is not None:
        exc = cls(report.message)
    else:
        exc = RuntimeError(f"{report.exc_type} in {where}: {report.message}")
    if report.traceback:
        exc.add_note(f"traceback in {where}:\n{report.traceback}")
    return exc
