"""The SGLang backend with several TP ranks, driven as SGLang's schedulers drive them:
every rank polls its own room, the polls are MIN-reduced across the ranks
(``Failed`` = 0), and on a reduced Failed every rank calls ``failure_exception()``
(also a rank whose own room is still transferring) and its pages are freed at once.
No page may be written after that, on any rank.

Over TCP by default. ``KVXFER_TEST_TRANSPORT=rdma`` (scripts/rdma-tests.sh runs this
module so in the soft-RoCE guest) runs it with ``transport=rdma`` and smaller
transfers (the guest is emulated).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time

import numpy as np
import pytest

from kvxfer import FailureCause
from kvxfer.sglang import (
    ABORT_REASON,
    KVPoll,
    KVTransferError,
    KvxferKVBootstrapServer,
    KvxferKVManager,
    KvxferKVReceiver,
)
from kvxfer.sglang.conn import CONFIG_ENV
import sglang_sched
import sglang_tp
from sglang_sched import N_BUFS, POISON, poll_all_reduce

TRANSPORT = os.environ.get("KVXFER_TEST_TRANSPORT", "tcp")
RDMA = TRANSPORT == "rdma"
DRAIN_TIMEOUT_MS = 1000
"""Over RDMA a held (stopped) prefill never acknowledges the abort: the decode room
drains when this passed and the engine cut the peer off (5000 by default)."""
SAME_HOST = os.environ.get("KVXFER_TEST_SAME_HOST", "off")
"""The engines' ``same_host`` setting: ``off`` tests the TCP path (whose receiver the
scenarios stop mid-payload); ``make python-test`` runs the module again with
``require``, where the decode rank copies from the prefill process directly."""
CONFIG = (f"transport={TRANSPORT},same_host={SAME_HOST},drain_timeout_ms={DRAIN_TIMEOUT_MS},"
          "bootstrap_timeout_ms=10000,waiting_timeout_ms=20000,transfer_timeout_ms=20000")
# Per rank: 2 buffers of N_PAGES pages, all but the last sglang_tp.REST_PAGES in the
# first chunk. Over TCP 32 MiB, so that a rank stopped at its first bytes (a few MB
# later, on a busy host) is still in the middle of that chunk's payload; in the
# emulated guest (about 65 MB/s) 2 MiB.
PAGE_BYTES, N_PAGES = (64 << 10, 16) if RDMA else (512 << 10, 32)
TOTAL = N_BUFS * N_PAGES * PAGE_BYTES


@pytest.fixture(scope="module")
def ctx():
    """Processes forked from a server that imported numpy and kvxfer once (and runs no
    engine): quick to start, also in the emulated guest."""
    c = mp.get_context("forkserver")
    c.set_forkserver_preload(["numpy", "kvxfer.sglang", "sglang_sched", "sglang_tp"])
    return c


def _until(fn, timeout=60.0, step=0.001):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return True
        if step:
            time.sleep(step)
    return bool(fn())


def _first_bytes(kv) -> bool:
    """Whether any page of ``kv`` got its first byte (cheap: one byte a page)."""
    return any(k[:, 0].any() for k in kv)


def _landed(kv) -> int:
    return sum(int(np.count_nonzero(k)) for k in kv)


def _not_poison(kv, aux) -> int:
    """How many bytes of freed pages and aux rows no longer hold the poison."""
    return sum(int(np.count_nonzero(k != POISON)) for k in kv) + int(np.count_nonzero(aux != POISON))


def _transfer_queue(rcvs, timeout=60.0):
    """SGLang's decode transfer queue (``pop_transferred``) for one request on every
    rank: poll, MIN-reduce; on Failed every rank calls failure_exception() (then the
    pages are freed). The ranks' failure reasons."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = poll_all_reduce(rcvs)
        if p == KVPoll.Failed:
            reasons = []
            for rcv in rcvs:
                with pytest.raises(KVTransferError) as e:
                    rcv.failure_exception()
                reasons.append(e.value.failure_reason)
            return reasons
        assert p != KVPoll.Success, "the request succeeded on every rank"
        time.sleep(0.001)
    pytest.fail(f"the reduced poll never became Failed: {[r.poll() for r in rcvs]}")


@pytest.mark.parametrize("how", ["killed", "aborts"])
@pytest.mark.parametrize("tp", [2, 4])
def test_a_ranks_prefill_failing_while_another_is_mid_payload_frees_no_page_early(
        monkeypatch, ctx, tp, how):
    """Decode TP ``tp``, one request, one prefill process per rank. Rank 0's prefill is
    SIGKILLed or aborts the request while rank 1's (and, with TP 4, rank 2's) prefill
    is stopped (SIGSTOP) in the middle of its payload; with TP 4 rank 3 already
    succeeded. The reduced poll is Failed, so every rank calls failure_exception()
    and frees its pages. Once all returned: no room is still draining on any rank,
    and the freed pages, poisoned, still hold the poison 200 and 400 ms after the
    stopped prefills went on (SIGCONT)."""
    monkeypatch.setenv(CONFIG_ENV, CONFIG)
    victim, held, done = 0, ([1] if tp == 2 else [1, 2]), list(range(3, tp))
    server = KvxferKVBootstrapServer("127.0.0.1", 0)
    addr = server.address
    procs, conns, dms, stopped = [], [], [], set()
    try:
        for r in range(tp):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=sglang_tp.prefill_rank, daemon=True,
                            args=(child, r, tp, server.port, N_PAGES, PAGE_BYTES, CONFIG))
            p.start()
            procs.append(p)
            conns.append(parent)
        for c in conns:
            assert c.poll(60) and c.recv() == "up"
        dkv = [[np.zeros((N_PAGES, PAGE_BYTES), np.uint8) for _ in range(N_BUFS)] for _ in range(tp)]
        daux = [np.zeros((2, sglang_sched.AUX_BYTES), np.uint8) for _ in range(tp)]
        for r in range(tp):
            dms.append(KvxferKVManager(sglang_tp.rank_args(dkv[r], daux[r], r, PAGE_BYTES),
                                       "decode", sglang_sched.server_args(server.port, tp)))
        room = random.getrandbits(62) + 1
        for c in conns:
            c.send(room)

        # The prealloc queue: every rank's room, destinations once the reduced poll
        # is WaitingForInput.
        rcvs = [KvxferKVReceiver(m, addr, room) for m in dms]
        assert all(m.try_ensure_parallel_info(addr) for m in dms)
        for rcv in rcvs:
            rcv.init(0)
        assert _until(lambda: poll_all_reduce(rcvs) != KVPoll.Bootstrapping)
        assert poll_all_reduce(rcvs) == KVPoll.WaitingForInput
        for rcv in rcvs:
            rcv.send_metadata(np.arange(N_PAGES, dtype=np.int32), 0)
        for c in conns:  # every prefill rank got its destination
            assert c.poll(60) and c.recv() == KVPoll.WaitingForInput

        for r in done:
            conns[r].send("send")
            conns[r].send("more")
            assert _until(lambda: rcvs[r].poll() == KVPoll.Success), f"rank {r} did not succeed"
        for r in held:  # stopped as soon as its first chunk's first bytes landed
            conns[r].send("send")
            assert _until(lambda: _first_bytes(dkv[r]), step=0), f"nothing reached rank {r}"
            os.kill(procs[r].pid, signal.SIGSTOP)
            stopped.add(r)
            conns[r].send("more")  # read once it goes on: the rest of the request
        time.sleep(0.05)
        for r in held:
            landed = _landed(dkv[r])
            assert rcvs[r].poll() in (KVPoll.WaitingForInput, KVPoll.Transferring), landed
            assert 0 < landed < TOTAL, f"rank {r} is not mid-transfer: {landed} of {TOTAL} bytes"

        if how == "killed":
            os.kill(procs[victim].pid, signal.SIGKILL)
        else:
            conns[victim].send("abort")
        reasons = _transfer_queue(rcvs)
        # failure_exception() returned on every rank: SGLang frees the pages now.
        draining = [m.engine.metrics()["rooms_draining"] for m in dms]
        for r in range(tp):
            for k in dkv[r]:
                k[:] = POISON
            daux[r][:] = POISON
        for r in held:
            os.kill(procs[r].pid, signal.SIGCONT)
            stopped.discard(r)
        written = []
        for check in (1, 2):
            time.sleep(0.2)
            written += [(check, r, _not_poison(dkv[r], daux[r])) for r in range(tp)
                        if _not_poison(dkv[r], daux[r])]

        # Per rank, rooms still draining after failure_exception(); (check, rank, bytes)
        # written into freed pages.
        assert (draining, written) == ([0] * tp, [])
        if how == "aborts":
            assert reasons[victim].startswith("peer: ") and ABORT_REASON in reasons[victim], reasons
        else:
            assert rcvs[victim].failure_cause == FailureCause.PEER_LOST, reasons
        for r in held:
            assert "live transfer" in reasons[r], reasons
        for r in done:
            assert "succeeded" in reasons[r], reasons
        for m in dms:
            metrics = m.engine.metrics()
            assert metrics["inflight"] == 0 and not any(metrics["rooms_by_state"].values()), metrics

        # The prefill ranks that live on end too, their source pages drained.
        alive = [r for r in range(tp) if not (how == "killed" and r == victim)]
        for r in alive:
            assert conns[r].poll(60), f"prefill rank {r} did not end its request"
            rep = conns[r].recv()
            # A held rank's prefill may still write its last byte before it reads the
            # decode's abort (the decode room failed all the same).
            assert rep["outcome"] in (("success",) if r in done else ("failed", "success")), (r, rep)
            assert rep["rooms_draining"] == 0 and rep["inflight"] == 0, (r, rep)
            conns[r].send("exit")
    finally:
        for r in stopped:
            os.kill(procs[r].pid, signal.SIGCONT)
        for m in dms:
            m.close()
        for p in procs:  # told to exit, unless the test failed before
            p.join(3)
            if p.is_alive():
                p.kill()
                p.join(5)
        server.close()


@pytest.mark.parametrize("seed", [3])
def test_random_client_cancellations_with_tp2_leave_no_request_live_and_no_write_after_release(
        monkeypatch, seed):
    """SGLang's prefill and decode scheduler loops (sglang_sched) with two TP ranks on
    each side, over a few hundred requests with client cancellations at random points;
    every queue's polls MIN-reduced across the ranks. Every request ends on both
    sides, both engines of each side end empty, every success is byte for byte, and
    no freed page or aux row is written while free (decode poisons them when it frees
    them and checks when it allocates them again, and at the end)."""
    # A request cancelled on decode before its room was created leaves the prefill
    # room waiting for its destination until bootstrap_timeout_ms: short here, but in
    # the emulated guest the decode ranks' first RDMA connections take longer than 3 s.
    bootstrap_ms = 15000 if RDMA else 3000
    monkeypatch.setenv(CONFIG_ENV, CONFIG.replace("bootstrap_timeout_ms=10000",
                                                  f"bootstrap_timeout_ms={bootstrap_ms}"))
    n = 60 if RDMA else 300
    pre, dec = sglang_sched.run(seed, n, tp=2, deadline_s=90.0)
    assert pre["left"] == [] and dec["left"] == []
    assert pre["engine_empty"] and dec["engine_empty"], (pre["rank_metrics"], dec["rank_metrics"])
    assert pre["violations"] == [] and dec["violations"] == []
    assert dec["corrupt"] == []
    assert dec["late_writes"] == []
    for side in (pre, dec):
        for i, reason in side["reasons"].items():
            assert reason and "no failure reason" not in reason, (i, reason)
        assert set(side["reasons"]) == {i for i, s in side["state"].items() if s == "failed"}
        for m in side["rank_metrics"]:
            assert m["rooms_draining"] == 0, m
    # A request nobody cancelled succeeds on both sides, on every rank.
    for r in sglang_sched.plan(seed, n):
        if r.index not in pre["aborted"] and r.index not in dec["aborted"]:
            assert (pre["state"][r.index], dec["state"][r.index]) == ("success", "success"), r
    assert pre["aborted"] and dec["aborted"]
