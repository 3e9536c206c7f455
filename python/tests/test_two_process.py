"""The package against two engines in two processes (each a spawned Python process
with its own libkvxfer engine), over loopback TCP."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import kvxfer
from kvxfer import FailureCause, RoomState
from remote import PAGE_BYTES, RemoteEngine, pattern

KEYS = dict(transport="tcp", bootstrap_timeout_ms=5000, waiting_timeout_ms=5000,
            transfer_timeout_ms=5000, log_level="warn")
_rooms = itertools.count(1000)


@pytest.fixture(scope="module")
def pair():
    prefill = RemoteEngine(role="prefill", **KEYS)
    decode = RemoteEngine(role="decode", **KEYS)
    prefill.register()
    decode.register()
    yield prefill, decode
    prefill.close()
    decode.close()


def transfer(prefill, decode, room, src, dst, chunks, seed, aux=None):
    """Fills ``src`` on prefill, sends it in ``chunks`` (page counts) to ``dst``."""
    prefill.fill(seed, src)
    if aux is not None:
        prefill.fill_aux(aux[0], aux[2])
    decode.call("room_create", room, [prefill.address])
    decode.call("room_set_destination", room, np.array(dst, dtype=np.uint32),
                None if aux is None else aux[1])
    prefill.call("room_create", room)
    at = 0
    for i, n in enumerate(chunks):
        last = i == len(chunks) - 1
        prefill.call("enqueue_chunk", room, src[at:at + n], last,
                     aux[0] if (last and aux is not None) else None)
        at += n


def expected(seed, n_bufs, npages):
    return [pattern(seed, b, npages).tobytes() for b in range(n_bufs)]


def test_transfer_is_byte_for_byte_and_counted(pair):
    prefill, decode = pair
    room, seed = next(_rooms), 11
    before = decode.call("metrics")
    src = [3, 9, 4, 20, 21, 22, 5]
    dst = [40, 2, 17, 18, 19, 33, 7]
    untouched = [0, 1, 41]
    transfer(prefill, decode, room, src, dst, [3, 1, 3], seed, aux=(1, 5, b"request-metadata"))
    assert decode.wait(room, 10) == RoomState.SUCCESS
    assert prefill.wait(room, 10) == RoomState.SUCCESS
    assert decode.read(dst) == expected(seed, 3, len(dst))
    assert decode.read(untouched) == [bytes(3 * PAGE_BYTES)] * 3
    assert decode.read_aux(5)[:16] == b"request-metadata"
    after = decode.call("metrics")
    assert after["rooms_succeeded"] == before["rooms_succeeded"] + 1
    assert after["bytes_received"] - before["bytes_received"] >= 3 * len(dst) * PAGE_BYTES
    assert after["rooms_by_state"][RoomState.SUCCESS] == before["rooms_by_state"][RoomState.SUCCESS] + 1
    text = decode.call("metrics_text")
    assert f'kvxfer_rooms_succeeded_total{{role="decode"}} {after["rooms_succeeded"]}' in text
    assert decode.call("room_drained", room) and prefill.call("room_drained", room)
    decode.call("room_clear", room)
    prefill.call("room_clear", room)


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_abort_from_either_side_fails_both_with_the_reason(pair, side):
    prefill, decode = pair
    room = next(_rooms)
    decode.call("room_create", room, [prefill.address])
    decode.call("room_set_destination", room, [10, 11, 12, 13])
    prefill.call("room_create", room)
    prefill.call("enqueue_chunk", room, [1, 2])  # the last chunk never comes
    aborter, other = (decode, prefill) if side == "decode" else (prefill, decode)
    reason = f"client cancelled on {side}"
    aborter.call("room_abort", room, reason)
    assert aborter.call("room_poll", room) == RoomState.FAILED  # at once, locally
    assert other.wait(room, 10) == RoomState.FAILED
    recorded = aborter.call("room_failure", room)
    assert recorded.endswith(reason) and str(room) in recorded
    told = other.call("room_failure", room)
    if side == "prefill":
        # The prefill aborts before the decode's destination may have reached it: it then
        # has no destination to send its Abort to, and tells the decode when the
        # destination arrives, by refusing it with the room's recorded reason.
        refused = f"peer: prefill room {room} already failed: {recorded}"
        assert told in (f"peer: {recorded}", refused)
    else:
        assert told == f"peer: {recorded}"
    assert aborter.call("room_failure_cause", room) == (FailureCause.ABORTED, False)
    assert other.call("room_failure_cause", room) == (FailureCause.ABORTED, True)
    aborter.call("room_abort", room, "a second abort changes nothing")
    assert aborter.call("room_failure", room) == recorded
    for e in (prefill, decode):
        e.wait(room, 1)
        assert e.call("room_clear", room) is None


def test_clear_of_live_room_then_the_id_is_reused(pair):
    prefill, decode = pair
    room = next(_rooms)
    decode.call("room_create", room, [prefill.address])
    prefill.call("room_create", room)
    decode.call("room_clear", room)  # live: aborted, then released
    with pytest.raises(kvxfer.NotFoundError, match=f"room {room}"):
        decode.call("room_poll", room)
    with pytest.raises(kvxfer.NotFoundError):
        decode.call("room_clear", room)  # clearing twice
    assert prefill.wait(room, 10) == RoomState.FAILED
    assert prefill.call("room_failure", room).startswith("peer: ")
    prefill.call("room_clear", room)
    # The same id again, on both sides: a complete, correct transfer.
    seed = 23
    src, dst = [30, 31, 32], [50, 51, 52]
    transfer(prefill, decode, room, src, dst, [3], seed)
    assert decode.wait(room, 10) == RoomState.SUCCESS
    assert prefill.wait(room, 10) == RoomState.SUCCESS
    assert decode.read(dst) == expected(seed, 3, 3)
    prefill.call("room_clear", room)
    decode.call("room_clear", room)


def test_room_errors_from_the_other_process_keep_class_and_message(pair):
    prefill, decode = pair
    room = next(_rooms)
    prefill.call("room_create", room)
    with pytest.raises(kvxfer.AlreadyExistsError) as e:
        prefill.call("room_create", room)
    assert e.value.status == kvxfer.Status.ALREADY_EXISTS
    assert str(room) in e.value.message and e.value.function == "kvxfer_room_create"
    with pytest.raises(kvxfer.WrongRoleError, match="decode"):
        prefill.call("room_set_destination", room, [1])
    with pytest.raises(kvxfer.InvalidArgumentError, match="aux"):
        prefill.call("enqueue_chunk", room, [1], False, 0)  # aux slot without is_last
    prefill.call("room_clear", room)


def test_more_pages_than_the_destination_fails_both_sides_as_mismatch(pair):
    prefill, decode = pair
    room = next(_rooms)
    decode.call("room_create", room, [prefill.address])
    decode.call("room_set_destination", room, [1, 2])
    prefill.call("room_create", room)
    prefill.call("enqueue_chunk", room, [1, 2, 3], True)
    assert prefill.wait(room, 10) == RoomState.FAILED
    assert decode.wait(room, 10) == RoomState.FAILED
    assert prefill.call("room_failure_cause", room)[0] == FailureCause.MISMATCH
    assert "3" in prefill.call("room_failure", room)
    assert decode.call("room_failure", room).startswith("peer: ")
    prefill.call("room_clear", room)
    decode.call("room_clear", room)


def test_pipeline_stages_pair_by_layer_id():
    """Two prefill stages, each registering its own layers; the decode room pulls from
    both and completes when together they delivered every buffer."""
    stage0 = RemoteEngine(role="prefill", n_bufs=2, **KEYS)
    stage1 = RemoteEngine(role="prefill", n_bufs=2, **KEYS)
    decode = RemoteEngine(role="decode", n_bufs=4, **KEYS)
    try:
        stage0.register(layer_ids=[0, 1])
        stage1.register(layer_ids=[2, 3])
        decode.register(layer_ids=np.array([0, 1, 2, 3], dtype=np.uint32))
        room, src, dst = 77, [4, 5], [8, 9]
        stage0.fill(1, src)
        stage1.fill(2, src)
        decode.call("room_create", room, [stage0.address, stage1.address])
        decode.call("room_set_destination", room, dst)
        for stage in (stage0, stage1):
            stage.call("room_create", room)
            stage.call("enqueue_chunk", room, src, True)
        assert decode.wait(room, 10) == RoomState.SUCCESS
        got = decode.read(dst)
        assert got[:2] == expected(1, 2, 2)
        assert got[2:] == expected(2, 2, 2)
    finally:
        for e in (stage0, stage1, decode):
            e.close()
