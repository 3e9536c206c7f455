"""Config and Engine: the C ABI's two handles as Python objects.

Every method wraps one C function (its documentation from the header is appended to
the method's docstring) and raises a :class:`~kvxfer.KvxferError` subclass when the
call fails. Page lists are any buffer of uint32 (``array('I')``, a ``numpy.uint32``
array: passed without a copy) or a sequence of ints (copied). Buffers are registered
from integer addresses and lengths, as servers hold them (``tensor.data_ptr()``), or
from any writable Python buffer with :meth:`Buffer.of`.
"""

from __future__ import annotations

import array
import atexit
import ctypes
import logging
import threading
import weakref
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence, Union

from . import _abi
from ._abi import (
    DataPath,
    FailureCause,
    KvKind,
    LogLevel,
    MemoryKind,
    PageOrder,
    RoomState,
    Status,
)
from ._lib import lib
from .errors import KvxferError, check, error_for

__all__ = [
    "Buffer",
    "Config",
    "Engine",
    "LogSink",
    "PageList",
    "library_version",
    "room_state_name",
    "failure_cause_name",
    "C_FUNCTIONS",
]

_U64_MAX = (1 << 64) - 1
_I64_MAX = (1 << 63) - 1

C_FUNCTIONS: dict[str, str] = {}
"""Each C function of the ABI -> the Python callable that wraps it (filled by ``_wraps``)."""


def _wraps(cname: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Appends the header's documentation of ``cname`` to the wrapper's docstring."""
    _, _, _, _, decl, cdoc = _abi.FUNCTIONS[cname]

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        head = (fn.__doc__ or "").rstrip()
        body = "\n".join(("    " + line) if line else "" for line in cdoc.splitlines())
        fn.__doc__ = f"{head}\n\n    C: ``{decl}``\n\n{body}\n"
        C_FUNCTIONS.setdefault(cname, fn.__qualname__)
        return fn

    return deco


def _invalid(function: str, message: str) -> KvxferError:
    return error_for(Status.INVALID_ARGUMENT, message, function)


def _room_id(room: int, function: str) -> int:
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= _U64_MAX:
        raise _invalid(function, f"room id {room!r} is not an integer in 0..2^64-1")
    return room


def _u32(v: int, what: str, function: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 0xFFFF_FFFF:
        raise _invalid(function, f"{what} {v!r} is not an integer in 0..2^32-1")
    return v


def _slot(slot: int | None, function: str) -> int:
    if slot is None:
        return -1
    if isinstance(slot, bool) or not isinstance(slot, int) or not -1 <= slot <= _I64_MAX:
        raise _invalid(function, f"aux slot {slot!r} is not None or an integer >= 0")
    return slot


# ---------------------------------------------------------------------------------------
# Page lists

PageList = Union[Sequence[int], memoryview, bytes, bytearray, array.array, Any]
"""A page list: any C-contiguous buffer of native uint32 (``array('I')``,
``numpy.ndarray`` of ``uint32``), passed to the library without a copy, or a sequence
of ints, copied into one."""

_U32_FORMATS = {"I", "=I", "@I", "<I", "L", "=L", "@L", "<L"}
_U32_ARRAY = "I" if array.array("I").itemsize == 4 else "L"
_EMPTY = (ctypes.c_uint32 * 1)()


class _Pages:
    """The address and count of a page list, kept valid while this object lives."""

    __slots__ = ("ptr", "n", "_keep")

    def __init__(self, pages: Any, function: str):
        self._keep: Any
        if isinstance(pages, (list, tuple, range)) or not _has_buffer(pages):
            try:
                pages = array.array(_U32_ARRAY, pages)
            except (TypeError, OverflowError) as e:
                raise _invalid(function, f"page list is not uint32 values: {e}") from None
        mv = memoryview(pages)
        if mv.itemsize != 4 or mv.format not in _U32_FORMATS:
            raise _invalid(
                function,
                f"page list must hold uint32 (buffer format {mv.format!r}, item size "
                f"{mv.itemsize}); convert it, e.g. numpy's .astype(numpy.uint32)",
            )
        if not mv.c_contiguous:
            raise _invalid(function, "page list buffer is not C-contiguous")
        self.n = mv.nbytes // 4
        if self.n == 0:
            self.ptr, self._keep = ctypes.addressof(_EMPTY), None
        elif not mv.readonly:
            view = (ctypes.c_char * mv.nbytes).from_buffer(mv)
            self.ptr, self._keep = ctypes.addressof(view), (view, mv)
        elif hasattr(pages, "__array_interface__"):
            self.ptr, self._keep = pages.__array_interface__["data"][0], pages
        else:
            copy = array.array(_U32_ARRAY)
            copy.frombytes(mv.tobytes())
            view = (ctypes.c_char * mv.nbytes).from_buffer(copy)
            self.ptr, self._keep = ctypes.addressof(view), (view, copy)


def _has_buffer(obj: Any) -> bool:
    try:
        memoryview(obj)
    except TypeError:
        return False
    return True


# ---------------------------------------------------------------------------------------
# Buffers


class Buffer(NamedTuple):
    """One registered memory buffer (``kvxfer_buffer``): ``len`` bytes at address
    ``base``, in pages (KV) or slots (aux) of ``item_len`` bytes each; page ``p`` lives
    at ``base + p * item_len``. ``owner``, when set, is kept alive by the engine that
    registers the buffer (the memory must outlive the engine)."""

    base: int
    len: int
    item_len: int
    owner: object = None
    kind: MemoryKind = MemoryKind.HOST
    """Where the bytes live: :attr:`MemoryKind.HOST`, or :attr:`MemoryKind.CUDA` (device
    memory of CUDA device ``device``, which the library moves through pinned staging
    over TCP and never touches with the CPU)."""
    device: int = 0
    """The CUDA device ordinal of a :attr:`MemoryKind.CUDA` buffer (0 for host memory)."""

    @classmethod
    def from_tensor(cls, tensor: Any, item_len: int) -> "Buffer":
        """The buffer covering a contiguous tensor's storage from its ``data_ptr()``: a
        CUDA tensor (``tensor.device.type == "cuda"``) gives device memory of its device
        index, any other a host buffer. Duck-typed (PyTorch, or anything with
        ``data_ptr()``, ``numel()``, ``element_size()``, ``is_contiguous()`` and
        ``device``), so importing kvxfer never imports torch. The registering engine
        keeps the tensor alive."""
        try:
            contiguous = tensor.is_contiguous()
            base = int(tensor.data_ptr())
            nbytes = int(tensor.numel()) * int(tensor.element_size())
            device = tensor.device
        except AttributeError as e:
            raise TypeError(f"Buffer.from_tensor needs a tensor: {e}") from None
        if not contiguous:
            raise ValueError("Buffer.from_tensor needs a contiguous tensor")
        if getattr(device, "type", "cpu") == "cuda":
            index = device.index
            if index is None:
                raise ValueError("Buffer.from_tensor: the CUDA tensor's device has no index")
            return cls(base, nbytes, item_len, tensor, MemoryKind.CUDA, int(index))
        return cls(base, nbytes, item_len, tensor)

    @classmethod
    def of(cls, obj: Any, item_len: int) -> "Buffer":
        """The buffer covering a writable, C-contiguous Python buffer ``obj``
        (``bytearray``, ``numpy.ndarray``, ``mmap``, ...), which the registering
        engine then keeps alive."""
        mv = memoryview(obj)
        if mv.readonly:
            raise ValueError("Buffer.of needs a writable buffer (the peer writes into it)")
        if not mv.c_contiguous:
            raise ValueError("Buffer.of needs a C-contiguous buffer")
        view = (ctypes.c_char * mv.nbytes).from_buffer(mv)
        return cls(ctypes.addressof(view), mv.nbytes, item_len, (obj, view))


BufferLike = Union[Buffer, Sequence[int]]


def _buffers(
    bufs: Iterable[BufferLike], function: str, desc: bool | None = None
) -> tuple[Any, int, list[object]]:
    """The ``kvxfer_buffer`` array of ``bufs`` (host memory), or the
    ``kvxfer_buffer_desc`` array if ``desc`` (by default: if any of them is device
    memory, see :func:`_is_device`)."""
    items = list(bufs)
    device = _is_device(items) if desc is None else desc
    arr = ((_abi.BufferDesc if device else _abi.Buffer) * max(len(items), 1))()
    owners: list[object] = []
    for i, b in enumerate(items):
        kind, dev = MemoryKind.HOST, 0
        if isinstance(b, Buffer):
            base, length, item_len, owner, kind, dev = b
        else:
            try:
                base, length, item_len = b
            except (TypeError, ValueError):
                raise _invalid(
                    function, f"buffer {i} is not a Buffer or a (base, len, item_len) triple"
                ) from None
            owner = None
        for what, v in (("base", base), ("len", length), ("item_len", item_len)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > _U64_MAX:
                raise _invalid(function, f"buffer {i}: {what} {v!r} is not an address-sized int")
        arr[i].base, arr[i].len, arr[i].item_len = base or None, length, item_len
        if device:
            if isinstance(dev, bool) or not isinstance(dev, int) or not 0 <= dev <= 0xFFFFFFFF:
                raise _invalid(function, f"buffer {i}: device {dev!r} is not a CUDA ordinal")
            arr[i].struct_size = ctypes.sizeof(_abi.BufferDesc)
            arr[i].kind, arr[i].device = int(kind), dev
        if owner is not None:
            owners.append(owner)
    return arr, len(items), owners


def _is_device(items: list[Any]) -> bool:
    """Whether a registration has device memory (and so goes through the
    ``kvxfer_register_*_desc`` calls, which take the memory kind)."""
    return any(isinstance(b, Buffer) and b.kind != MemoryKind.HOST for b in items)


# ---------------------------------------------------------------------------------------
# Log sinks

LogSink = Union[logging.Logger, Callable[[LogLevel, str], None], None]
"""Where an engine's log lines go: a :class:`logging.Logger`, a callable taking
``(level, line)``, or None for the library's default (stderr)."""

TRACE = logging.DEBUG - 5
"""The :mod:`logging` level of the library's trace lines (5)."""

_PY_LEVELS = {
    LogLevel.ERROR: logging.ERROR,
    LogLevel.WARN: logging.WARNING,
    LogLevel.INFO: logging.INFO,
    LogLevel.DEBUG: logging.DEBUG,
    LogLevel.TRACE: TRACE,
}


def _sink_function(sink: LogSink) -> Any:
    emit: Callable[[Any, str], None]
    if sink is None:
        return _abi.LOG_FN()  # a NULL function pointer: the library's stderr
    if isinstance(sink, logging.Logger):
        logger = sink

        def emit(level: LogLevel, line: str) -> None:
            logger.log(_PY_LEVELS.get(level, logging.ERROR), "%s", line)

    elif callable(sink):
        emit = sink
    else:
        raise TypeError(f"log sink must be a logging.Logger, a callable or None, not {sink!r}")

    def callback(_ctx: object, level: int, line: bytes) -> None:
        try:
            lv: LogLevel | int = LogLevel(level)
        except ValueError:
            lv = level
        emit(lv, line.decode("utf-8", "replace"))  # type: ignore[arg-type]

    return _abi.LOG_FN(callback)


_DEFAULT_SINK = object()


class _Contexts:
    """Python objects the library holds as the ``ctx`` of a log sink
    (``kvxfer_config_set_log_sink2``): each ``ctx`` is a key here, and the library's one
    ``drop`` call for it releases the object. Configs and engines keep this registry
    (and so its ``drop`` callback) alive, since freeing them is what calls ``drop``."""

    def __init__(self) -> None:
        self._objects: dict[int, object] = {}
        self._next = 1
        self._lock = threading.Lock()
        self.drop = _abi.DROP_FN(self.release)

    def hold(self, obj: object) -> int:
        with self._lock:
            key, self._next = self._next, self._next + 1
            self._objects[key] = obj
        return key

    def release(self, ctx: int | None) -> None:
        with self._lock:
            self._objects.pop(ctx or 0, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._objects)


_CONTEXTS = _Contexts()


# ---------------------------------------------------------------------------------------
# Config


class Config:
    """An engine configuration (``kvxfer_config``): string keys and values.

    ``Config(role="decode", listen="0.0.0.0:0", auth_key_file="cluster.key")`` sets the
    keys given. Log lines go to
    the :mod:`logging` logger ``"kvxfer"`` unless ``log_sink`` says otherwise (None:
    the library's stderr). Not thread-safe, like the C handle: use one config from one
    thread at a time. A context manager; :meth:`close` releases the handle (engines
    keep their own copy).
    """

    @_wraps("kvxfer_config_new")
    def __init__(
        self,
        settings: Mapping[str, object] | None = None,
        /,
        *,
        log_sink: Any = _DEFAULT_SINK,
        **keys: object,
    ):
        """Creates a configuration with every key at its default, then sets ``settings``
        and ``keys``."""
        handle = ctypes.c_void_p()
        check(lib.kvxfer_config_new(ctypes.byref(handle)), "kvxfer_config_new")
        self._handle: int | None = handle.value
        self._sink: Any = None
        try:
            for k, v in {**(settings or {}), **keys}.items():
                self.set(k, v)
            self.set_log_sink(logging.getLogger("kvxfer") if log_sink is _DEFAULT_SINK else log_sink)
        except BaseException:
            self.close()
            raise

    def _h(self, function: str) -> int:
        if self._handle is None:
            raise ValueError(f"{function}: the config is closed")
        return self._handle

    @_wraps("kvxfer_config_set")
    def set(self, key: str, value: object) -> "Config":
        """Sets ``key`` to ``value`` (converted with ``str``; booleans as
        ``true``/``false``) and returns the config, so calls chain."""
        if isinstance(value, bool):
            value = "true" if value else "false"
        check(
            lib.kvxfer_config_set(
                self._h("kvxfer_config_set"), str(key).encode(), str(value).encode()
            ),
            "kvxfer_config_set",
        )
        return self

    @_wraps("kvxfer_config_set_log_sink2")
    @_wraps("kvxfer_config_set_log_sink")
    def set_log_sink(self, sink: LogSink) -> "Config":
        """Routes the log lines of engines created from this config to ``sink``: a
        :class:`logging.Logger` (library levels map to ERROR, WARNING, INFO, DEBUG and
        :data:`TRACE`), a callable ``(LogLevel, str)`` (called from library threads, so
        it must be thread-safe and must not call into the engine that logs), or None
        for stderr (``kvxfer_config_set_log_sink``). Lines below the ``log_level`` key
        never reach the sink. A sink is handed to the library
        (``kvxfer_config_set_log_sink2``), which releases it once the config and every
        engine using it are freed."""
        h = self._h("kvxfer_config_set_log_sink")
        fn = _sink_function(sink)
        if not fn:
            check(lib.kvxfer_config_set_log_sink(h, fn, None), "kvxfer_config_set_log_sink")
        else:
            ctx = _CONTEXTS.hold(fn)
            status = lib.kvxfer_config_set_log_sink2(h, fn, ctx, _CONTEXTS.drop)
            if status != Status.OK:
                _CONTEXTS.release(ctx)  # on error the context stays ours
            check(status, "kvxfer_config_set_log_sink2")
        self._sink = _CONTEXTS
        return self

    @_wraps("kvxfer_config_free")
    def close(self) -> None:
        """Releases the configuration; a second call does nothing."""
        if self._handle is not None:
            lib.kvxfer_config_free(self._handle)
            self._handle = None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._handle is None

    def __enter__(self) -> "Config":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


# ---------------------------------------------------------------------------------------
# Engine

_LIVE_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@atexit.register
def _close_live_engines() -> None:
    # Library threads must be joined before the interpreter goes away: a log line
    # arriving in a Python sink during finalisation would find no interpreter.
    for engine in list(_LIVE_ENGINES):
        engine.close()


class Engine:
    """A running transfer engine (``kvxfer_engine``).

    ``Engine(config)`` starts one from a :class:`Config`; ``Engine(role="prefill")``
    (or a mapping of keys) builds the config itself. A context manager: leaving the
    block (or :meth:`close`) stops the engine — live rooms fail with "engine shut
    down" and every library thread is joined. Every method is safe from any thread;
    :meth:`close` waits for calls in progress on other threads, and calls after it
    raise ``ValueError``. Memory registered with an engine must stay valid until it is
    closed (buffers from :meth:`Buffer.of` are kept alive by the engine).
    """

    @_wraps("kvxfer_engine_new")
    def __init__(self, config: Config | Mapping[str, object] | None = None, /, **keys: object):
        """Starts an engine: it binds its listening socket and starts its threads
        before this returns."""
        own = not isinstance(config, Config)
        if isinstance(config, Config):
            if keys:
                raise TypeError("Engine(config, **keys): set the keys on the Config instead")
            cfg = config
        else:
            cfg = Config(config, **keys)
        try:
            handle = ctypes.c_void_p()
            check(lib.kvxfer_engine_new(cfg._h("kvxfer_engine_new"), ctypes.byref(handle)),
                  "kvxfer_engine_new")
        finally:
            sink = cfg._sink
            if own:
                cfg.close()
        self._handle: int | None = handle.value
        # The log sink's registry (whose drop the engine's free calls) must outlive the
        # engine, and so must registered memory.
        self._keep: list[object] = [sink]
        self._cond = threading.Condition(threading.Lock())
        self._calls = 0
        self._address: str | None = None
        _LIVE_ENGINES.add(self)

    # -- lifetime ----------------------------------------------------------------------

    def _enter(self, function: str) -> int:
        with self._cond:
            if self._handle is None:
                raise ValueError(f"{function}: the engine is closed")
            self._calls += 1
            return self._handle

    def _leave(self) -> None:
        with self._cond:
            self._calls -= 1
            if self._calls == 0:
                self._cond.notify_all()

    def _call(self, name: str, *args: Any) -> None:
        h = self._enter(name)
        try:
            check(getattr(lib, name)(h, *args), name)
        finally:
            self._leave()

    @_wraps("kvxfer_engine_free")
    def close(self) -> None:
        """Stops the engine (waiting for calls in progress on other threads); a second
        call does nothing."""
        with self._cond:
            if self._handle is None:
                return
            handle, self._handle = self._handle, None
            # A call asleep in wait() returns at once instead of at its timeout (the
            # engine is still alive: kvxfer_engine_free comes below).
            if self._calls:
                lib.kvxfer_engine_wake(handle)
            while self._calls:
                self._cond.wait()
        lib.kvxfer_engine_free(handle)
        _LIVE_ENGINES.discard(self)
        self._keep.clear()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._handle is None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- strings -----------------------------------------------------------------------

    def _string(self, name: str, *args: Any) -> str:
        h = self._enter(name)
        try:
            size = 256
            for _ in range(4):
                buf = ctypes.create_string_buffer(size)
                n = ctypes.c_size_t()
                st = getattr(lib, name)(h, *args, buf, size, ctypes.byref(n))
                if st == Status.BUFFER_TOO_SMALL and n.value + 1 > size:
                    size = n.value + 1
                    continue
                check(st, name)
                return buf.raw[: n.value].decode("utf-8", "replace")
            check(st, name)
            raise AssertionError("unreachable")
        finally:
            self._leave()

    @property
    @_wraps("kvxfer_engine_address")
    def address(self) -> str:
        """The ``host:port`` that peers connect to."""
        if self._address is None:
            self._address = self._string("kvxfer_engine_address")
        return self._address

    @property
    @_wraps("kvxfer_engine_id")
    def engine_id(self) -> int:
        """This engine's id, which it claims when it connects to a peer: give a decode
        engine's id to :meth:`room_create_for` on the prefill side."""
        n = ctypes.c_uint64()
        self._call("kvxfer_engine_id", ctypes.byref(n))
        return n.value

    # -- waiting -----------------------------------------------------------------------

    @_wraps("kvxfer_engine_wait")
    def wait(self, seen: int, timeout: float) -> int:
        """Sleeps (without the GIL) until a room of this engine changes state or
        :meth:`wake` is called, after the count ``seen``, or ``timeout`` seconds pass;
        returns the count of changes. Read :meth:`changes`, poll the rooms, then
        ``wait(seen, ...)``: no change in between is missed. :meth:`close` wakes it."""
        if isinstance(seen, bool) or not isinstance(seen, int) or not 0 <= seen <= _U64_MAX:
            raise _invalid("kvxfer_engine_wait", f"seen {seen!r} is not an integer in 0..2^64-1")
        if not timeout >= 0:
            raise _invalid("kvxfer_engine_wait", f"timeout {timeout!r} is not >= 0 seconds")
        ms = min(int(timeout * 1000), 0xFFFF_FFFF)
        n = ctypes.c_uint64()
        self._call("kvxfer_engine_wait", seen, ms, ctypes.byref(n))
        return n.value

    def changes(self) -> int:
        """The count of changes :meth:`wait` waits past."""
        return self.wait(0, 0)

    @_wraps("kvxfer_engine_wake")
    def wake(self) -> None:
        """Wakes every :meth:`wait`, as a room's change would (for the host's own events)."""
        self._call("kvxfer_engine_wake")

    # -- registration ------------------------------------------------------------------

    @_wraps("kvxfer_register_kv")
    def register_kv(self, buffers: Iterable[BufferLike]) -> None:
        """Registers the KV buffers (each a :class:`Buffer` or a ``(base, len,
        item_len)`` triple of ints), once, before any room is created."""
        buffers = list(buffers)
        if _is_device(buffers):
            return self.register_kv_desc(buffers)
        arr, n, owners = _buffers(buffers, "kvxfer_register_kv")
        self._call("kvxfer_register_kv", arr, n)
        self._keep.extend(owners)

    @_wraps("kvxfer_register_kv_layers")
    def register_kv_layers(self, buffers: Iterable[BufferLike], layer_ids: PageList) -> None:
        """Registers the KV buffers with a layer id each (``layer_ids[i]`` for
        ``buffers[i]``: any uint32 buffer or sequence of ints), instead of
        :meth:`register_kv`."""
        buffers = list(buffers)
        if _is_device(buffers):
            return self.register_kv_desc(buffers, layer_ids=layer_ids)
        arr, n, owners = _buffers(buffers, "kvxfer_register_kv_layers")
        ids = _Pages(layer_ids, "kvxfer_register_kv_layers")
        if ids.n != n:
            raise _invalid("kvxfer_register_kv_layers",
                           f"{n} buffers but {ids.n} layer ids")
        self._call("kvxfer_register_kv_layers", arr, ids.ptr, n)
        self._keep.extend(owners)

    @_wraps("kvxfer_register_kv_layout")
    def register_kv_layout(
        self,
        buffers: Iterable[BufferLike],
        *,
        kv_heads: int,
        head_dim: int,
        dtype_bytes: int,
        page_tokens: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        page_order: PageOrder = PageOrder.HND,
        kind: KvKind = KvKind.HEADS,
        layer_ids: PageList | None = None,
    ) -> None:
        """Registers the KV buffers with the layout of their pages (and, if given, a
        layer id each), instead of :meth:`register_kv`. The keywords are the fields of
        ``kvxfer_kv_layout``; ``struct_size`` is filled in."""
        buffers = list(buffers)
        fn = "kvxfer_register_kv_desc" if _is_device(buffers) else "kvxfer_register_kv_layout"
        arr, n, owners = _buffers(buffers, fn)
        ids = None if layer_ids is None else _Pages(layer_ids, fn)
        if ids is not None and ids.n != n:
            raise _invalid(fn, f"{n} buffers but {ids.n} layer ids")
        try:
            layout = _abi.KvLayout(
                ctypes.sizeof(_abi.KvLayout), kv_heads, head_dim, dtype_bytes, tp_rank,
                tp_size, page_tokens, int(page_order), int(kind))
        except TypeError as e:
            raise _invalid(fn, f"layout: {e}") from None
        # Both calls take (buffers, layer ids, n, layout).
        self._call(fn, arr, None if ids is None else ids.ptr, n, ctypes.byref(layout))
        self._keep.extend(owners)

    @_wraps("kvxfer_register_aux")
    def register_aux(self, buffers: Iterable[BufferLike]) -> None:
        """Registers the aux buffers (per-request metadata rows, indexed by slot), once."""
        buffers = list(buffers)
        if _is_device(buffers):
            return self.register_aux_desc(buffers)
        arr, n, owners = _buffers(buffers, "kvxfer_register_aux")
        self._call("kvxfer_register_aux", arr, n)
        self._keep.extend(owners)

    @_wraps("kvxfer_register_aux_desc")
    def register_aux_desc(self, buffers: Iterable[BufferLike]) -> None:
        """Registers the aux buffers with their memory kind (:meth:`register_aux` comes
        here by itself when a buffer is device memory)."""
        arr, n, owners = _buffers(buffers, "kvxfer_register_aux_desc", desc=True)
        self._call("kvxfer_register_aux_desc", arr, n)
        self._keep.extend(owners)

    @_wraps("kvxfer_register_kv_desc")
    def register_kv_desc(
        self, buffers: Iterable[BufferLike], *, layer_ids: PageList | None = None
    ) -> None:
        """Registers the KV buffers with their memory kind (a :class:`Buffer` from
        :meth:`Buffer.from_tensor` of a CUDA tensor is device memory), and a layer id
        each if given. :meth:`register_kv`, :meth:`register_kv_layers` and
        :meth:`register_kv_layout` come here by themselves when a buffer is device
        memory. Without the CUDA driver this raises the error of
        ``KVXFER_ERR_TRANSPORT_UNAVAILABLE``, naming what is missing."""
        fn = "kvxfer_register_kv_desc"
        buffers = list(buffers)
        arr, n, owners = _buffers(buffers, fn, desc=True)
        ids = None if layer_ids is None else _Pages(layer_ids, fn)
        if ids is not None and ids.n != n:
            raise _invalid(fn, f"{n} buffers but {ids.n} layer ids")
        self._call(fn, arr, None if ids is None else ids.ptr, n, None)
        self._keep.extend(owners)

    # -- metrics -----------------------------------------------------------------------

    @_wraps("kvxfer_engine_metrics")
    def metrics(self) -> dict[str, Any]:
        """The engine's counters and gauges as a dict: each field of ``kvxfer_metrics``
        by name; ``rooms_failed_by_cause`` as ``{FailureCause: count}`` and
        ``rooms_by_state`` as ``{RoomState: count}``."""
        m = _abi.Metrics()
        self._call("kvxfer_engine_metrics", ctypes.byref(m), ctypes.sizeof(m))
        out: dict[str, Any] = {}
        for name, *_ in _abi.Metrics._fields_:
            v = getattr(m, name)
            if name == "rooms_failed_by_cause":
                out[name] = {c: int(v[c]) for c in FailureCause}
            elif name == "rooms_by_state":
                out[name] = {s: int(v[s]) for s in RoomState}
            else:
                out[name] = int(v)
        return out

    @_wraps("kvxfer_engine_metrics_text")
    def metrics_text(self) -> str:
        """The same metrics in the Prometheus text exposition format."""
        return self._string("kvxfer_engine_metrics_text")

    # -- rooms -------------------------------------------------------------------------

    @_wraps("kvxfer_room_create")
    def room_create(
        self, room: int, peers: Sequence[str] | None = None, *, decode_engines: int = 0
    ) -> None:
        """Creates room ``room`` in BOOTSTRAPPING. Decode engine: ``peers`` are the
        ``host:port`` addresses of the prefill engines the room pulls from. Prefill
        engine: leave ``peers`` None; ``decode_engines`` is how many decode engines will
        send a destination (0 means 1)."""
        room = _room_id(room, "kvxfer_room_create")
        if peers is None:
            if isinstance(decode_engines, bool) or not isinstance(decode_engines, int) \
                    or not 0 <= decode_engines <= _U64_MAX:
                raise _invalid("kvxfer_room_create", f"decode_engines {decode_engines!r} is not a count")
            self._call("kvxfer_room_create", room, None, decode_engines)
            return
        if isinstance(peers, (str, bytes)):
            raise _invalid("kvxfer_room_create", "peers must be a sequence of addresses, not one string")
        encoded = [p.encode() if isinstance(p, str) else bytes(p) for p in peers]
        arr = (ctypes.c_char_p * max(len(encoded), 1))(*encoded)
        self._call("kvxfer_room_create", room, arr, len(encoded))

    @_wraps("kvxfer_room_create_from")
    def room_create_from(self, room: int, instance: str) -> None:
        """Decode engine only: creates room ``room`` pulling from every rank of prefill
        instance ``instance``, found in the engine's copy of the registry (config key
        ``discovery``), in rank order. Never waits for etcd; an instance that is not
        (wholly) registered raises with ``KVXFER_ERR_NOT_FOUND``."""
        name = "kvxfer_room_create_from"
        room = _room_id(room, name)
        if not isinstance(instance, str):
            raise _invalid(name, f"instance {instance!r} is not a string")
        self._call(name, room, instance.encode())

    @_wraps("kvxfer_room_create_for")
    def room_create_for(self, room: int, decode_ids: Sequence[int]) -> None:
        """Prefill engine only: creates room ``room`` bound to the decode engines whose
        :attr:`engine_id` ``decode_ids`` lists, one destination from each; a destination
        or abort from any other engine is refused and counted (``binding_refusals``)."""
        name = "kvxfer_room_create_for"
        room = _room_id(room, name)
        ids = list(decode_ids) if not isinstance(decode_ids, (str, bytes, int)) else None
        if ids is None or any(isinstance(i, bool) or not isinstance(i, int)
                              or not 0 <= i <= _U64_MAX for i in ids):
            raise _invalid(name, f"decode_ids {decode_ids!r} is not a sequence of integers "
                                 "in 0..2^64-1")
        arr = (ctypes.c_uint64 * max(len(ids), 1))(*ids)
        self._call(name, room, arr, len(ids))

    @_wraps("kvxfer_room_set_destination")
    def room_set_destination(self, room: int, pages: PageList, aux_slot: int | None = None) -> None:
        """Decode engine only: the pages (into the KV buffers, filled in order by the
        prefill's chunks) and the aux slot (None for none) of room ``room``."""
        name = "kvxfer_room_set_destination"
        p = _Pages(pages, name)
        self._call(name, _room_id(room, name), p.ptr, p.n, _slot(aux_slot, name))

    @_wraps("kvxfer_enqueue_chunk")
    def enqueue_chunk(
        self, room: int, pages: PageList, is_last: bool = False, aux_slot: int | None = None
    ) -> None:
        """Prefill engine only: queues the next chunk of room ``room`` (source pages);
        ``is_last`` closes the room and ``aux_slot`` (only with ``is_last``) names the
        source aux slot. Never blocks on the network."""
        name = "kvxfer_enqueue_chunk"
        p = _Pages(pages, name)
        self._call(name, _room_id(room, name), p.ptr, p.n, bool(is_last), _slot(aux_slot, name))

    @_wraps("kvxfer_enqueue_layers")
    def enqueue_layers(
        self,
        room: int,
        pages: PageList,
        layer_first: int,
        layer_count: int = 1,
        is_last: bool = False,
        aux_slot: int | None = None,
    ) -> None:
        """Prefill engine only: queues layers ``layer_first .. layer_first +
        layer_count`` of the chunk of source ``pages`` of room ``room``, as soon as they
        are computed. The first call with a page list opens the chunk; later calls with
        the same list add layers. ``is_last`` closes the room (every chunk must then have
        every layer); ``aux_slot`` only with ``is_last``. Never blocks on the network."""
        name = "kvxfer_enqueue_layers"
        p = _Pages(pages, name)
        self._call(
            name,
            _room_id(room, name),
            p.ptr,
            p.n,
            _u32(layer_first, "layer_first", name),
            _u32(layer_count, "layer_count", name),
            bool(is_last),
            _slot(aux_slot, name),
        )

    @_wraps("kvxfer_room_layers_landed")
    def room_layers_landed(self, room: int) -> int:
        """Decode engine only: how many of room ``room``'s first layers (in layer order)
        have landed whole; never blocks."""
        name = "kvxfer_room_layers_landed"
        n = ctypes.c_uint32()
        self._call(name, _room_id(room, name), ctypes.byref(n))
        return n.value

    @_wraps("kvxfer_room_poll")
    def room_poll(self, room: int) -> RoomState:
        """The state of room ``room``; never blocks."""
        state = ctypes.c_int32()
        self._call("kvxfer_room_poll", _room_id(room, "kvxfer_room_poll"), ctypes.byref(state))
        return RoomState(state.value)

    @_wraps("kvxfer_room_abort")
    def room_abort(self, room: int, reason: str | None = None) -> None:
        """Fails live room ``room`` with ``reason`` (None: the library's default text)
        and tells its peers; no effect on a terminal room."""
        name = "kvxfer_room_abort"
        self._call(name, _room_id(room, name), None if reason is None else reason.encode())

    @_wraps("kvxfer_room_failure")
    def room_failure(self, room: int) -> str:
        """The first recorded failure reason of FAILED room ``room`` (``"peer: ..."`` if
        it came from the peer engine)."""
        return self._string("kvxfer_room_failure", _room_id(room, "kvxfer_room_failure"))

    @_wraps("kvxfer_room_failure_cause")
    def room_failure_cause(self, room: int) -> tuple[FailureCause | int, bool]:
        """``(cause, from_peer)`` of FAILED room ``room``: the class of its failure and
        whether the reason came from the peer engine."""
        name = "kvxfer_room_failure_cause"
        cause, from_peer = ctypes.c_int32(), ctypes.c_bool()
        self._call(name, _room_id(room, name), ctypes.byref(cause), ctypes.byref(from_peer))
        try:
            c: FailureCause | int = FailureCause(cause.value)
        except ValueError:
            c = cause.value
        return c, bool(from_peer.value)

    @_wraps("kvxfer_room_verified")
    def room_verified(self, room: int) -> bool:
        """Decode only: whether room ``room`` reached SUCCESS with every byte verified
        (``integrity=verify``: each data run's digest matched where it landed)."""
        name = "kvxfer_room_verified"
        v = ctypes.c_bool()
        self._call(name, _room_id(room, name), ctypes.byref(v))
        return bool(v.value)

    @_wraps("kvxfer_room_path")
    def room_path(self, room: int) -> DataPath | int:
        """The path room ``room``'s data takes with its peer engines (:class:`DataPath`:
        ``TCP``, ``RDMA``, ``SAME_HOST``, ``CUDA_IPC``; ``MIXED`` when its peers differ, ``UNKNOWN``
        before any is paired)."""
        name = "kvxfer_room_path"
        path = ctypes.c_int32()
        self._call(name, _room_id(room, name), ctypes.byref(path))
        try:
            return DataPath(path.value)
        except ValueError:
            return path.value

    @_wraps("kvxfer_room_drained")
    def room_drained(self, room: int) -> bool:
        """Whether room ``room`` is terminal and its memory may be reused."""
        name = "kvxfer_room_drained"
        drained = ctypes.c_bool()
        self._call(name, _room_id(room, name), ctypes.byref(drained))
        return bool(drained.value)

    @_wraps("kvxfer_room_clear")
    def room_clear(self, room: int) -> None:
        """Releases room ``room`` (aborting it first if live); the id may then be reused."""
        self._call("kvxfer_room_clear", _room_id(room, "kvxfer_room_clear"))

    def __repr__(self) -> str:
        if self._handle is None:
            return "<kvxfer.Engine closed>"
        return f"<kvxfer.Engine at {self.address}>"


@_wraps("kvxfer_version")
def library_version() -> str:
    """The version of the loaded libkvxfer, such as ``"0.1.0"``."""
    return lib.kvxfer_version().decode()


@_wraps("kvxfer_room_state_str")
def room_state_name(state: int) -> str:
    """The C name of a room state, such as ``"KVXFER_ROOM_SUCCESS"``;
    ``"KVXFER_UNKNOWN_ROOM_STATE"`` for a value that names no state."""
    return lib.kvxfer_room_state_str(int(state)).decode()


@_wraps("kvxfer_failure_cause_str")
def failure_cause_name(cause: int) -> str:
    """The C name of a failure cause, such as ``"KVXFER_CAUSE_PEER_LOST"``;
    ``"KVXFER_UNKNOWN_CAUSE"`` for a value that names no cause."""
    return lib.kvxfer_failure_cause_str(int(cause)).decode()


def _register_module_wrappers() -> None:
    from . import errors

    _wraps("kvxfer_status_str")(errors.status_name)
    _wraps("kvxfer_last_error")(errors.last_error)


_register_module_wrappers()
