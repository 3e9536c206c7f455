"""kvxfer: Python bindings of libkvxfer, the KV-cache transfer engine of prefill/decode
disaggregated LLM serving.

A prefill server computes a prompt's KV cache and libkvxfer moves it, page by page,
into the pages a decode server set aside for the same request. Each request is a
*room* with a 64-bit id; the server's scheduler drives rooms through non-blocking calls
while the library owns the connections, worker threads, memory registration and
transport. This package is the whole C ABI (``include/kvxfer.h``) as Python:

>>> import kvxfer
>>> with kvxfer.Engine(role="decode") as engine:   # doctest: +SKIP
...     engine.register_kv([(kv.data_ptr(), kv.nbytes, page_bytes)])
...     engine.room_create(7, [prefill_address])
...     engine.room_set_destination(7, numpy.arange(4, dtype=numpy.uint32))
...     while engine.room_poll(7) not in (kvxfer.RoomState.SUCCESS, kvxfer.RoomState.FAILED):
...         ...

``kvxfer.sglang`` is a transfer backend with SGLang's KVManager/KVSender/KVReceiver
contract on top of it.
"""

from __future__ import annotations

from ._abi import (
    HEADER_VERSION,
    DataPath,
    FailureCause,
    KvKind,
    LogLevel,
    MemoryKind,
    PageOrder,
    RoomState,
    Status,
)
from ._core import (
    C_FUNCTIONS,
    TRACE,
    Buffer,
    Config,
    Engine,
    LogSink,
    PageList,
    failure_cause_name,
    library_version,
    room_state_name,
)
from ._lib import path as library_path
from .errors import (
    ERRORS,
    AlreadyExistsError,
    BadValueError,
    BufferTooSmallError,
    InvalidArgumentError,
    IoError,
    KvxferError,
    NotFoundError,
    NullPointerError,
    PanicError,
    TransportUnavailableError,
    UnknownKeyError,
    UnsupportedError,
    WrongRoleError,
    WrongStateError,
    last_error,
    status_name,
)

__version__ = HEADER_VERSION

TERMINAL_STATES = frozenset({RoomState.SUCCESS, RoomState.FAILED})
"""The states a room never leaves until it is cleared."""

__all__ = [
    "AlreadyExistsError",
    "BadValueError",
    "Buffer",
    "BufferTooSmallError",
    "C_FUNCTIONS",
    "Config",
    "ERRORS",
    "Engine",
    "DataPath",
    "FailureCause",
    "HEADER_VERSION",
    "InvalidArgumentError",
    "IoError",
    "KvKind",
    "MemoryKind",
    "KvxferError",
    "LogLevel",
    "LogSink",
    "NotFoundError",
    "NullPointerError",
    "PageList",
    "PageOrder",
    "PanicError",
    "RoomState",
    "Status",
    "TERMINAL_STATES",
    "TRACE",
    "TransportUnavailableError",
    "UnknownKeyError",
    "UnsupportedError",
    "WrongRoleError",
    "WrongStateError",
    "__version__",
    "failure_cause_name",
    "last_error",
    "library_path",
    "library_version",
    "room_state_name",
    "status_name",
]
