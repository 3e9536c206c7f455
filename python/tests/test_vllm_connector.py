"""The vLLM connector's bookkeeping without vLLM: its scheduler side (which requests get
a room, what the worker is told, when blocks may be freed) and its worker side over two
real engines on loopback, driven in the order vLLM's scheduler and model runner call
them. The connector class itself (vLLM's types in and out) runs in `make test-vllm`."""

from __future__ import annotations

import copy
import logging
import time

import numpy as np
import pytest

import kvxfer
from kvxfer.vllm.plan import (
    NUM_BLOCKS_KEY,
    NUM_TOKENS_KEY,
    PREFILL_KEY,
    ROOM_KEY,
    AbortRoom,
    RecvRoom,
    SendRoom,
)
from kvxfer.vllm.scheduler import DecodeScheduler, PrefillScheduler
from kvxfer.vllm.worker import ConnectorWorker, LayerBuffer, merge_stats, reduce_stats

LAYERS, BLOCKS, PAGE = 3, 32, 2048
BLOCK_TOKENS = 16


def kv_cache(seed):
    """One array per layer, [blocks, page bytes], like vLLM's CPU cache (K and V side
    by side in each block)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, (BLOCKS, PAGE), dtype=np.uint8) for _ in range(LAYERS)]


def buffers(cache):
    # Registered in a shuffled order with vLLM's layer names: pairing is by layer index.
    order = [2, 0, 1]
    return [LayerBuffer(f"model.layers.{i}.self_attn.attn", i, cache[i].ctypes.data,
                        cache[i].nbytes, PAGE) for i in order]


class Side:
    """One server: its scheduler-side and worker-side halves, stepped like vLLM does
    (plan built by the scheduler, applied by the worker, results swept and given back
    to the scheduler)."""

    def __init__(self, role, keys, seed):
        self.role = role
        self.cache = kv_cache(seed)
        self.worker = ConnectorWorker(role, keys)
        self.worker.register(buffers(self.cache))
        self.sched = PrefillScheduler() if role == "prefill" else DecodeScheduler(1)
        if role == "prefill":
            self.sched.set_addresses({0: self.worker.address})
        self.sending, self.recving, self.failed, self.load_errors = [], [], [], set()

    def step(self):
        self.worker.apply(self.sched.build_plan())
        r = self.worker.results()
        self.load_errors |= self.worker.take_load_errors()
        if self.role == "prefill":
            self.sched.finished_sending(r.finished_sending)
        else:
            self.sched.finished_recving(r.finished_recving)
        self.sending += sorted(r.finished_sending)
        self.recving += sorted(r.finished_recving)
        self.failed += sorted(r.failed_recving)
        return r

    def engine_rooms(self):
        return sum(self.worker.engine.metrics()["rooms_by_state"].values())

    def close(self):
        self.worker.close()


@pytest.fixture
def pair():
    sides = []

    def make(prefill_keys=None, decode_keys=None):
        p = Side("prefill", {"transport": "tcp", **(prefill_keys or {})}, 1)
        d = Side("decode", {"transport": "tcp", **(decode_keys or {})}, 2)
        sides.extend([p, d])
        return p, d

    yield make
    for s in sides:
        s.close()


def step_until(sides, done, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the connector did not report in time"
        for s in sides:
            s.step()
        time.sleep(0.002)


def prefill_request(p, req_id, blocks, tokens):
    keep, params = p.sched.request_finished(req_id, {"do_remote_decode": True}, blocks, True,
                                            tokens)
    assert keep and params
    return params


def decode_schedules(d, req_id, params, tokens, blocks):
    """vLLM's decode scheduler: match, allocate, tell the connector."""
    n, is_async = d.sched.num_new_matched_tokens(params, tokens, 0)
    d.sched.after_alloc(req_id, params, tokens, blocks, n)
    return n, is_async


def test_a_request_moves_its_blocks_byte_for_byte(pair):
    p, d = pair()
    tokens = 3 * BLOCK_TOKENS - 5
    params = prefill_request(p, "cmpl-a-p", [3, 4, 5], tokens)
    assert params["do_remote_prefill"] and not params["do_remote_decode"]
    assert params[PREFILL_KEY] == [p.worker.address]
    assert params[NUM_TOKENS_KEY] == tokens and params[NUM_BLOCKS_KEY] == 3
    assert 0 <= params[ROOM_KEY] < 2**64
    assert p.sched.pending_requests == 1

    # The params reach the decode as JSON does: a copy.
    params = copy.deepcopy(params)
    assert decode_schedules(d, "cmpl-a-d", params, tokens, [9, 10, 11]) == (tokens, True)
    assert d.sched.pending_requests == 1
    step_until([p, d], lambda: d.recving and p.sending)

    assert d.recving == ["cmpl-a-d"] and p.sending == ["cmpl-a-p"]
    assert d.failed == [] and d.load_errors == set()
    for layer in range(LAYERS):
        assert np.array_equal(d.cache[layer][[9, 10, 11]], p.cache[layer][[3, 4, 5]]), layer
        assert not np.array_equal(d.cache[layer][12], p.cache[layer][6])
    # Everything let go: no request held, no room left in either engine.
    for _ in range(3):
        p.step(), d.step()
    assert p.sched.pending_requests == d.sched.pending_requests == 0
    assert p.engine_rooms() == d.engine_rooms() == 0
    assert p.worker.rooms == d.worker.rooms == {}
    # vLLM calls update_state_after_alloc again once the load is done: nothing more.
    d.sched.after_alloc("cmpl-a-d", params, tokens, [9, 10, 11], 0)
    assert not d.sched.build_plan()
    assert d.sched.num_new_matched_tokens(params, tokens, 0) == (0, False)


def test_prefill_keeps_the_blocks_until_the_room_ends_without_a_decode(pair, caplog):
    # Long enough that the first step below always sees the room alive.
    p, _ = pair(prefill_keys={"bootstrap_timeout_ms": 1500})
    caplog.set_level(logging.INFO, logger="vllm.kvxfer")
    params = prefill_request(p, "cmpl-lonely", [1, 2], 20)
    t0 = time.monotonic()
    p.step()
    assert p.worker.rooms == {params[ROOM_KEY]: "cmpl-lonely"}
    # Nobody asks for it: held while the room lives, given back once it failed.
    while not p.sending:
        assert p.sched.pending_requests == 1
        assert time.monotonic() - t0 < 20
        p.step()
        time.sleep(0.01)
    assert time.monotonic() - t0 >= 0.5
    assert p.sending == ["cmpl-lonely"] and p.sched.pending_requests == 0
    for _ in range(3):
        p.step()
    assert p.sending == ["cmpl-lonely"], "reported twice"
    assert p.engine_rooms() == 0
    lines = [r for r in caplog.records if "FAILED" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert f"room {params[ROOM_KEY]} of request cmpl-lonely FAILED: " in lines[0].getMessage()
    assert "bootstrap" in lines[0].getMessage()


def test_a_failed_room_is_a_load_error_and_never_a_success(pair, caplog):
    p, d = pair()
    caplog.set_level(logging.INFO, logger="vllm.kvxfer")
    params = copy.deepcopy(prefill_request(p, "cmpl-b-p", [3, 4, 5], 40))
    # Two destination blocks for three source blocks: the library fails the room.
    decode_schedules(d, "cmpl-b-d", params, 40, [20, 21])
    step_until([p, d], lambda: d.recving and p.sending)
    assert d.recving == ["cmpl-b-d"] and d.failed == ["cmpl-b-d"]
    assert d.load_errors == {20, 21}
    assert p.sending == ["cmpl-b-p"]
    failed = [r.getMessage() for r in caplog.records if "FAILED" in r.getMessage()]
    assert any("of request cmpl-b-d FAILED: " in m for m in failed), failed
    assert d.engine_rooms() == p.engine_rooms() == 0


def test_a_decode_request_aborted_while_waiting_aborts_its_room(pair, caplog):
    p, d = pair(prefill_keys={"bootstrap_timeout_ms": 20000})
    caplog.set_level(logging.INFO, logger="vllm.kvxfer")
    params = copy.deepcopy(prefill_request(p, "cmpl-c-p", [6, 7], 30))
    prefill_plan = p.sched.build_plan()  # held back: the prefill has not sent yet
    decode_schedules(d, "cmpl-c-d", params, 30, [1, 2])
    d.step()
    room = params[ROOM_KEY]
    assert d.worker.rooms == {room: "cmpl-c-d"}
    assert d.worker.engine.room_poll(room) not in kvxfer.TERMINAL_STATES
    # The client goes away: vLLM finishes the request and keeps its blocks.
    assert d.sched.request_finished("cmpl-c-d", params) == (False, None)
    step_until([d], lambda: d.recving)
    assert d.recving == ["cmpl-c-d"] and d.failed == [], "an abort is not a load error"
    assert d.sched.pending_requests == 0 and d.engine_rooms() == 0
    # The prefill learns of it: its room fails well before its bootstrap timeout.
    p.worker.apply(prefill_plan)
    t0 = time.monotonic()
    step_until([p], lambda: p.sending)
    assert time.monotonic() - t0 < 10
    assert p.sending == ["cmpl-c-p"] and p.engine_rooms() == 0
    msgs = [r for r in caplog.records if "cmpl-c-d FAILED after its abort" in r.getMessage()]
    assert len(msgs) == 1 and msgs[0].levelno == logging.INFO


def test_a_decode_request_dropped_before_it_was_scheduled_frees_the_prefill(pair):
    p, d = pair(prefill_keys={"bootstrap_timeout_ms": 30000})
    params = copy.deepcopy(prefill_request(p, "cmpl-e-p", [8], 10))
    p.step()
    # Aborted while queued: vLLM never allocated blocks nor called after_alloc.
    assert d.sched.request_finished("cmpl-e-d", params) == (False, None)
    plan = d.sched.build_plan()
    assert plan.abort == [AbortRoom("cmpl-e-d", params[ROOM_KEY], plan.abort[0].reason,
                                    params[PREFILL_KEY], notify_only=True)]
    d.worker.apply(plan)
    t0 = time.monotonic()
    step_until([p, d], lambda: p.sending and not d.worker.rooms)
    assert time.monotonic() - t0 < 10
    assert p.sending == ["cmpl-e-p"]
    # vLLM no longer knows the request: it is never reported.
    for _ in range(3):
        d.step()
    assert d.recving == [] and d.failed == [] and d.engine_rooms() == 0


def test_replayed_params_fail_the_second_request_and_leave_the_first_alone(pair):
    p, d = pair()
    params = prefill_request(p, "cmpl-f-p", [3, 4], 20)
    first, second = copy.deepcopy(params), copy.deepcopy(params)
    p.sched.build_plan()  # the prefill holds its chunk back, so the first room stays live
    decode_schedules(d, "cmpl-f-1", first, 20, [1, 2])
    d.step()
    decode_schedules(d, "cmpl-f-2", second, 20, [3, 4])
    r = d.step()
    assert r.finished_recving == {"cmpl-f-2"} and r.failed_recving == {"cmpl-f-2"}
    assert d.worker.rooms == {params[ROOM_KEY]: "cmpl-f-1"}
    assert d.worker.engine.room_poll(params[ROOM_KEY]) not in kvxfer.TERMINAL_STATES


def test_decode_refuses_params_it_cannot_load_and_computes_the_request_itself():
    d = DecodeScheduler(tp_size=1)
    good = {"do_remote_prefill": True, ROOM_KEY: 5, PREFILL_KEY: ["127.0.0.1:1"],
            NUM_TOKENS_KEY: 40, NUM_BLOCKS_KEY: 3}
    # Not ours, or nothing to load.
    for params in (None, {}, {"do_remote_prefill": True, "remote_block_ids": [1]},
                   {**good, "do_remote_prefill": False}):
        assert d.num_new_matched_tokens(params, 40, 0) == (0, False)
        d.after_alloc("r", params, 40, [1, 2, 3], 0)
        assert not d.build_plan()
    # Side-effect free, however often vLLM asks.
    for _ in range(3):
        assert d.num_new_matched_tokens(good, 40, 0) == (40, True)
    assert not d.build_plan() and d.pending_requests == 0
    # Cannot be used: computed here, and the prefill told to let the room go.
    bad = {
        "prompt differs": ({**good}, 41, 0),
        "tp differs": ({**good, PREFILL_KEY: ["a:1", "b:2"]}, 40, 0),
        "local prefix hit": ({**good}, 40, 16),
    }
    for what, (params, tokens, computed) in bad.items():
        assert d.num_new_matched_tokens(params, tokens, computed) == (0, False), what
        d.after_alloc("r", params, tokens, [1, 2, 3], 0)
        plan = d.build_plan()
        assert not plan.recv, what
        assert [(a.req_id, a.room, a.notify_only, a.prefill) for a in plan.abort] == [
            ("r", 5, True, params[PREFILL_KEY])], what
        assert d.num_new_matched_tokens(params, tokens, computed) == (0, False), what
    for params in ({**good, ROOM_KEY: -1}, {**good, ROOM_KEY: 2**64}, {**good, ROOM_KEY: "x"},
                   {**good, PREFILL_KEY: "127.0.0.1:1"}, {**good, PREFILL_KEY: []}):
        assert d.num_new_matched_tokens(params, 40, 0) == (0, False), params
        d.after_alloc("r", params, 40, [1, 2, 3], 0)
        assert not d.build_plan().recv
    assert d.pending_requests == 0


def test_decode_plans_one_load_per_request_and_an_abort_only_while_it_waits():
    d = DecodeScheduler(tp_size=2)
    params = {"do_remote_prefill": True, ROOM_KEY: str(2**64 - 1), PREFILL_KEY: ["a:1", "b:2"]}
    d.after_alloc("r1", params, 300, [4, 5, 6], 300)
    d.after_alloc("r1", params, 300, [4, 5, 6, 7], 0)  # vLLM's second call, after the load
    plan = d.build_plan()
    assert plan.recv == [RecvRoom("r1", 2**64 - 1, ["a:1", "b:2"], [4, 5, 6])]
    assert d.pending_requests == 1
    assert d.request_finished("r1", params) == (False, None)
    assert [(a.req_id, a.room, a.notify_only) for a in d.build_plan().abort] == [
        ("r1", 2**64 - 1, False)]
    d.finished_recving({"r1"})
    assert d.pending_requests == 0
    # A request that loaded and finished normally: nothing to do.
    d.after_alloc("r2", {**params, ROOM_KEY: 9}, 300, [1], 300)
    d.build_plan()
    d.finished_recving({"r2"})
    assert d.request_finished("r2", params) == (False, None)
    assert not d.build_plan()


def test_prefill_gives_rooms_only_to_finished_disaggregated_requests():
    p = PrefillScheduler()
    assert p.request_finished("r", None, [1], True, 10) == (False, None)
    assert p.request_finished("r", {"do_remote_decode": False}, [1], True, 10) == (False, None)
    assert p.request_finished("r", {"do_remote_decode": True}, [1], True, 10) == (False, None), \
        "no engine address yet"
    p.set_addresses({0: "127.0.0.1:7", 1: "127.0.0.1:8"})
    assert p.request_finished("r", {"do_remote_decode": True}, [1, 2], False, 10) == (False, None)
    assert p.request_finished("r", {"do_remote_decode": True}, [], True, 0) == (False, None)
    assert not p.build_plan() and p.pending_requests == 0
    rooms = set()
    for i in range(50):
        keep, params = p.request_finished(f"q{i}", {"do_remote_decode": True}, [i + 1], True, 5)
        assert keep and params[PREFILL_KEY] == ["127.0.0.1:7", "127.0.0.1:8"]
        rooms.add(params[ROOM_KEY])
    assert len(rooms) == 50
    plan = p.build_plan()
    assert [s.req_id for s in plan.send] == [f"q{i}" for i in range(50)]
    assert plan.send[3] == SendRoom("q3", plan.send[3].room, [4])
    p.finished_sending({"q0", "q1"})
    assert p.pending_requests == 48
    with pytest.raises(ValueError):
        p.set_addresses({1: "x:1"})


def test_stats_gauges_take_the_latest_value_and_counters_add_up():
    a = {"ranks": {"0": {"rooms": 3, "tracked": 3}}, "delta": {"rooms_succeeded": 2}}
    b = {"ranks": {"0": {"rooms": 1, "tracked": 1}}, "delta": {"rooms_succeeded": 1,
                                                               "rooms_failed": 1}}
    c = {"ranks": {"1": {"rooms": 5, "tracked": 5}}}
    s = {"pending_requests": 4}
    m = merge_stats(merge_stats(merge_stats(a, b), c), s)
    assert m["ranks"] == {"0": {"rooms": 1, "tracked": 1}, "1": {"rooms": 5, "tracked": 5}}
    assert m["delta"] == {"rooms_succeeded": 3, "rooms_failed": 1}
    assert merge_stats(m, {"pending_requests": 0})["pending_requests"] == 0
    r = reduce_stats(m)
    assert r["rooms"] == 6 and r["pending_requests"] == 4 and r["rooms_failed"] == 1


def test_worker_stats_report_changes_only(pair):
    p, d = pair()
    assert p.worker.stats()["ranks"]["0"]["rooms"] == 0
    assert p.worker.stats() is None
    params = copy.deepcopy(prefill_request(p, "cmpl-g-p", [3], 10))
    p.step()
    assert p.worker.stats()["ranks"]["0"]["rooms"] == 1
    decode_schedules(d, "cmpl-g-d", params, 10, [5])
    step_until([p, d], lambda: d.recving and p.sending)
    s = p.worker.stats()
    assert s["ranks"]["0"]["rooms"] == 0 and s["delta"]["rooms_succeeded"] == 1
    assert s["delta"]["bytes_sent"] == LAYERS * PAGE
    assert d.worker.stats()["delta"]["bytes_received"] == LAYERS * PAGE


def test_bad_engine_keys_fail_at_start_up():
    with pytest.raises(kvxfer.UnknownKeyError):
        ConnectorWorker("prefill", {"no_such_key": 1})
    with pytest.raises(kvxfer.BadValueError):
        ConnectorWorker("decode", {"bootstrap_timeout_ms": "soon"})
    with pytest.raises(ValueError, match="kv_role"):
        ConnectorWorker("decode", {"role": "prefill"})
