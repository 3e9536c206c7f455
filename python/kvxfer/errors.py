"""Exceptions: every failed C call raises a :class:`KvxferError` subclass for its status,
carrying the status, the name of the C function and the library's message for it
(``kvxfer_last_error``, read on the same thread right after the call)."""

from __future__ import annotations

import ctypes

from ._abi import Status
from ._lib import lib


class KvxferError(Exception):
    """A libkvxfer call failed.

    Attributes:
        status: the :class:`Status` the call returned (an ``int`` if the library
            returned a value these bindings do not know).
        message: the library's message for the failure, as ``kvxfer_last_error``
            gave it.
        function: the C function that failed, such as ``"kvxfer_room_poll"``.
    """

    status_code: Status | None = None

    def __init__(self, status: Status | int, message: str, function: str = ""):
        super().__init__(status, message, function)
        try:
            self.status: Status | int = Status(status)
        except ValueError:
            self.status = int(status)
        self.message = message
        self.function = function

    @property
    def status_name(self) -> str:
        """The status's C name, such as ``"KVXFER_ERR_NOT_FOUND"`` (``kvxfer_status_str``)."""
        return status_name(int(self.status))

    def __str__(self) -> str:
        where = f"{self.function}: " if self.function else ""
        return f"{where}{self.status_name}: {self.message}"

    def __reduce__(self):
        return (type(self), (int(self.status), self.message, self.function))


class InvalidArgumentError(KvxferError):
    """``KVXFER_ERR_INVALID_ARGUMENT``: an argument is out of range or malformed."""

    status_code = Status.INVALID_ARGUMENT


class NullPointerError(KvxferError):
    """``KVXFER_ERR_NULL_POINTER``: a pointer that must not be NULL was NULL."""

    status_code = Status.NULL_POINTER


class NotFoundError(KvxferError):
    """``KVXFER_ERR_NOT_FOUND``: the room does not exist (never created, or cleared)."""

    status_code = Status.NOT_FOUND


class AlreadyExistsError(KvxferError):
    """``KVXFER_ERR_ALREADY_EXISTS``: the room id is already present in this engine."""

    status_code = Status.ALREADY_EXISTS


class WrongRoleError(KvxferError):
    """``KVXFER_ERR_WRONG_ROLE``: the call is for the other role (prefill vs decode)."""

    status_code = Status.WRONG_ROLE


class WrongStateError(KvxferError):
    """``KVXFER_ERR_WRONG_STATE``: not valid in the current state of the room or engine."""

    status_code = Status.WRONG_STATE


class UnsupportedError(KvxferError):
    """``KVXFER_ERR_UNSUPPORTED``: not supported by this build or configuration."""

    status_code = Status.UNSUPPORTED


class BufferTooSmallError(KvxferError):
    """``KVXFER_ERR_BUFFER_TOO_SMALL``: an output buffer is too small (the bindings
    retry with the size the library asks for, so this surfaces only if the size kept
    growing)."""

    status_code = Status.BUFFER_TOO_SMALL


class UnknownKeyError(KvxferError):
    """``KVXFER_ERR_UNKNOWN_KEY``: unknown configuration key."""

    status_code = Status.UNKNOWN_KEY


class BadValueError(KvxferError):
    """``KVXFER_ERR_BAD_VALUE``: bad configuration value (or a required key is missing)."""

    status_code = Status.BAD_VALUE


class TransportUnavailableError(KvxferError):
    """``KVXFER_ERR_TRANSPORT_UNAVAILABLE``: the requested transport cannot be used here."""

    status_code = Status.TRANSPORT_UNAVAILABLE


class IoError(KvxferError):
    """``KVXFER_ERR_IO``: an operating-system I/O call failed."""

    status_code = Status.IO


class PanicError(KvxferError):
    """``KVXFER_ERR_PANIC``: a panic inside the library was caught (a library bug)."""

    status_code = Status.PANIC


ERRORS: dict[Status, type[KvxferError]] = {
    cls.status_code: cls
    for cls in (
        InvalidArgumentError,
        NullPointerError,
        NotFoundError,
        AlreadyExistsError,
        WrongRoleError,
        WrongStateError,
        UnsupportedError,
        BufferTooSmallError,
        UnknownKeyError,
        BadValueError,
        TransportUnavailableError,
        IoError,
        PanicError,
    )
}
"""The exception class raised for each failure status."""


def status_name(code: int) -> str:
    """The C name of a status code, such as ``"KVXFER_ERR_NOT_FOUND"``;
    ``"KVXFER_UNKNOWN_STATUS"`` for a value that names no status (``kvxfer_status_str``)."""
    return lib.kvxfer_status_str(int(code)).decode()


def last_error() -> str:
    """This thread's message for the last failed call (``kvxfer_last_error``); empty
    after a call that succeeded."""
    n = lib.kvxfer_last_error(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    lib.kvxfer_last_error(buf, n + 1)
    return buf.value.decode("utf-8", "replace")


def error_for(status: int, message: str, function: str = "") -> KvxferError:
    """The exception for a failed call: the subclass for ``status`` (the base class for
    a status these bindings do not know)."""
    try:
        cls = ERRORS.get(Status(status), KvxferError)
    except ValueError:
        cls = KvxferError
    return cls(status, message, function)


def check(status: int, function: str) -> None:
    """Raises the exception for ``status`` (with the thread's last error) unless it is
    ``KVXFER_OK``."""
    if status != Status.OK:
        raise error_for(status, last_error(), function)
