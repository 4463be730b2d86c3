"""kallpa's typed errors: one exception class per ErrorCode of the contract (include/kallpa/status.h).

Every error carries ``code`` (the ErrorCode's name, e.g. ``"invalid_argument"``), ``field`` (what
was wrong: ``"q.dtype"``, ``"cu_seqlens_k"``, ``"k.shape[2]"``), ``message`` and, where known,
``value`` (the offending value as text). Each class also derives from the built-in exception a
Python caller would expect (``InvalidArgumentError`` is a ``ValueError``, and so on).
"""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """The contract's error codes (kallpa::ErrorCode)."""

    invalid_argument = "invalid_argument"
    unsupported = "unsupported"
    backend_failure = "backend_failure"
    not_found = "not_found"
    parse_error = "parse_error"
    out_of_memory = "out_of_memory"
    internal = "internal"
    backend_lost = "backend_lost"


class Error(Exception):
    """A kallpa error: ``code``, ``field``, ``message`` and ``value`` (or None)."""

    code: ErrorCode = ErrorCode.internal

    def __init__(self, field: str, message: str, value: str | None = None):
        super().__init__(f"{self.code.value}: {field}: {message}" if field else f"{self.code.value}: {message}")
        self.field = field
        self.message = message
        self.value = value


class InvalidArgumentError(Error, ValueError):
    """A problem or option that violates the contract."""

    code = ErrorCode.invalid_argument


class UnsupportedError(Error, NotImplementedError):
    """A valid problem that no (chosen) backend can run."""

    code = ErrorCode.unsupported


class BackendError(Error, RuntimeError):
    """A backend's run reported an error."""

    code = ErrorCode.backend_failure


class NotFoundError(Error, LookupError):
    """A named backend or file that does not exist."""

    code = ErrorCode.not_found


class ParseError(Error, ValueError):
    """Malformed text input (a spec, an environment variable, ...)."""

    code = ErrorCode.parse_error


class OutOfMemoryError(Error, MemoryError):
    code = ErrorCode.out_of_memory


class InternalError(Error, RuntimeError):
    code = ErrorCode.internal


class BackendLostError(Error, RuntimeError):
    """An isolated plugin's process died, hung or wrote out of bounds."""

    code = ErrorCode.backend_lost


_BY_CODE = {cls.code: cls for cls in (InvalidArgumentError, UnsupportedError, BackendError, NotFoundError,
                                      ParseError, OutOfMemoryError, InternalError, BackendLostError)}


def from_status(code: str, field: str, message: str, value: str | None) -> Error:
    """The exception for a kallpa::Status (called by the native module's error translator)."""
    try:
        cls = _BY_CODE[ErrorCode(code)]
    except ValueError:
        cls = InternalError
    return cls(field, message, value)
