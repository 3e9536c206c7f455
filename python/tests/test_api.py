"""The bindings in one process: the generated ABI, every error status with its
message, page lists, buffers, log sinks, metrics and handle lifetimes."""

from __future__ import annotations

import array
import ctypes
import re
import shutil
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import kvxfer
from kvxfer import RoomState, Status
from kvxfer import _abi, _core
from kvxfer._lib import lib

ROOT = Path(__file__).resolve().parents[2]


def test_generated_abi_matches_the_header():
    r = subprocess.run([sys.executable, str(ROOT / "python/tools/gen_abi.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_every_c_function_has_a_python_wrapper():
    header = (ROOT / "include/kvxfer.h").read_text()
    import re

    declared = set(re.findall(r"\b(kvxfer_\w+)\(", header))
    assert declared == set(_abi.FUNCTIONS)
    assert set(kvxfer.C_FUNCTIONS) == declared
    # The header's documentation reaches each wrapper's docstring.
    assert "one atomic load" in " ".join(kvxfer.Engine.room_poll.__doc__.split())
    assert "kvxfer_room_poll" in kvxfer.Engine.room_poll.__doc__


def test_enum_values_are_the_headers():
    assert [(s.name, s.value) for s in RoomState] == [
        ("FAILED", 0), ("BOOTSTRAPPING", 1), ("WAITING_FOR_INPUT", 2),
        ("TRANSFERRING", 3), ("SUCCESS", 4)]
    header = (ROOT / "include/kvxfer.h").read_text()
    for cls, prefix in ((Status, "KVXFER_"), (RoomState, "KVXFER_ROOM_"),
                        (kvxfer.FailureCause, "KVXFER_CAUSE_"), (kvxfer.LogLevel, "KVXFER_LOG_")):
        for member in cls:
            cname = prefix + ("ERR_" if cls is Status and member.value else "") + member.name
            assert f"  {cname} = {member.value}," in header
    assert kvxfer.library_version() == kvxfer.HEADER_VERSION == kvxfer.__version__
    # The struct's fields in order, each array sized by a number or a macro of the header.
    sizes = {name: int(v) for name, v in re.findall(r"^#define (KVXFER_\w+) (\d+)$", header, re.M)}
    body = header[: header.index("} kvxfer_metrics;")].rsplit("typedef struct", 1)[1]
    fields = re.findall(r"^\s+uint64_t (\w+)(?:\[(\w+)\])?;", body, re.M)
    assert len(fields) > 10
    assert dict(fields)["rooms_failed_by_cause"] == "KVXFER_METRICS_CAUSES"
    assert ctypes.sizeof(_abi.Metrics) == 8 * sum(
        int(sizes.get(n, n) or 1) for _, n in fields)
    assert [f for f, _ in fields] == [f for f, _ in _abi.Metrics._fields_]


def test_the_installed_wheel_carries_the_library():
    if not os.environ.get("KVXFER_EXPECT_INSTALLED"):
        pytest.skip("set by make python-test, which tests the installed wheel")
    assert "site-packages" in kvxfer.__file__
    assert Path(kvxfer.library_path) == Path(kvxfer.__file__).parent / "libkvxfer.so"


def test_status_names_and_last_error():
    assert kvxfer.status_name(3) == "KVXFER_ERR_NOT_FOUND"
    assert kvxfer.status_name(999) == "KVXFER_UNKNOWN_STATUS"
    with kvxfer.Engine(role="prefill") as e:
        with pytest.raises(kvxfer.NotFoundError):
            e.room_poll(5)
        # The message stays readable on this thread until a call succeeds.
        assert "room 5" in kvxfer.last_error()
        assert e.address
        assert kvxfer.last_error() == ""


def _raises(cls, match, fn, *args, **kwargs):
    with pytest.raises(cls, match=match) as info:
        fn(*args, **kwargs)
    err = info.value
    assert isinstance(err, kvxfer.KvxferError)
    assert err.status == cls.status_code
    assert err.message and err.status_name in str(err) and err.message in str(err)
    return err


def test_every_error_status_raises_its_class_with_the_librarys_message():
    seen = set()
    # Configuration.
    seen.add(_raises(kvxfer.UnknownKeyError, "'no_such_key'", kvxfer.Config, no_such_key=1).status)
    err = _raises(kvxfer.BadValueError, "workers", kvxfer.Config, workers=0)
    assert "0" in err.message
    seen.add(err.status)
    seen.add(_raises(kvxfer.BadValueError, "role", kvxfer.Engine).status)
    seen.add(_raises(kvxfer.TransportUnavailableError, "rdma", _rdma_engine).status)
    # An address already in use.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        seen.add(_raises(kvxfer.IoError, str(port), kvxfer.Engine, role="decode",
                         listen=f"127.0.0.1:{port}").status)
    with kvxfer.Engine(role="decode") as d, kvxfer.Engine(role="prefill") as p:
        seen.add(_raises(kvxfer.WrongStateError, "regist", d.room_create, 1, ["127.0.0.1:1"]).status)
        seen.add(_raises(kvxfer.InvalidArgumentError, None, d.register_kv, []).status)
        kv = np.zeros((8, 256), dtype=np.uint8)
        d.register_kv([(kv.ctypes.data, kv.nbytes, 256)])
        _raises(kvxfer.WrongStateError, None, d.register_kv, [(kv.ctypes.data, kv.nbytes, 256)])
        seen.add(_raises(kvxfer.NotFoundError, "room 9", d.room_poll, 9).status)
        # The prefill registers first: a prefill without buffers refuses the decode's
        # connection, and room 9 would fail (and so no longer be "not FAILED" below).
        p.register_kv([(kv.ctypes.data, kv.nbytes, 256)])
        d.room_create(9, [p.address])
        seen.add(_raises(kvxfer.AlreadyExistsError, "9", d.room_create, 9, [p.address]).status)
        seen.add(_raises(kvxfer.WrongRoleError, "prefill", d.enqueue_chunk, 9, [0], True).status)
        _raises(kvxfer.InvalidArgumentError, "8", d.room_set_destination, 9, [8])  # page 8 of 0..7
        _raises(kvxfer.WrongStateError, None, d.room_failure, 9)  # not FAILED
        _raises(kvxfer.InvalidArgumentError, "room id", d.room_poll, -1)
        _raises(kvxfer.WrongRoleError, "decode", p.room_set_destination, 1, [0])
    # The statuses the high-level API never lets happen, raised by the same path:
    # NULL pointers and short output buffers straight through the C functions.
    seen.add(_raises(kvxfer.NullPointerError, None, kvxfer.errors.check,
                     lib.kvxfer_config_new(None), "kvxfer_config_new").status)
    with kvxfer.Engine(role="prefill") as e:
        n = ctypes.c_size_t()
        st = lib.kvxfer_engine_address(e._handle, ctypes.create_string_buffer(2), 2, ctypes.byref(n))
        err = _raises(kvxfer.BufferTooSmallError, None, kvxfer.errors.check, st, "kvxfer_engine_address")
        assert n.value == len(e.address)
        seen.add(err.status)
    # UNSUPPORTED and PANIC: nothing in this build returns them; their classes exist.
    for code, cls in ((Status.UNSUPPORTED, kvxfer.UnsupportedError), (Status.PANIC, kvxfer.PanicError)):
        assert type(kvxfer.errors.error_for(code, "m")) is cls
        seen.add(code)
    assert seen == set(Status) - {Status.OK}
    unknown = kvxfer.errors.error_for(77, "from a newer library")
    assert type(unknown) is kvxfer.KvxferError and unknown.status == 77
    assert "KVXFER_UNKNOWN_STATUS" in str(unknown)


def _rdma_engine():
    kvxfer.Engine(role="prefill", transport="rdma")


def test_errors_pickle_with_status_message_and_function():
    err = kvxfer.errors.error_for(Status.NOT_FOUND, "room 4 not found", "kvxfer_room_poll")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is kvxfer.NotFoundError
    assert (back.status, back.message, back.function) == (Status.NOT_FOUND, "room 4 not found",
                                                         "kvxfer_room_poll")


def test_page_lists_numpy_uint32_without_copy():
    pages = np.arange(10, dtype=np.uint32)
    assert _core._Pages(pages, "t").ptr == pages.ctypes.data
    ro = pages.copy()
    ro.setflags(write=False)
    assert _core._Pages(ro, "t").ptr == ro.ctypes.data
    a = array.array("I", [1, 2, 3])
    assert _core._Pages(a, "t").ptr == a.buffer_info()[0]
    def values(p):
        return list(ctypes.cast(p.ptr, ctypes.POINTER(ctypes.c_uint32))[: p.n])

    assert values(_core._Pages([1, 2, 3], "t")) == [1, 2, 3]  # copied
    assert values(_core._Pages(range(5, 8), "t")) == [5, 6, 7]
    assert values(_core._Pages(memoryview(a).toreadonly(), "t")) == [1, 2, 3]  # copied
    assert values(_core._Pages(np.arange(6, dtype=np.uint32).reshape(2, 3), "t")) == list(range(6))
    assert values(_core._Pages(ro[3:], "t")) == list(range(3, 10))
    assert _core._Pages(np.array([], dtype=np.uint32), "t").n == 0
    with pytest.raises(kvxfer.InvalidArgumentError, match="uint32"):
        _core._Pages(np.arange(3, dtype=np.int64), "t")
    with pytest.raises(kvxfer.InvalidArgumentError, match="contiguous"):
        _core._Pages(np.arange(10, dtype=np.uint32)[::2], "t")
    with pytest.raises(kvxfer.InvalidArgumentError, match="uint32"):
        _core._Pages([-1], "t")


def test_pages_reach_the_library_as_given():
    """A destination set from a numpy view is the one the library checks: page 7 of
    an 8-page buffer is accepted, page 8 is refused (so the values were read, not a
    stale or truncated copy)."""
    with kvxfer.Engine(role="prefill") as p, kvxfer.Engine(role="decode") as d:
        kv = bytearray(8 * 64)
        # A prefill without buffers would refuse the connection and fail the rooms,
        # and a FAILED room refuses its destination for that reason instead.
        p.register_kv([kvxfer.Buffer.of(bytearray(8 * 64), 64)])
        d.register_kv([kvxfer.Buffer.of(kv, 64)])
        d.room_create(1, [p.address])
        d.room_set_destination(1, np.array([5, 6, 7], dtype=np.uint32)[1:])
        d.room_create(2, [p.address])
        with pytest.raises(kvxfer.InvalidArgumentError, match="8"):
            d.room_set_destination(2, np.array([7, 8], dtype=np.uint32))
        with pytest.raises(kvxfer.InvalidArgumentError, match="twice|duplicate|more than once"):
            d.room_set_destination(2, array.array("I", [3, 3]))


def _terminal(e, room, timeout=20.0):
    deadline = time.monotonic() + timeout
    while (s := e.room_poll(room)) not in (RoomState.SUCCESS, RoomState.FAILED):
        assert time.monotonic() < deadline, f"room {room} stuck in {s!r}"
        time.sleep(0.001)
    return s


def test_a_room_bound_to_a_decode_engine_takes_its_destination_and_refuses_anothers():
    """room_create_for: the decode engine named by its engine_id claims the room; a
    destination from another decode engine fails that engine's room and is counted."""
    with kvxfer.Engine(role="prefill") as p, kvxfer.Engine(role="decode") as d1, \
            kvxfer.Engine(role="decode") as d2:
        src, dst1, dst2 = (bytearray(range(256)) * 2), bytearray(512), bytearray(512)
        p.register_kv([kvxfer.Buffer.of(src, 64)])
        d1.register_kv([kvxfer.Buffer.of(dst1, 64)])
        d2.register_kv([kvxfer.Buffer.of(dst2, 64)])
        assert len({p.engine_id, d1.engine_id, d2.engine_id}) == 3
        p.room_create_for(1, [d1.engine_id])
        p.enqueue_chunk(1, [2], True)
        d2.room_create(1, [p.address])
        d2.room_set_destination(1, [3])
        assert _terminal(d2, 1) == RoomState.FAILED
        assert "bound to other decode engines" in d2.room_failure(1)
        assert p.metrics()["binding_refusals"] == 1
        assert p.room_poll(1) == RoomState.BOOTSTRAPPING
        d1.room_create(1, [p.address])
        d1.room_set_destination(1, [5])
        assert _terminal(d1, 1) == RoomState.SUCCESS
        assert dst1[5 * 64:6 * 64] == src[2 * 64:3 * 64] and not any(dst2)
        with pytest.raises(kvxfer.InvalidArgumentError, match="twice"):
            p.room_create_for(2, [7, 7])
        with pytest.raises(kvxfer.InvalidArgumentError, match="decode_ids"):
            p.room_create_for(2, [-1])
        with pytest.raises(kvxfer.WrongRoleError):
            d1.room_create_for(2, [p.engine_id])


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_room_create_from_finds_a_prefill_instance_through_a_real_etcd(tmp_path):
    """room_create_from: without `discovery` it is refused; with an etcd (Debian's
    etcd-server, which `make deps` installs) a decode room by instance name moves the
    prefill's page, and an instance nobody registered is NOT_FOUND."""
    with kvxfer.Engine(role="decode") as d:
        d.register_kv([kvxfer.Buffer.of(bytearray(256), 64)])
        with pytest.raises(kvxfer.WrongStateError, match="discovery"):
            d.room_create_from(1, "prefill-a")
        with pytest.raises(kvxfer.InvalidArgumentError):
            d.room_create_from(1, b"prefill-a")
    if shutil.which("etcd") is None:
        pytest.skip("etcd not installed (Debian: etcd-server; make deps installs it)")
    client, peer = _free_port(), _free_port()
    etcd = subprocess.Popen(
        ["etcd", "--name", "py", "--data-dir", str(tmp_path / "etcd"),
         "--listen-client-urls", f"http://127.0.0.1:{client}",
         "--advertise-client-urls", f"http://127.0.0.1:{client}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"py=http://127.0.0.1:{peer}", "--log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        keys = dict(discovery=f"etcd://127.0.0.1:{client}", auth_key="ab" * 32,
                    discovery_ttl_ms="2000")
        with kvxfer.Engine(role="prefill", instance="prefill-a", **keys) as p, \
                kvxfer.Engine(role="decode", instance="decode-a", **keys) as d:
            src, dst = bytearray(range(256)) * 2, bytearray(512)
            p.register_kv([kvxfer.Buffer.of(src, 64)])
            d.register_kv([kvxfer.Buffer.of(dst, 64)])
            deadline = time.monotonic() + 20
            while True:
                try:
                    d.room_create_from(1, "prefill-a")
                    break
                except kvxfer.NotFoundError:
                    assert time.monotonic() < deadline, "prefill-a never appeared"
                    time.sleep(0.05)
            d.room_set_destination(1, [3])
            p.room_create(1)
            p.enqueue_chunk(1, [2], True)
            assert _terminal(d, 1) == RoomState.SUCCESS
            assert dst[3 * 64:4 * 64] == src[2 * 64:3 * 64]
            assert p.metrics()["registry_registrations"] >= 1
            with pytest.raises(kvxfer.NotFoundError, match="prefill-zz"):
                d.room_create_from(2, "prefill-zz")
    finally:
        etcd.kill()
        etcd.wait()


def test_buffer_of_keeps_memory_alive_and_rejects_read_only():
    kv = bytearray(4096)
    b = kvxfer.Buffer.of(kv, 1024)
    assert b.len == 4096 and b.item_len == 1024 and b.base != 0
    with pytest.raises(ValueError, match="writable"):
        kvxfer.Buffer.of(bytes(16), 4)
    with kvxfer.Engine(role="prefill") as e:
        e.register_kv([b])
        assert any(o is b.owner for o in e._keep)


def test_register_kv_layout_passes_the_layout_and_the_librarys_refusals():
    # 2 of 8 heads (tp 4) of 64 fp16 elements, 4-token pages: 1024 bytes a page.
    layout = dict(kv_heads=8, head_dim=64, dtype_bytes=2, page_tokens=4, tp_rank=3, tp_size=4,
                  page_order=kvxfer.PageOrder.NHD)
    kv = bytearray(8 * 1024)
    with kvxfer.Engine(role="prefill") as e:
        _raises(kvxfer.InvalidArgumentError, "kv buffer 0: item_len 512 differs from the "
                "layout's page bytes 1024 \\(page_tokens 4 x 2 heads x head_dim 64 x "
                "dtype_bytes 2\\)", e.register_kv_layout, [kvxfer.Buffer.of(kv, 512)], **layout)
        _raises(kvxfer.InvalidArgumentError, "tp_rank 4 is not below tp_size 4",
                e.register_kv_layout, [kvxfer.Buffer.of(kv, 1024)], **{**layout, "tp_rank": 4})
        _raises(kvxfer.InvalidArgumentError, "1 buffers but 2 layer ids",
                e.register_kv_layout, [kvxfer.Buffer.of(kv, 1024)], layer_ids=[0, 1], **layout)
        e.register_kv_layout([kvxfer.Buffer.of(kv, 1024)], layer_ids=[5], **layout)
        _raises(kvxfer.WrongStateError, "already registered", e.register_kv,
                [kvxfer.Buffer.of(kv, 1024)])


def test_log_lines_reach_python_logging(caplog):
    with caplog.at_level(logging.INFO, logger="kvxfer"):
        with kvxfer.Engine(role="prefill", log_level="info") as e:
            address = e.address
    lines = [r for r in caplog.records if r.name == "kvxfer"]
    assert any(address in r.getMessage() and r.levelno == logging.INFO for r in lines)
    assert any("stopped" in r.getMessage() for r in lines)


def test_callable_log_sink_is_called_from_library_threads():
    got = []

    def sink(level, line):
        got.append((level, line, threading.current_thread().name))

    cfg = kvxfer.Config(role="decode", log_level="debug", log_sink=sink)
    with cfg, kvxfer.Engine(cfg) as e:
        kv = bytearray(4 * 64)
        e.register_kv([kvxfer.Buffer.of(kv, 64)])
        e.room_create(3, ["127.0.0.1:1"])  # nothing listens: the connect fails in a library thread
        deadline = time.monotonic() + 10
        while e.room_poll(3) != RoomState.FAILED and time.monotonic() < deadline:
            time.sleep(0.01)
    assert any(lv == kvxfer.LogLevel.DEBUG and "room 3" in line for lv, line, _ in got)
    assert all(isinstance(lv, kvxfer.LogLevel) for lv, _, _ in got)
    assert any(t != "MainThread" for _, _, t in got)


def test_the_library_releases_a_sink_once_the_config_and_its_engines_are_freed():
    held = len(_core._CONTEXTS)
    got = []
    cfg = kvxfer.Config(role="prefill", log_level="info", log_sink=lambda lv, line: got.append(line))
    e = kvxfer.Engine(cfg)
    cfg.set_log_sink(lambda lv, line: None)  # the first sink stays the engine's
    assert len(_core._CONTEXTS) == held + 2
    cfg.close()  # releases the second sink, which only the config used
    assert len(_core._CONTEXTS) == held + 1
    e.close()  # the engine logs that it stopped, then releases the first
    assert len(_core._CONTEXTS) == held
    assert any("stopped" in line for line in got)


def test_state_and_cause_names_come_from_the_library():
    assert kvxfer.room_state_name(RoomState.WAITING_FOR_INPUT) == "KVXFER_ROOM_WAITING_FOR_INPUT"
    assert kvxfer.room_state_name(99) == "KVXFER_UNKNOWN_ROOM_STATE"
    assert kvxfer.failure_cause_name(kvxfer.FailureCause.PEER_LOST) == "KVXFER_CAUSE_PEER_LOST"
    assert kvxfer.failure_cause_name(0) == "KVXFER_UNKNOWN_CAUSE"


def test_log_sink_none_restores_stderr(capfd, caplog):
    with caplog.at_level(logging.INFO, logger="kvxfer"):
        with kvxfer.Engine(role="prefill", log_level="info", log_sink=None) as e:
            address = e.address
    assert not [r for r in caplog.records if r.name == "kvxfer"]
    assert address in capfd.readouterr().err


def test_metrics_dict_and_prometheus_text():
    with kvxfer.Engine(role="prefill") as e:
        kv = bytearray(4 * 64)
        e.register_kv([kvxfer.Buffer.of(kv, 64)])
        e.room_create(1)
        e.room_create(2)
        e.room_abort(2, "x")
        m = e.metrics()
        assert m["rooms_created"] == 2 and m["rooms_failed"] == 1 and m["inflight"] == 1
        assert m["rooms_by_state"][RoomState.BOOTSTRAPPING] == 1
        assert m["rooms_by_state"][RoomState.FAILED] == 1
        assert m["rooms_failed_by_cause"][kvxfer.FailureCause.ABORTED] == 1
        assert set(m) == {name for name, _ in _abi.Metrics._fields_}
        text = e.metrics_text()
        assert 'kvxfer_rooms_created_total{role="prefill"} 2' in text
        assert "# TYPE" in text


def test_engine_close_fails_live_rooms_and_later_calls_raise():
    e = kvxfer.Engine(role="prefill")
    kv = bytearray(4 * 64)
    e.register_kv([kvxfer.Buffer.of(kv, 64)])
    e.room_create(1)
    e.close()
    assert e.closed
    e.close()  # twice: nothing
    with pytest.raises(ValueError, match="closed"):
        e.room_poll(1)
    cfg = kvxfer.Config(role="prefill")
    cfg.close()
    with pytest.raises(ValueError, match="closed"):
        cfg.set("workers", 2)


def test_close_waits_for_calls_in_progress_on_other_threads():
    e = kvxfer.Engine(role="prefill")
    kv = bytearray(64 * 64)
    e.register_kv([kvxfer.Buffer.of(kv, 64)])
    errors = []
    stop = threading.Event()

    def hammer(base):
        i = 0
        while not stop.is_set():
            try:
                e.room_create(base + i)
                e.room_poll(base + i)
                e.room_clear(base + i)
            except ValueError:
                return  # closed: the only allowed failure
            except kvxfer.KvxferError as err:
                errors.append(err)
                return
            i += 1

    threads = [threading.Thread(target=hammer, args=(k << 32,)) for k in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    e.close()
    stop.set()
    for t in threads:
        t.join()
    assert not errors


def test_wait_is_woken_by_a_change_by_wake_and_by_close():
    e = kvxfer.Engine(role="prefill")
    kv = bytearray(4 * 64)
    e.register_kv([kvxfer.Buffer.of(kv, 64)])

    def woken_by(act):
        """What a wait from the current count returns when ``act`` runs meanwhile (a
        minute-long timeout: a wait that is not woken fails the join below)."""
        seen, got = e.changes(), []
        t = threading.Thread(target=lambda: got.append(e.wait(seen, 60)))
        t.start()
        time.sleep(0.02)
        act()
        t.join(30)
        assert not t.is_alive() and got, "the wait was not woken"
        return seen, got[0]

    e.room_create(1)
    # A room's change of state (an abort fails it), wake(), and close().
    for act in (lambda: e.room_abort(1, "x"), e.wake):
        seen, now = woken_by(act)
        assert now > seen, (seen, now)
    # Nothing changes: the count comes back unchanged at the timeout.
    assert e.wait(e.changes(), 0.01) == e.changes()
    seen, now = woken_by(e.close)
    assert now > seen, (seen, now)
    with kvxfer.Engine(role="prefill") as e2, pytest.raises(kvxfer.KvxferError):
        e2.wait(-1, 0)


def test_engine_rejects_config_and_keys_together():
    with kvxfer.Config(role="prefill") as cfg:
        with pytest.raises(TypeError):
            kvxfer.Engine(cfg, workers=2)
        with kvxfer.Engine(cfg) as e:
            assert e.address.startswith("127.0.0.1:")


def test_layers_enqueued_one_at_a_time_land_and_a_repeated_layer_fails_the_room():
    """enqueue_layers: a chunk's two layers (K and V buffers without layer ids) handed
    over one call each land as the whole chunk would; a layer enqueued twice fails the
    room with the reason naming the chunk and the layer."""
    with kvxfer.Engine(role="prefill") as p, kvxfer.Engine(role="decode") as d:
        src = [bytearray(bytes([b + 1]) * 256) for b in range(2)]
        dst = [bytearray(256) for _ in range(2)]
        p.register_kv([kvxfer.Buffer.of(s, 64) for s in src])
        d.register_kv([kvxfer.Buffer.of(x, 64) for x in dst])
        for room in (1, 2):
            p.room_create(room)
            d.room_create(room, [p.address])
            d.room_set_destination(room, [2, 3])
        p.enqueue_layers(1, [0, 1], 1)
        p.enqueue_layers(1, [0, 1], 0, 1, True)
        assert _terminal(d, 1) == RoomState.SUCCESS
        assert dst[0][128:256] == bytes([1]) * 128 and dst[1][128:256] == bytes([2]) * 128
        p.enqueue_layers(2, [0, 1], 0)
        _raises(kvxfer.InvalidArgumentError, "layer 0 was already enqueued",
                p.enqueue_layers, 2, [0, 1], 0)
        assert _terminal(p, 2) == RoomState.FAILED
        _raises(kvxfer.InvalidArgumentError, "layer_first -1", p.enqueue_layers, 2, [0], -1)


def test_the_decode_side_counts_layers_landed():
    """room_layers_landed: 0 until the first layer landed whole, all once SUCCESS."""
    with kvxfer.Engine(role="prefill") as p, kvxfer.Engine(role="decode") as d:
        src = [bytearray(bytes([b + 1]) * 256) for b in range(2)]
        dst = [bytearray(256) for _ in range(2)]
        p.register_kv([kvxfer.Buffer.of(s, 64) for s in src])
        d.register_kv([kvxfer.Buffer.of(x, 64) for x in dst])
        p.room_create(1)
        d.room_create(1, [p.address])
        d.room_set_destination(1, [2, 3])
        assert d.room_layers_landed(1) == 0
        p.enqueue_layers(1, [0, 1], 0, 2, True)
        assert _terminal(d, 1) == RoomState.SUCCESS
        assert d.room_layers_landed(1) == 2
        _raises(kvxfer.WrongRoleError, "decode", p.room_layers_landed, 1)


@pytest.mark.parametrize("integrity", ["verify", "off"])
def test_the_path_and_the_verified_flag_of_a_room(integrity):
    """room_path: engines in one process pair on the same-host path (same_host=auto, the
    default), or TCP with same_host=off; room_verified: SUCCESS with every byte verified,
    with integrity=verify only."""
    for same_host, path in (("auto", kvxfer.DataPath.SAME_HOST), ("off", kvxfer.DataPath.TCP)):
        keys = {"same_host": same_host, "integrity": integrity}
        with kvxfer.Engine(role="prefill", **keys) as p, kvxfer.Engine(role="decode", **keys) as d:
            src = [bytearray(bytes([b + 1]) * 256) for b in range(2)]
            dst = [bytearray(256) for _ in range(2)]
            p.register_kv([kvxfer.Buffer.of(s, 64) for s in src])
            d.register_kv([kvxfer.Buffer.of(x, 64) for x in dst])
            p.room_create(1)
            d.room_create(1, [p.address])
            assert d.room_path(1) in (kvxfer.DataPath.UNKNOWN, path)
            d.room_set_destination(1, [2, 3])
            p.enqueue_chunk(1, [0, 1], True)
            assert _terminal(d, 1) == RoomState.SUCCESS
            assert dst[0][128:256] == bytes([1]) * 128
            assert d.room_path(1) == path and p.room_path(1) == path
            assert d.room_verified(1) == (integrity == "verify")
            m = d.metrics()
            assert m["bytes_verified"] == (256 if integrity == "verify" else 0)
            _raises(kvxfer.WrongRoleError, "decode", p.room_verified, 1)
