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

With tensor parallelism (``tp`` > 1) each side runs ``tp`` ranks in its process, each
with its own manager and buffers, all seeing the same requests and the same page
indices (SGLang's allocation is the same on every TP rank). As SGLang does
(``poll_and_all_reduce``), every queue's polls are MIN-reduced across the ranks
(``Failed`` = 0), and each rank acts on the reduced state: on a reduced Failed every
rank calls ``failure_exception()`` (also a rank whose own room is still transferring)
and the pages are freed at once. Decode fills freed pages and aux rows with
:data:`POISON` and checks, when it allocates them again and once more at the end, that
nothing wrote into them while they were free.
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
POISON = 0xEE
"""What decode writes into pages and aux rows it freed; they must still hold it when
allocated again."""


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


def pattern(index: int, buf: int, npages: int, rank: int = 0) -> np.ndarray:
    """Request ``index``'s KV in buffer ``buf`` of TP rank ``rank``."""
    rng = np.random.default_rng([index, rank * N_BUFS + buf, 7])
    return rng.integers(0, 256, size=(npages, PAGE_BYTES), dtype=np.uint8)


def aux_row(req: Req) -> bytes:
    return req.room.to_bytes(8, "little") + req.n_pages.to_bytes(4, "little") + bytes(AUX_BYTES - 12)


def kv_args(kv: list[np.ndarray], aux: np.ndarray, rank: int = 0) -> Any:
    from kvxfer.sglang import KVArgs

    a = KVArgs()
    a.engine_rank = rank
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


def server_args(bootstrap_port: int, tp: int = 1) -> Any:
    return types.SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=bootstrap_port,
                                 tp_size=tp, dp_size=1, pp_size=1)


def poll_all_reduce(ends: list) -> int:
    """Every rank's poll, MIN-reduced across the ranks (SGLang's ``poll_and_all_reduce``)."""
    return min(int(e.poll()) for e in ends)


class Ranks:
    """One side's TP ranks in this process: a manager and buffers each."""

    def __init__(self, mode: str, tp: int, bootstrap_port: int, fill: int = 0) -> None:
        from kvxfer.sglang import KvxferKVManager

        self.kv = [[np.full((POOL_PAGES, PAGE_BYTES), fill, np.uint8) for _ in range(N_BUFS)]
                   for _ in range(tp)]
        self.aux = [np.full((META_SLOTS, AUX_BYTES), fill, np.uint8) for _ in range(tp)]
        self.mgrs = []
        for r in range(tp):
            self.mgrs.append(KvxferKVManager(kv_args(self.kv[r], self.aux[r], r), mode,
                                             server_args(bootstrap_port, tp)))

    def metrics(self) -> list[dict]:
        return [_plain(m.engine.metrics()) for m in self.mgrs]

    def empty(self) -> bool:
        return all(_engine_empty(m) for m in self.mgrs)

    def close(self) -> None:
        for m in self.mgrs:
            m.close()


class Outcome:
    def __init__(self) -> None:
        self.state: dict[int, str] = {}  # index -> "success" | "failed" | "dropped"
        self.reasons: dict[int, str] = {}
        self.violations: list[str] = []
        self.corrupt: list[int] = []
        self.aborted: dict[int, str] = {}  # index -> the phase the abort was issued in
        self.late_writes: list[str] = []  # freed pages or aux rows written while free

    def abort(self, req: Req, ends: list, phase: str) -> None:
        for end in ends:  # every TP rank gets the AbortReq
            end.abort()
        self.aborted[req.index] = phase

    def fail(self, req: Req, ends: list) -> None:
        """SGLang on a reduced Failed: ``failure_exception()`` on every rank (the
        reasons of the ranks joined by "; ")."""
        from kvxfer.sglang import KVTransferError

        reasons = []
        for end in ends:
            try:
                end.failure_exception()
                self.violations.append(f"req {req.index}: failure_exception() did not raise")
            except KVTransferError as e:
                reasons.append(e.failure_reason)
            except Exception as e:  # noqa: BLE001 - reported, not hidden
                self.violations.append(f"req {req.index}: failure_exception raised {e!r}")
        if reasons:
            self.reasons[req.index] = "; ".join(reasons)
        self.state[req.index] = "failed"

    def report(self) -> dict:
        return {"state": self.state, "reasons": self.reasons, "violations": self.violations,
                "corrupt": self.corrupt, "aborted": self.aborted, "late_writes": self.late_writes}


def _engine_empty(mgr: Any) -> bool:
    m = mgr.engine.metrics()
    return m["inflight"] == 0 and not any(m["rooms_by_state"].values())


def prefill_main(conn: Any, seed: int, n: int, deadline_s: float, tp: int = 1) -> None:
    from kvxfer.sglang import KVPoll, KvxferKVBootstrapServer, KvxferKVSender

    server = KvxferKVBootstrapServer("127.0.0.1", 0)
    ranks = Ranks("prefill", tp, server.port)
    kv, aux = ranks.kv, ranks.aux
    conn.send(server.port)
    reqs = plan(seed, n)
    out = Outcome()
    free_pages = list(range(POOL_PAGES))
    free_slots = list(range(META_SLOTS))
    rng = random.Random(seed + 1)
    rng.shuffle(free_pages)
    bootstrap_q: list[list] = []  # [req, senders, waited]
    running: list[list] = []  # [req, senders, pages, slot, sent_chunks]
    inflight: list[list] = []  # [req, senders, pages, slot, waited]
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
            bootstrap_q.append([r, [KvxferKVSender(m, server.address, r.room) for m in ranks.mgrs], 0])
            arrived += 1
        keep = []
        for item in bootstrap_q:
            r, ss, waited = item
            if r.cancel_side == "prefill" and r.cancel_phase == 0 and waited == r.cancel_delay:
                out.abort(r, ss, "bootstrap")
            item[2] += 1
            p = poll_all_reduce(ss)
            if p == KVPoll.Failed:
                out.fail(r, ss)
            elif p == KVPoll.Bootstrapping:
                keep.append(item)
            elif p == KVPoll.WaitingForInput:
                if len(free_pages) < r.n_pages or not free_slots:
                    keep.append(item)
                    continue
                pages = [free_pages.pop() for _ in range(r.n_pages)]
                slot = free_slots.pop()
                for rank, s in enumerate(ss):
                    for b in range(N_BUFS):  # the forward pass writes the request's KV
                        kv[rank][b][pages] = pattern(r.index, b, r.n_pages, rank)
                    aux[rank][slot] = np.frombuffer(aux_row(r), np.uint8)
                    s.init(r.n_pages, slot)
                running.append([r, ss, pages, slot, 0])
            else:
                out.violations.append(f"req {r.index}: poll {p} in the bootstrap queue")
        bootstrap_q = keep
        keep = []
        for item in running:
            r, ss, pages, slot, sent = item
            start_page = sent * r.chunk
            chunk = pages[start_page:start_page + r.chunk]
            last = start_page + r.chunk >= r.n_pages
            for s in ss:
                if s.should_send_kv_chunk(len(chunk), last):
                    s.send(np.array(chunk, dtype=np.int64 if r.index % 2 else np.int32))
            item[4] = sent = sent + 1
            if last:
                inflight.append([r, ss, pages, slot, 0])
            elif r.cancel_side == "prefill" and r.cancel_phase == sent:
                # process_pending_chunked_abort: abort, free, drop; never polled again.
                out.abort(r, ss, "chunking")
                free(pages, slot)
                out.state[r.index] = "dropped"
            else:
                keep.append(item)
        running = keep
        keep = []
        for item in inflight:
            r, ss, pages, slot, waited = item
            if r.cancel_side == "prefill" and r.cancel_phase >= -(-r.n_pages // r.chunk) \
                    and waited == r.cancel_delay:
                out.abort(r, ss, "inflight")
            item[4] += 1
            p = poll_all_reduce(ss)
            if p == KVPoll.Success:
                for s in ss:
                    s.clear()
                out.state[r.index] = "success"
                free(pages, slot)
            elif p == KVPoll.Failed:
                out.fail(r, ss)
                free(pages, slot)
            elif p in (KVPoll.WaitingForInput, KVPoll.Transferring):
                keep.append(item)
            else:
                out.violations.append(f"req {r.index}: poll {p} in the inflight queue")
        inflight = keep
        if arrived == n and not (bootstrap_q or running or inflight) and ranks.empty():
            break
        time.sleep(STEP_S)
    left = [i for i in range(n) if i not in out.state]
    report = out.report()
    report.update(left=left, steps=step, metrics=ranks.metrics()[0], rank_metrics=ranks.metrics(),
                  engine_empty=ranks.empty())
    conn.send(report)
    conn.recv()
    ranks.close()
    server.close()


def decode_main(conn: Any, seed: int, n: int, bootstrap_port: int, deadline_s: float,
                tp: int = 1) -> None:
    from kvxfer.sglang import KVPoll, KvxferKVReceiver

    ranks = Ranks("decode", tp, bootstrap_port, fill=POISON)
    kv, aux = ranks.kv, ranks.aux
    addr = f"127.0.0.1:{bootstrap_port}"
    conn.send("up")
    reqs = plan(seed, n)
    out = Outcome()
    free_pages = list(range(POOL_PAGES))
    free_slots = list(range(META_SLOTS))
    rng = random.Random(seed + 2)
    rng.shuffle(free_pages)
    pending: list[list] = []  # [req, receivers]: waiting for the prefill info
    prealloc: list[list] = []  # [req, receivers, waited]
    transfer: list[list] = []  # [req, receivers, pages, slot, waited]
    arrived = 0

    def still_poisoned(pages: list[int], slot: Optional[int], why: str) -> None:
        """Freed pages (and aux row) must hold POISON: nothing wrote into them since."""
        for rank in range(tp):
            bad = [p for p in pages if any((kv[rank][b][p] != POISON).any() for b in range(N_BUFS))]
            if bad:
                out.late_writes.append(f"{why}: rank {rank} pages {bad[:8]} written while free")
            if slot is not None and (aux[rank][slot] != POISON).any():
                out.late_writes.append(f"{why}: rank {rank} aux slot {slot} written while free")

    start = time.monotonic()
    step = 0
    while time.monotonic() - start < deadline_s:
        step += 1
        while arrived < n and arrived < 2 * step:
            r = reqs[arrived]
            rcvs = [KvxferKVReceiver(m, addr, r.room) for m in ranks.mgrs]
            if r.cancel_side == "decode" and r.cancel_phase == 0:
                out.abort(r, rcvs, "before_init")
            pending.append([r, rcvs])
            arrived += 1
        if pending and all(m.try_ensure_parallel_info(addr) for m in ranks.mgrs):
            for r, rcvs in pending:
                for rcv in rcvs:
                    rcv.init(0)
                prealloc.append([r, rcvs, 0])
            pending = []
        keep = []
        for item in prealloc:
            r, rcvs, waited = item
            if r.cancel_side == "decode" and r.cancel_phase == 1 and waited == r.cancel_delay:
                out.abort(r, rcvs, "prealloc")
            item[2] += 1
            p = poll_all_reduce(rcvs)
            if p == KVPoll.Failed:
                out.fail(r, rcvs)
                for rcv in rcvs:
                    rcv.clear()
            elif p == KVPoll.Bootstrapping:
                keep.append(item)
            elif p == KVPoll.WaitingForInput:
                if len(free_pages) < r.n_pages or not free_slots:
                    keep.append(item)
                    continue
                pages = [free_pages.pop() for _ in range(r.n_pages)]
                slot = free_slots.pop()
                still_poisoned(pages, slot, f"req {r.index} allocating")
                for rcv in rcvs:
                    rcv.send_metadata(np.array(pages, dtype=np.int32 if r.index % 2 else np.int64), slot)
                transfer.append([r, rcvs, pages, slot, 0])
            else:
                out.violations.append(f"req {r.index}: poll {p} in the prealloc queue")
        prealloc = keep
        keep = []
        for item in transfer:
            r, rcvs, pages, slot, waited = item
            if r.cancel_side == "decode" and r.cancel_phase == 2 and waited == r.cancel_delay:
                out.abort(r, rcvs, "transfer")
            item[4] += 1
            p = poll_all_reduce(rcvs)
            if p == KVPoll.Success:
                ok = all(np.array_equal(kv[rank][b][pages], pattern(r.index, b, r.n_pages, rank))
                         for rank in range(tp) for b in range(N_BUFS)) \
                    and all(aux[rank][slot].tobytes() == aux_row(r) for rank in range(tp))
                if not ok:
                    out.corrupt.append(r.index)
                out.state[r.index] = "success"
                for rcv in rcvs:
                    rcv.clear()
            elif p == KVPoll.Failed:
                out.fail(r, rcvs)
                for rcv in rcvs:
                    rcv.clear()
            elif p in (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring):
                keep.append(item)
                continue
            else:
                out.violations.append(f"req {r.index}: poll {p} in the transfer queue")
                continue
            # Pages and slot go back to the pool at once, as SGLang frees them.
            for rank in range(tp):
                for b in range(N_BUFS):
                    kv[rank][b][pages] = POISON
                aux[rank][slot] = POISON
            free_pages.extend(pages)
            free_slots.append(slot)
        transfer = keep
        if arrived == n and not (pending or prealloc or transfer) and ranks.empty():
            break
        time.sleep(STEP_S)
    left = [i for i in range(n) if i not in out.state]
    time.sleep(0.2)  # a late write would land meanwhile
    if not left:
        still_poisoned(list(range(POOL_PAGES)), None, "at the end")
        for slot in range(META_SLOTS):
            still_poisoned([], slot, "at the end")
    report = out.report()
    report.update(left=left, steps=step, metrics=ranks.metrics()[0], rank_metrics=ranks.metrics(),
                  engine_empty=ranks.empty())
    conn.send(report)
    conn.recv()
    ranks.close()


def _plain(m: dict) -> dict:
    return {k: ({int(a): b for a, b in v.items()} if isinstance(v, dict) else v) for k, v in m.items()}


def run(seed: int, n: int, tp: int = 1, deadline_s: float = 60.0) -> tuple[dict, dict]:
    """Runs the prefill and the decode loop (``tp`` ranks each) in two spawned
    processes over ``n`` requests of :func:`plan`; their reports."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    pconn, pchild = ctx.Pipe()
    dconn, dchild = ctx.Pipe()
    pproc = ctx.Process(target=prefill_main, args=(pchild, seed, n, deadline_s, tp), daemon=True)
    pproc.start()
    try:
        assert pconn.poll(60), "prefill process did not start"
        port = pconn.recv()
        dproc = ctx.Process(target=decode_main, args=(dchild, seed, n, port, deadline_s, tp),
                            daemon=True)
        dproc.start()
        try:
            assert dconn.poll(60), "decode process did not start"
            assert dconn.recv() == "up"
            pconn.send("go")
            limit = deadline_s + 30
            assert pconn.poll(limit) and dconn.poll(limit), "a scheduler loop did not report"
            pre, dec = pconn.recv(), dconn.recv()
            pconn.send("exit")
            dconn.send("exit")
        finally:
            dproc.join(30)
    finally:
        pproc.join(30)
    return pre, dec
