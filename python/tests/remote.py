"""An engine in another process, driven from the test by messages over a pipe.

``RemoteEngine(role=..., **keys)`` starts a process (``spawn``) that creates a
``kvxfer.Engine`` with those keys and KV and aux buffers in numpy arrays, registered
by integer address (as servers register ``tensor.data_ptr()``). Engine methods are
called with ``remote.call("room_poll", room)``; an exception raised there comes back
as the same class (``KvxferError`` subclasses pickle with status and message).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import numpy as np

PAGE_BYTES = 4096


def pattern(seed: int, buf: int, npages: int, page_bytes: int = PAGE_BYTES) -> np.ndarray:
    """The bytes a prefill writes for ``npages`` pages of buffer ``buf`` of one request:
    pseudo-random, different per seed and buffer."""
    rng = np.random.default_rng([seed, buf])
    return rng.integers(0, 256, size=(npages, page_bytes), dtype=np.uint8)


def _serve(conn: Any, keys: dict, n_bufs: int, n_pages: int, n_aux: int, aux_bytes: int) -> None:
    import kvxfer

    state: dict[str, Any] = {}
    try:
        engine = kvxfer.Engine(**keys)
        kv = [np.zeros((n_pages, PAGE_BYTES), dtype=np.uint8) for _ in range(n_bufs)]
        aux = np.zeros((n_aux, aux_bytes), dtype=np.uint8)
        state.update(engine=engine, kv=kv, aux=aux)
        conn.send(("ready", engine.address))
    except BaseException as e:  # the test sees why the engine did not start
        conn.send(("err", e))
        return

    def register(layer_ids: Any = None) -> None:
        bufs = [(a.ctypes.data, a.nbytes, PAGE_BYTES) for a in kv]
        if layer_ids is None:
            engine.register_kv(bufs)
        else:
            engine.register_kv_layers(bufs, layer_ids)
        engine.register_aux([(aux.ctypes.data, aux.nbytes, aux_bytes)])

    def fill(seed: int, pages: list[int]) -> None:
        for b, a in enumerate(kv):
            a[pages] = pattern(seed, b, len(pages))

    def read(pages: list[int]) -> list[bytes]:
        return [a[pages].tobytes() for a in kv]

    def fill_aux(slot: int, data: bytes) -> None:
        aux[slot, : len(data)] = np.frombuffer(data, dtype=np.uint8)

    def read_aux(slot: int) -> bytes:
        return aux[slot].tobytes()

    def wait(room: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            s = engine.room_poll(room)
            if s in (kvxfer.RoomState.SUCCESS, kvxfer.RoomState.FAILED) or time.monotonic() > deadline:
                return int(s)
            time.sleep(0.002)

    ops = {"register": register, "fill": fill, "read": read, "fill_aux": fill_aux,
           "read_aux": read_aux, "wait": wait}
    while True:
        msg = conn.recv()
        if msg is None:
            break
        op, args, kwargs = msg
        try:
            if op == "call":
                name, *rest = args
                result = getattr(engine, name)(*rest, **kwargs)
                if isinstance(result, kvxfer.RoomState):
                    result = int(result)
            else:
                result = ops[op](*args, **kwargs)
            conn.send(("ok", result))
        except BaseException as e:
            conn.send(("err", e))
    engine.close()
    conn.send(("closed", None))


class RemoteEngine:
    def __init__(self, n_bufs: int = 3, n_pages: int = 64, n_aux: int = 8, aux_bytes: int = 64,
                 **keys: Any):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, keys, n_bufs, n_pages, n_aux, aux_bytes),
                                daemon=True)
        self.proc.start()
        kind, value = self.conn.recv()
        if kind == "err":
            self.proc.join(5)
            raise value
        self.address: str = value
        self.n_bufs = n_bufs

    def _rpc(self, op: str, *args: Any, **kwargs: Any) -> Any:
        self.conn.send((op, args, kwargs))
        kind, value = self.conn.recv()
        if kind == "err":
            raise value
        return value

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._rpc("call", name, *args, **kwargs)

    def __getattr__(self, op: str) -> Any:
        if op in ("register", "fill", "read", "fill_aux", "read_aux", "wait"):
            return lambda *a, **k: self._rpc(op, *a, **k)
        raise AttributeError(op)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(None)
                self.conn.recv()
            except (EOFError, OSError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
