"""SGLang's prefill and decode scheduler loops, reduced to what they do with the
transfer backend (SGLang 0.5.23, python/sglang/srt/disaggregation/prefill.py and
decode.py), each run in its own process against the kvxfer backend.

Prefill, per step: new requests get a sender (``PrefillBootstrapQueue.add``); the
bootstrap queue is polled (``pop_bootstrapped``: Failed -> failure_exception,
Bootstrapping -> wait, WaitingForInput -> ``init(num_pages, metadata_slot)``, anything
else is a scheduler error); running requests send one chunk per step
(``send_kv_chunk``, through ``should_send_kv_chunk``) and after the last join the
inflight queue, polled every step (``process_disagg_prefill_inflight_queue``: Success
-> clear, Failed -> failure_exception, WaitingForInput/Transferring -> keep).

Decode, per step: new requests get a receiver and ``init(0)`` once the prefill
server's info is known (``PreallocQueue.add`` / ``_resolve_pending_reqs``); the
prealloc queue is polled (``_update_handshake_waiters``; WaitingForInput with pages
free -> ``send_metadata(pages, metadata_slot)``, Failed -> failure_exception, clear);
the transfer queue is polled (``pop_transferred``: Success -> the pages are checked
byte for byte, clear; Failed -> failure_exception, clear, pages freed at once).

Client cancellations happen at planned random points with SGLang's abort calls:
prefill ``sender.abort()`` in the bootstrap queue or the inflight queue (then polled
on), or during chunked prefill (``process_pending_chunked_abort``: abort, pages freed,
the request dropped and never polled again); decode ``receiver.abort()`` before init,
in the prealloc queue or in the transfer queue.
"""

from __future__ import annotations

import dataclasses
import random
import time
import types
from typing import Any, Optional

import numpy as np

PAGE_BYTES = 1024
N_BUFS = 2
POOL_PAGES = 160
META_SLOTS = 24
AUX_BYTES = 32
STEP_S = 0.001


@dataclasses.dataclass
class Req:
    index: int
    room: int
    n_pages: int
    chunk: int
    cancel_side: Optional[str]  # None, "prefill" or "decode"
    cancel_phase: int  # see the loops
    cancel_delay: int  # steps spent in that phase first


def plan(seed: int, n: int) -> list[Req]:
    rng = random.Random(seed)
    rooms = rng.sample(range(1, 1 << 63), n)
    out = []
    for i in range(n):
        side = rng.choices([None, "prefill", "decode"], [60, 20, 20])[0]
        n_pages = rng.randint(1, 24)
        chunk = rng.randint(1, 8)
        n_chunks = -(-n_pages // chunk)
        # prefill: 0 bootstrap queue, 1..n_chunks-1 after that many chunks, n_chunks inflight
        # decode: 0 before init, 1 prealloc queue, 2 transfer queue
        phase = rng.randint(0, n_chunks) if side == "prefill" else rng.randint(0, 2)
        out.append(Req(i, rooms[i], n_pages, chunk, side, phase, rng.randint(0, 3)))
    return out


def pattern(index: int, buf: int, npages: int) -> np.ndarray:
    rng = np.random.default_rng([index, buf, 7])
    return rng.integers(0, 256, size=(npages, PAGE_BYTES), dtype=np.uint8)


def aux_row(req: Req) -> bytes:
    return req.room.to_bytes(8, "little") + req.n_pages.to_bytes(4, "little") + bytes(AUX_BYTES - 12)


def kv_args(kv: list[np.ndarray], aux: np.ndarray) -> Any:
    from kvxfer.sglang import KVArgs

    a = KVArgs()
    a.engine_rank = 0
    a.kv_data_ptrs = [x.ctypes.data for x in kv]
    a.kv_data_lens = [x.nbytes for x in kv]
    a.kv_item_lens = [PAGE_BYTES] * len(kv)
    a.kv_layer_ids = list(range(len(kv)))
    a.aux_data_ptrs = [aux.ctypes.data]
    a.aux_data_lens = [aux.nbytes]
    a.aux_item_lens = [AUX_BYTES]
    a.state_data_ptrs = []
    a.state_types = []
    a.page_size = 16
    a.kv_cache_dtype_str = "bfloat16"
    a.pp_rank = 0
    a.system_dp_rank = 0
    a.ib_device = None
    return a


def server_args(bootstrap_port: int) -> Any:
    return types.SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=bootstrap_port,
                                 tp_size=1, dp_size=1, pp_size=1)


class Outcome:
    def __init__(self) -> None:
        self.state: dict[int, str] = {}  # index -> "success" | "failed" | "dropped"
        self.reasons: dict[int, str] = {}
        self.violations: list[str] = []
        self.corrupt: list[int] = []
        self.aborted: dict[int, str] = {}  # index -> the phase the abort was issued in

    def abort(self, req: Req, end: Any, phase: str) -> None:
        end.abort()
        self.aborted[req.index] = phase

    def fail(self, req: Req, end: Any) -> None:
        from kvxfer.sglang import KVTransferError

        try:
            end.failure_exception()
            self.violations.append(f"req {req.index}: failure_exception() did not raise")
        except KVTransferError as e:
            self.reasons[req.index] = e.failure_reason
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            self.violations.append(f"req {req.index}: failure_exception raised {e!r}")
        self.state[req.index] = "failed"

    def report(self) -> dict:
        return {"state": self.state, "reasons": self.reasons, "violations": self.violations,
                "corrupt": self.corrupt, "aborted": self.aborted}


def _engine_empty(mgr: Any) -> bool:
    m = mgr.engine.metrics()
    return m["inflight"] == 0 and not any(m["rooms_by_state"].values())


def prefill_main(conn: Any, seed: int, n: int, deadline_s: float) -> None:
    from kvxfer.sglang import KVPoll, KvxferKVBootstrapServer, KvxferKVManager, KvxferKVSender

    server = KvxferKVBootstrapServer("127.0.0.1", 0)
    kv = [np.zeros((POOL_PAGES, PAGE_BYTES), np.uint8) for _ in range(N_BUFS)]
    aux = np.zeros((META_SLOTS, AUX_BYTES), np.uint8)
    mgr = KvxferKVManager(kv_args(kv, aux), "prefill", server_args(server.port))
    conn.send(server.port)
    reqs = plan(seed, n)
    out = Outcome()
    free_pages = list(range(POOL_PAGES))
    free_slots = list(range(META_SLOTS))
    rng = random.Random(seed + 1)
    rng.shuffle(free_pages)
    bootstrap_q: list[list] = []  # [req, sender, waited]
    running: list[list] = []  # [req, sender, pages, slot, sent_chunks]
    inflight: list[list] = []  # [req, sender, pages, slot, waited]
    arrived = 0
    conn.recv()  # the decode side is up
    start = time.monotonic()
    step = 0

    def free(pages: list[int], slot: int) -> None:
        free_pages.extend(pages)
        free_slots.append(slot)

    while time.monotonic() - start < deadline_s:
        step += 1
        while arrived < n and arrived < 2 * step:
            r = reqs[arrived]
            bootstrap_q.append([r, KvxferKVSender(mgr, server.address, r.room), 0])
            arrived += 1
        keep = []
        for item in bootstrap_q:
            r, s, waited = item
            if r.cancel_side == "prefill" and r.cancel_phase == 0 and waited == r.cancel_delay:
                out.abort(r, s, "bootstrap")
            item[2] += 1
            p = s.poll()
            if p == KVPoll.Failed:
                out.fail(r, s)
            elif p == KVPoll.Bootstrapping:
                keep.append(item)
            elif p == KVPoll.WaitingForInput:
                if len(free_pages) < r.n_pages or not free_slots:
                    keep.append(item)
                    continue
                pages = [free_pages.pop() for _ in range(r.n_pages)]
                slot = free_slots.pop()
                for b in range(N_BUFS):  # the forward pass writes the request's KV
                    kv[b][pages] = pattern(r.index, b, r.n_pages)
                aux[slot] = np.frombuffer(aux_row(r), np.uint8)
                s.init(r.n_pages, slot)
                running.append([r, s, pages, slot, 0])
            else:
                out.violations.append(f"req {r.index}: poll {p} in the bootstrap queue")
        bootstrap_q = keep
        keep = []
        for item in running:
            r, s, pages, slot, sent = item
            start_page = sent * r.chunk
            chunk = pages[start_page:start_page + r.chunk]
            last = start_page + r.chunk >= r.n_pages
            if s.should_send_kv_chunk(len(chunk), last):
                s.send(np.array(chunk, dtype=np.int64 if r.index % 2 else np.int32))
            item[4] = sent = sent + 1
            if last:
                inflight.append([r, s, pages, slot, 0])
            elif r.cancel_side == "prefill" and r.cancel_phase == sent:
                # process_pending_chunked_abort: abort, free, drop; never polled again.
                out.abort(r, s, "chunking")
                free(pages, slot)
                out.state[r.index] = "dropped"
            else:
                keep.append(item)
        running = keep
        keep = []
        for item in inflight:
            r, s, pages, slot, waited = item
            if r.cancel_side == "prefill" and r.cancel_phase >= -(-r.n_pages // r.chunk) \
                    and waited == r.cancel_delay:
                out.abort(r, s, "inflight")
            item[4] += 1
            p = s.poll()
            if p == KVPoll.Success:
                s.clear()
                out.state[r.index] = "success"
                free(pages, slot)
            elif p == KVPoll.Failed:
                out.fail(r, s)
                free(pages, slot)
            elif p in (KVPoll.WaitingForInput, KVPoll.Transferring):
                keep.append(item)
            else:
                out.violations.append(f"req {r.index}: poll {p} in the inflight queue")
        inflight = keep
        if arrived == n and not (bootstrap_q or running or inflight) and _engine_empty(mgr):
            break
        time.sleep(STEP_S)
    left = [i for i in range(n) if i not in out.state]
    report = out.report()
    report.update(left=left, steps=step, metrics=_plain(mgr.engine.metrics()),
                  engine_empty=_engine_empty(mgr))
    conn.send(report)
    conn.recv()
    mgr.close()
    server.close()


def decode_main(conn: Any, seed: int, n: int, bootstrap_port: int, deadline_s: float) -> None:
    from kvxfer.sglang import KVPoll, KvxferKVManager, KvxferKVReceiver

    kv = [np.zeros((POOL_PAGES, PAGE_BYTES), np.uint8) for _ in range(N_BUFS)]
    aux = np.zeros((META_SLOTS, AUX_BYTES), np.uint8)
    mgr = KvxferKVManager(kv_args(kv, aux), "decode", server_args(bootstrap_port))
    addr = f"127.0.0.1:{bootstrap_port}"
    conn.send("up")
    reqs = plan(seed, n)
    out = Outcome()
    free_pages = list(range(POOL_PAGES))
    free_slots = list(range(META_SLOTS))
    rng = random.Random(seed + 2)
    rng.shuffle(free_pages)
    pending: list[list] = []  # [req, receiver]: waiting for the prefill info
    prealloc: list[list] = []  # [req, receiver, waited]
    transfer: list[list] = []  # [req, receiver, pages, slot, waited]
    arrived = 0
    start = time.monotonic()
    step = 0
    while time.monotonic() - start < deadline_s:
        step += 1
        while arrived < n and arrived < 2 * step:
            r = reqs[arrived]
            rcv = KvxferKVReceiver(mgr, addr, r.room)
            if r.cancel_side == "decode" and r.cancel_phase == 0:
                out.abort(r, rcv, "before_init")
            pending.append([r, rcv])
            arrived += 1
        if pending and mgr.try_ensure_parallel_info(addr):
            for r, rcv in pending:
                rcv.init(0)
                prealloc.append([r, rcv, 0])
            pending = []
        keep = []
        for item in prealloc:
            r, rcv, waited = item
            if r.cancel_side == "decode" and r.cancel_phase == 1 and waited == r.cancel_delay:
                out.abort(r, rcv, "prealloc")
            item[2] += 1
            p = rcv.poll()
            if p == KVPoll.Failed:
                out.fail(r, rcv)
                rcv.clear()
            elif p == KVPoll.Bootstrapping:
                keep.append(item)
            elif p == KVPoll.WaitingForInput:
                if len(free_pages) < r.n_pages or not free_slots:
                    keep.append(item)
                    continue
                pages = [free_pages.pop() for _ in range(r.n_pages)]
                slot = free_slots.pop()
                rcv.send_metadata(np.array(pages, dtype=np.int32 if r.index % 2 else np.int64), slot)
                transfer.append([r, rcv, pages, slot, 0])
            else:
                out.violations.append(f"req {r.index}: poll {p} in the prealloc queue")
        prealloc = keep
        keep = []
        for item in transfer:
            r, rcv, pages, slot, waited = item
            if r.cancel_side == "decode" and r.cancel_phase == 2 and waited == r.cancel_delay:
                out.abort(r, rcv, "transfer")
            item[4] += 1
            p = rcv.poll()
            if p == KVPoll.Success:
                ok = all(np.array_equal(kv[b][pages], pattern(r.index, b, r.n_pages))
                         for b in range(N_BUFS)) and aux[slot].tobytes() == aux_row(r)
                if not ok:
                    out.corrupt.append(r.index)
                out.state[r.index] = "success"
                rcv.clear()
            elif p == KVPoll.Failed:
                out.fail(r, rcv)
                rcv.clear()
            elif p in (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring):
                keep.append(item)
                continue
            else:
                out.violations.append(f"req {r.index}: poll {p} in the transfer queue")
                continue
            # Pages and slot go back to the pool at once, as SGLang frees them.
            for b in range(N_BUFS):
                kv[b][pages] = 0
            aux[slot] = 0
            free_pages.extend(pages)
            free_slots.append(slot)
        transfer = keep
        if arrived == n and not (pending or prealloc or transfer) and _engine_empty(mgr):
            break
        time.sleep(STEP_S)
    left = [i for i in range(n) if i not in out.state]
    report = out.report()
    report.update(left=left, steps=step, metrics=_plain(mgr.engine.metrics()),
                  engine_empty=_engine_empty(mgr))
    conn.send(report)
    conn.recv()
    mgr.close()


def _plain(m: dict) -> dict:
    return {k: ({int(a): b for a, b in v.items()} if isinstance(v, dict) else v) for k, v in m.items()}
