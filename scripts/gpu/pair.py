#!/usr/bin/env python3
"""Two engines in two processes moving KV pages, for scripts/gpu-check.sh.

This process is the decode side; it starts each prefill side as a spawned process that
runs the steps it is sent (create, enqueue, wait, abort, ...), so every case is written
once, here, and runs the same whatever the memory is:

    --mem torch   CUDA device memory from PyTorch (cudaMalloc through its caching
                  allocator; VMM with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,
                  which gpu-check.sh sets for the vmm runs)
    --mem fake    "device" memory of the CUDA driver's test double (tests/fakecuda,
                  KVXFER_CUDA_LIBRARY pointing at it): the same engine code path on a
                  machine without a GPU, to check this script; says nothing about GPUs
    --mem host    host memory (numpy): the baseline of the benchmark

--path staging (TCP staging: same_host=off on both engines) or --path ipc (CUDA IPC:
same_host=require on both engines, so that a pairing that cannot take it fails its rooms
with the reason instead of falling back); every case reports the path its rooms took and
fails if it is not the one asked for (host memory takes TCP with staging, the same-host
copy with ipc).

Cases: scattered (byte-exact scattered pages, two buffers), heads (head slices: two
prefill ranks of TP 2 into one decode rank), layers (a layer-wise room), abort (an abort
after the first chunk, from decode then from prefill: FAILED with its reason on both
sides, and after room_drained the pages of the second chunk keep their poison), bench
(GB/s over TCP at 1 MiB pages x 4 rooms in flight and at 32 KiB pages). Prints one JSON
line per case; exits nonzero if a check failed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import sys
import time

import numpy as np

import kvxfer

POISON = 0xA5
TERMINAL = (kvxfer.RoomState.SUCCESS, kvxfer.RoomState.FAILED)


def pattern(seed: int, b: int, pages: int, item: int) -> np.ndarray:
    """The source bytes of buffer ``b`` of rank ``seed``: (pages, item) uint8."""
    i = np.arange(item, dtype=np.uint32)[None, :]
    p = np.arange(pages, dtype=np.uint32)[:, None]
    return ((i * 7 + p * 13 + b * 101 + seed * 31) % 251).astype(np.uint8)


class Memory:
    """``n`` buffers of ``pages`` x ``item`` bytes of one kind, filled with the source
    pattern of ``seed`` or with POISON."""

    def __init__(self, mem: str, n: int, pages: int, item: int, seed: int | None):
        self.mem, self.pages, self.item = mem, pages, item
        self.keep: list[object] = []
        self.bufs: list[kvxfer.Buffer] = []
        for b in range(n):
            data = pattern(seed, b, pages, item) if seed is not None else np.full(
                (pages, item), POISON, np.uint8)
            self.bufs.append(self._alloc(data))

    def _alloc(self, data: np.ndarray) -> kvxfer.Buffer:
        if self.mem == "host":
            a = np.ascontiguousarray(data)
            return kvxfer.Buffer.of(a, self.item)
        if self.mem == "torch":
            import torch

            t = torch.from_numpy(data).to("cuda").contiguous()
            torch.cuda.synchronize()
            return kvxfer.Buffer.from_tensor(t, self.item)
        fake = _fake()
        if os.environ.get("KVXFER_GPU_CHECK_ALLOC") == "vmm" and data.nbytes % 4 == 0:
            # A VMM range of four physical allocations, as expandable segments make.
            ptr = fake.fakecuda_alloc_vmm(0, data.nbytes // 4, 4)
        else:
            ptr = fake.fakecuda_alloc(0, data.nbytes)
        ctypes.memmove(ptr, data.ctypes.data, data.nbytes)
        return kvxfer.Buffer(ptr, data.nbytes, self.item, None, kvxfer.MemoryKind.CUDA, 0)

    def read(self, b: int) -> np.ndarray:
        """Buffer ``b`` as (pages, item) bytes, copied to the host."""
        buf = self.bufs[b]
        if self.mem == "torch":
            import torch

            torch.cuda.synchronize()
            return buf.owner.cpu().numpy().reshape(self.pages, self.item)
        raw = ctypes.string_at(buf.base, buf.len)
        return np.frombuffer(raw, np.uint8).reshape(self.pages, self.item)


_FAKE = None


def _fake() -> ctypes.CDLL:
    global _FAKE
    if _FAKE is None:
        _FAKE = ctypes.CDLL(os.environ["KVXFER_CUDA_LIBRARY"])
        _FAKE.fakecuda_alloc.restype = ctypes.c_void_p
        _FAKE.fakecuda_alloc.argtypes = [ctypes.c_int, ctypes.c_size_t]
        _FAKE.fakecuda_alloc_vmm.restype = ctypes.c_void_p
        _FAKE.fakecuda_alloc_vmm.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
    return _FAKE


def wait(engine: kvxfer.Engine, room: int, limit: float = 60.0) -> kvxfer.RoomState:
    end = time.monotonic() + limit
    while (s := engine.room_poll(room)) not in TERMINAL:
        if time.monotonic() > end:
            raise TimeoutError(f"room {room} stuck in {s.name}")
        time.sleep(0.0005)
    return s


def register(engine: kvxfer.Engine, m: Memory, layout: dict | None, layers: list[int] | None):
    if layout is not None:
        engine.register_kv_layout(m.bufs, **layout)
    elif layers is not None:
        engine.register_kv_layers(m.bufs, layers)
    else:
        engine.register_kv(m.bufs)


def prefill_main(conn, mem: str, spec: dict) -> None:
    """A prefill process: registers its memory, sends its address, then runs steps."""
    m = Memory(mem, spec["bufs"], spec["pages"], spec["item"], spec["seed"])
    with kvxfer.Engine(role="prefill", transport="tcp", same_host=spec.get("same_host", "auto"),
                       workers=spec.get("workers", 2)) as e:
        register(e, m, spec.get("layout"), spec.get("layers"))
        conn.send(e.address)
        while True:
            step = conn.recv()
            op, args = step[0], step[1:]
            try:
                if op == "quit":
                    conn.send(None)
                    return
                if op == "create":
                    e.room_create(args[0])
                    out = None
                elif op == "enqueue":
                    e.enqueue_chunk(args[0], np.asarray(args[1], np.uint32), is_last=args[2])
                    out = None
                elif op == "layers":
                    room, pages, first, count, last = args
                    e.enqueue_layers(room, np.asarray(pages, np.uint32), first, count, last)
                    out = None
                elif op == "wait":
                    out = wait(e, args[0]).name
                elif op == "abort":
                    e.room_abort(args[0], args[1])
                    out = None
                elif op == "failure":
                    out = e.room_failure(args[0])
                elif op == "drained":
                    out = e.room_drained(args[0])
                elif op == "bench":
                    out = bench_prefill(e, *args)
                else:
                    raise ValueError(f"unknown step {op}")
                conn.send(("ok", out))
            except Exception as err:  # reported to the driver, which fails the case
                conn.send(("err", f"{type(err).__name__}: {err}"))


def bench_prefill(e: kvxfer.Engine, rooms: list[int], per_room: int, inflight: int,
                  pages: int) -> float:
    live: list[int] = []
    for k, room in enumerate(rooms):
        while len(live) >= inflight:
            live = [r for r in live if e.room_poll(r) not in TERMINAL]
            if len(live) >= inflight:
                time.sleep(0.0002)
        e.room_create(room)
        src = (np.arange(per_room, dtype=np.uint32) + (k * per_room) % (pages - per_room + 1))
        e.enqueue_chunk(room, src.astype(np.uint32), is_last=True)
        live.append(room)
    for r in live:
        wait(e, r)
    return 0.0


# The engines' same_host setting, from --path: "off" (TCP staging) or "require" (CUDA IPC).
SAME_HOST = "off"


def want_path(mem: str) -> str:
    if SAME_HOST == "off":
        return "TCP"
    return "SAME_HOST" if mem == "host" else "CUDA_IPC"


def path_error(d: kvxfer.Engine, room: int, mem: str) -> str | None:
    path = kvxfer.DataPath(d.room_path(room)).name
    return None if path == want_path(mem) else f"room {room} took {path}, not {want_path(mem)}"


class Prefill:
    def __init__(self, mem: str, spec: dict):
        spec = {"same_host": SAME_HOST, **spec}
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=prefill_main, args=(child, mem, spec), daemon=True)
        self.proc.start()
        self.address = self.conn.recv()

    def __call__(self, *step):
        self.conn.send(step)
        status, out = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"prefill step {step[0]}: {out}")
        return out

    def close(self):
        self.conn.send(("quit",))
        self.conn.recv()
        self.proc.join(30)


def decode(mem: str, m: Memory, **keys) -> kvxfer.Engine:
    keys = {"same_host": SAME_HOST, **keys}
    return kvxfer.Engine(role="decode", transport="tcp", **keys)


def check_pages(m: Memory, dst, src, seed: int, bufs=None) -> str | None:
    for b in range(len(m.bufs)) if bufs is None else bufs:
        got = m.read(b)
        want = pattern(seed, b, m.pages, m.item)
        for s, d in zip(src, dst):
            if not np.array_equal(got[d], want[s]):
                return f"buffer {b}: page {d} differs from source page {s}"
    return None


def check_poison(m: Memory, dst) -> str | None:
    for b in range(len(m.bufs)):
        got = m.read(b)
        for d in dst:
            if not (got[d] == POISON).all():
                return f"buffer {b}: page {d} was written"
    return None


def case_scattered(mem: str) -> dict:
    spec = dict(bufs=2, pages=64, item=256 << 10, seed=1)
    p = Prefill(mem, spec)
    m = Memory(mem, 2, 64, 256 << 10, None)
    src = [0, 1, 2, 3, 9, 8, 40, 41, 42, 63, 5, 6]
    dst = [63, 62, 0, 1, 2, 3, 10, 11, 12, 30, 31, 32]
    with decode(mem, m) as d:
        d.register_kv(m.bufs)
        d.room_create(1, [p.address])
        d.room_set_destination(1, np.asarray(dst, np.uint32))
        p("create", 1)
        p("enqueue", 1, src[:5], False)
        p("enqueue", 1, src[5:], True)
        state = wait(d, 1)
        pstate = p("wait", 1)
        why = d.room_failure(1) if state == kvxfer.RoomState.FAILED else None
        why = why or (None if pstate == "SUCCESS" else f"prefill room {pstate}")
        path = kvxfer.DataPath(d.room_path(1)).name
        bad = why or path_error(d, 1, mem) or check_pages(m, dst, src, 1)
        bad = bad or check_poison(m, [4, 5, 20, 50])
    p.close()
    return dict(ok=bad is None, state=state.name, room_path=path, error=bad)


def case_heads(mem: str) -> dict:
    lay = dict(kv_heads=2, head_dim=128, dtype_bytes=2, page_tokens=32)
    ps = [Prefill(mem, dict(bufs=2, pages=32, item=8192, seed=10 + r,
                            layout=dict(lay, tp_rank=r, tp_size=2))) for r in range(2)]
    m = Memory(mem, 2, 32, 16384, None)
    src, dst = [3, 4, 10, 31], [0, 5, 6, 7]
    bad = None
    with decode(mem, m) as d:
        d.register_kv_layout(m.bufs, **lay)
        d.room_create(2, [p.address for p in ps])
        d.room_set_destination(2, np.asarray(dst, np.uint32))
        for p in ps:
            p("create", 2)
            p("enqueue", 2, src, True)
        state = wait(d, 2)
        for p in ps:
            p("wait", 2)
        if state != kvxfer.RoomState.SUCCESS:
            bad = d.room_failure(2)
        elif path_error(d, 2, mem):
            bad = path_error(d, 2, mem)
        else:
            for b in range(2):
                got = m.read(b)
                for r in range(2):
                    want = pattern(10 + r, b, 32, 8192)
                    for s, t in zip(src, dst):
                        # HND: head r is the r-th half of the decode page.
                        if not np.array_equal(got[t][r * 8192:(r + 1) * 8192], want[s]):
                            bad = bad or f"buffer {b} page {t}: head {r} differs"
    for p in ps:
        p.close()
    return dict(ok=bad is None, state=state.name, error=bad)


def case_layers(mem: str) -> dict:
    layers = [0, 0, 1, 1]
    p = Prefill(mem, dict(bufs=4, pages=16, item=64 << 10, seed=3, layers=layers))
    m = Memory(mem, 4, 16, 64 << 10, None)
    src, dst = [1, 2, 3], [10, 11, 12]
    with decode(mem, m) as d:
        d.register_kv_layers(m.bufs, layers)
        d.room_create(3, [p.address])
        d.room_set_destination(3, np.asarray(dst, np.uint32))
        p("create", 3)
        p("layers", 3, src, 0, 1, False)
        end = time.monotonic() + 30
        while d.room_layers_landed(3) < 1 and time.monotonic() < end:
            time.sleep(0.001)
        bad = check_pages(m, dst, src, 3, bufs=[0, 1])
        for b in (2, 3):
            if not (m.read(b)[dst] == POISON).all():
                bad = bad or "layer 1 landed before it was enqueued"
        p("layers", 3, src, 1, 1, True)
        state = wait(d, 3)
        p("wait", 3)
        bad = bad or (d.room_failure(3) if state == kvxfer.RoomState.FAILED else None)
        bad = bad or path_error(d, 3, mem) or check_pages(m, dst, src, 3)
    p.close()
    return dict(ok=bad is None, state=state.name, error=bad)


def case_abort(mem: str) -> dict:
    out = {}
    ok = True
    for side in ("decode", "prefill"):
        p = Prefill(mem, dict(bufs=2, pages=32, item=256 << 10, seed=4))
        m = Memory(mem, 2, 32, 256 << 10, None)
        dst, src = list(range(16)), list(range(8, 24))
        with decode(mem, m) as d:
            d.register_kv(m.bufs)
            d.room_create(7, [p.address])
            d.room_set_destination(7, np.asarray(dst, np.uint32))
            p("create", 7)
            p("enqueue", 7, src[:8], False)
            end = time.monotonic() + 30
            want = 8 * 2 * (256 << 10)
            while d.metrics()["bytes_received"] < want and time.monotonic() < end:
                time.sleep(0.001)
            path_bad = path_error(d, 7, mem)
            if side == "decode":
                d.room_abort(7, "client went away")
            else:
                p("abort", 7, "client went away")
            dstate, pstate = wait(d, 7), p("wait", 7)
            try:
                p("enqueue", 7, src[8:], True)
            except RuntimeError:
                pass  # refused: the room is failed
            end = time.monotonic() + 30
            while not d.room_drained(7) and time.monotonic() < end:
                time.sleep(0.001)
            time.sleep(0.2)
            why = d.room_failure(7)
            bad = None
            if dstate != kvxfer.RoomState.FAILED or pstate != "FAILED":
                bad = f"states {dstate.name}/{pstate}"
            elif "client went away" not in why:
                bad = f"reason {why!r}"
            bad = bad or path_bad
            bad = bad or check_pages(m, dst[:8], src[:8], 4) or check_poison(m, dst[8:])
        p.close()
        out[side] = dict(ok=bad is None, decode=dstate.name, prefill=pstate, reason=why,
                         error=bad)
        ok = ok and bad is None
    return dict(ok=ok, **out)


def case_bench(mem: str, item: int, per_room: int, rooms: int, inflight: int = 4) -> dict:
    pages = max(per_room * 8, 64)
    # --path staging: TCP on both sides whatever the memory (host memory would take the
    # same-host copy); --path ipc: CUDA IPC (the same-host copy for host memory).
    p = Prefill(mem, dict(bufs=1, pages=pages, item=item, seed=5, workers=4))
    m = Memory(mem, 1, pages, item, None)
    ids = list(range(1000, 1000 + rooms))
    with decode(mem, m, workers=4) as d:
        d.register_kv(m.bufs)
        # One room first: the connections and the staging rings are set up outside the
        # timing.
        warm = list(range(per_room))
        d.room_create(999, [p.address])
        d.room_set_destination(999, np.asarray(warm, np.uint32))
        p("create", 999)
        p("enqueue", 999, warm, True)
        wait(d, 999)
        path_bad = path_error(d, 999, mem)
        t0 = time.monotonic()
        p.conn.send(("bench", ids, per_room, inflight, pages))
        live: list[int] = []
        for k, room in enumerate(ids):
            while len(live) >= inflight:
                live = [r for r in live if d.room_poll(r) not in TERMINAL]
                if len(live) >= inflight:
                    time.sleep(0.0002)
            slot = k % inflight
            dst = np.arange(per_room, dtype=np.uint32) + slot * per_room
            d.room_create(room, [p.address])
            d.room_set_destination(room, dst)
            live.append(room)
        failed = sum(wait(d, r) == kvxfer.RoomState.FAILED for r in live)
        failed += sum(d.room_poll(r) == kvxfer.RoomState.FAILED for r in ids)
        dt = time.monotonic() - t0
        status, _ = p.conn.recv()
    p.close()
    gb = rooms * per_room * item / 1e9
    return dict(ok=failed == 0 and status == "ok" and path_bad is None, item=item,
                per_room=per_room, rooms=rooms, inflight=inflight, seconds=round(dt, 3),
                gbps=round(gb / dt, 3), failed=failed, error=path_bad)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mem", choices=["torch", "fake", "host"], required=True)
    ap.add_argument("case", choices=["scattered", "heads", "layers", "abort", "bench"])
    ap.add_argument("--item", type=int, default=1 << 20)
    ap.add_argument("--per-room", type=int, default=8)
    ap.add_argument("--rooms", type=int, default=64)
    ap.add_argument("--inflight", type=int, default=4)
    ap.add_argument("--path", choices=["staging", "ipc"], default="staging")
    a = ap.parse_args()
    global SAME_HOST
    SAME_HOST = "off" if a.path == "staging" else "require"
    if a.case == "bench":
        r = case_bench(a.mem, a.item, a.per_room, a.rooms, a.inflight)
    else:
        r = globals()[f"case_{a.case}"](a.mem)
    r = dict(case=a.case, mem=a.mem, path=a.path,
             alloc=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") if a.mem == "torch" else "",
             **r)
    print(json.dumps(r), flush=True)
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
