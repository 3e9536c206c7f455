"""The backend's contract with SGLang 0.5.23, read from the installed ``sglang``
package's source with ``ast`` (importing it needs torch): the base classes' method
signatures, the scheduler's own calls into the transfer classes, ``KVPoll`` and
``KVArgs``, and the backend table that :func:`kvxfer.sglang.install` extends. Also the
bootstrap server's answers to good and bad requests."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import inspect
import json
import socket
import sys
import types
from pathlib import Path

import pytest

import kvxfer.sglang as ks
from kvxfer.sglang import _compat
from kvxfer.sglang.bootstrap import MAX_BODY, http_json

VERSION = "0.5.23"
BASES = ("BaseKVManager", "BaseKVSender", "BaseKVReceiver", "BaseKVBootstrapServer")
OURS = {
    "BaseKVManager": ks.KvxferKVManager,
    "BaseKVSender": ks.KvxferKVSender,
    "BaseKVReceiver": ks.KvxferKVReceiver,
    "BaseKVBootstrapServer": ks.KvxferKVBootstrapServer,
}


@pytest.fixture(scope="module")
def sglang_root() -> Path:
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"sglang is not installed (make python-test installs sglang=={VERSION} --no-deps)")
    assert version == VERSION, f"installed sglang is {version}; the backend targets {VERSION}"
    spec = importlib.util.find_spec("sglang")  # locates the package without importing it
    return Path(next(iter(spec.submodule_search_locations))) / "srt"


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)}


def _params(fn: ast.FunctionDef) -> list[tuple[str, str, str | None]]:
    """(name, kind, default source) of each parameter after self."""
    a = fn.args
    out = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for p, d in zip(positional, defaults):
        out.append((p.arg, "positional", None if d is None else ast.unparse(d)))
    if a.vararg:
        out.append((a.vararg.arg, "var_positional", None))
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append((p.arg, "keyword_only", None if d is None else ast.unparse(d)))
    if a.kwarg:
        out.append((a.kwarg.arg, "var_keyword", None))
    return out[1:]


def _methods(cls: ast.ClassDef) -> dict[str, tuple[list, bool]]:
    out = {}
    for n in cls.body:
        if isinstance(n, ast.FunctionDef):
            abstract = any(ast.unparse(d) in ("abstractmethod", "abc.abstractmethod") for d in n.decorator_list)
            out[n.name] = (_params(n), abstract)
    return out


def _ours(fn) -> list[tuple[str, str, str | None]]:
    kinds = {
        inspect.Parameter.POSITIONAL_ONLY: "positional",
        inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
        inspect.Parameter.VAR_POSITIONAL: "var_positional",
        inspect.Parameter.KEYWORD_ONLY: "keyword_only",
        inspect.Parameter.VAR_KEYWORD: "var_keyword",
    }
    out = []
    for p in list(inspect.signature(fn).parameters.values())[1:]:
        d = p.default
        if d is inspect.Parameter.empty:
            src = None
        elif isinstance(d, __import__("enum").Enum):
            src = f"{type(d).__name__}.{d.name}"
        else:
            src = repr(d)
        out.append((p.name, kinds[p.kind], src))
    return out


def test_method_signatures_match_sglangs_base_classes(sglang_root):
    base = _classes(sglang_root / "disaggregation/base/conn.py")
    checked = 0
    for name in BASES:
        theirs = _methods(base[name])
        ours_cls = OURS[name]
        assert not inspect.isabstract(ours_cls), f"{ours_cls.__name__} leaves abstract methods"
        for meth, (params, abstract) in theirs.items():
            fn = getattr(ours_cls, meth, None)
            assert fn is not None, f"{ours_cls.__name__} lacks {meth}"
            if isinstance(inspect.getattr_static(ours_cls, meth), property):
                continue
            mine = _ours(fn)
            # The same parameters, in order, with the same defaults; anything added
            # after them has a default, so every call SGLang makes binds the same way.
            assert mine[: len(params)] == params, (ours_cls.__name__, meth, mine, params)
            assert all(d is not None or k.startswith("var") for _, k, d in mine[len(params):]), meth
            if abstract:
                assert meth in {m for c in ours_cls.__mro__[:-1] if c.__name__ not in BASES
                                and c is not object for m in vars(c)}, f"{meth} not implemented"
            checked += 1
        if not _compat.SGLANG_BASES:
            # The stand-in bases have exactly SGLang's methods and signatures.
            stand_in = getattr(_compat, name)
            mine_methods = {m for m, v in vars(stand_in).items()
                            if inspect.isfunction(v) or isinstance(v, property)}
            assert mine_methods == set(theirs) | {m for m, v in vars(stand_in).items()
                                                 if isinstance(v, property)}, name
            for meth, (params, abstract) in theirs.items():
                v = vars(stand_in)[meth]
                if isinstance(v, property):
                    continue
                assert _ours(v) == params, (name, meth)
                assert getattr(v, "__isabstractmethod__", False) == abstract, (name, meth)
    assert checked >= 20


def test_sglangs_scheduler_calls_bind_to_our_classes(sglang_root):
    """Every place SGLang's schedulers construct a transfer class, with the keywords
    they pass, binds to our constructors."""
    targets = {"kv_sender_class": ks.KvxferKVSender, "kv_receiver_class": ks.KvxferKVReceiver,
               "kv_manager_class": ks.KvxferKVManager,
               "kv_bootstrap_server_class": ks.KvxferKVBootstrapServer}
    found = set()
    for f in ("disaggregation/prefill.py", "disaggregation/decode.py", "managers/disagg_service.py"):
        for node in ast.walk(ast.parse((sglang_root / f).read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in targets:
                cls = targets[node.func.id]
                args = [object()] * len([a for a in node.args if not isinstance(a, ast.Starred)])
                kwargs = {k.arg: object() for k in node.keywords if k.arg}
                if any(isinstance(k.value, ast.Dict) or k.arg is None for k in node.keywords):
                    continue  # **kwargs that only the Ascend backend fills
                inspect.signature(cls).bind(*args, **kwargs)
                found.add(node.func.id)
    assert found == set(targets)


def test_the_methods_sglangs_schedulers_call_exist(sglang_root):
    used: dict[str, set[str]] = {"disagg_kv_sender": set(), "kv_receiver": set()}
    for f in ("disaggregation/prefill.py", "disaggregation/decode.py", "managers/scheduler.py"):
        for n in ast.walk(ast.parse((sglang_root / f).read_text())):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) \
                    and n.value.attr in used:
                used[n.value.attr].add(n.attr)
    # Reached only by features this backend does not offer (early-send events,
    # deferred KV release, staging buffers), each guarded in SGLang by a flag or hasattr.
    not_offered = {"_early_send_wait_event", "ensure_abort_notified"}
    for cls, names in ((ks.KvxferKVSender, used["disagg_kv_sender"]),
                       (ks.KvxferKVReceiver, used["kv_receiver"])):
        missing = {a for a in names - not_offered if not hasattr(cls, a)
                   and a not in ("kv_mgr", "conclude_state", "bootstrap_infos", "abort_notified")}
        assert not missing, (cls.__name__, missing)
    assert {"init", "send_metadata", "clear", "abort", "failure_exception"} <= used["kv_receiver"]


def test_kvpoll_and_kvargs_are_sglangs(sglang_root):
    base = _classes(sglang_root / "disaggregation/base/conn.py")
    values = {t.targets[0].id: t.value.value for t in base["KVPoll"].body if isinstance(t, ast.Assign)}
    assert values == {"Failed": 0, "Bootstrapping": 1, "WaitingForInput": 2, "Transferring": 3, "Success": 4}
    for k, v in values.items():
        assert getattr(ks.KVPoll, k) == v
        assert ks.KVPoll.__dict__[k] == int(getattr(__import__("kvxfer").RoomState, {
            "Failed": "FAILED", "Bootstrapping": "BOOTSTRAPPING", "WaitingForInput": "WAITING_FOR_INPUT",
            "Transferring": "TRANSFERRING", "Success": "SUCCESS"}[k]))
    fields = {n.target.id for n in base["KVArgs"].body if isinstance(n, ast.AnnAssign)}
    # Every KVArgs field the manager reads exists in SGLang's KVArgs.
    read = {"engine_rank", "kv_data_ptrs", "kv_data_lens", "kv_item_lens", "kv_layer_ids",
            "aux_data_ptrs", "aux_data_lens", "aux_item_lens", "state_data_ptrs", "page_size",
            "pp_rank", "system_dp_rank", "kv_cache_dtype_str", "kv_layout", "ib_device"}
    assert read <= fields, read - fields
    common = _classes(sglang_root / "disaggregation/common/conn.py")
    err = {n.name: _params(n) for n in common["KVTransferError"].body if isinstance(n, ast.FunctionDef)}
    assert _ours(ks.KVTransferError.__init__) == err["__init__"]


def test_install_adds_the_backend_to_sglangs_table(sglang_root, monkeypatch):
    """``install()`` against SGLang's own ``TransferBackend``/``KVClassType`` enums and
    choices list, taken from its source (the rest of the module needs torch)."""
    utils_src = (sglang_root / "disaggregation/utils.py").read_text()
    tree = ast.parse(utils_src)
    keep = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in ("TransferBackend", "KVClassType")]
    assert len(keep) == 2
    utils = types.ModuleType("sglang.srt.disaggregation.utils")
    exec(compile(ast.Module(body=[ast.parse("from enum import Enum").body[0], *keep], type_ignores=[]),
                 str(sglang_root / "disaggregation/utils.py"), "exec"), utils.__dict__)
    calls = []

    def original(backend, class_type):
        calls.append((backend, class_type))
        return "sglang's"

    utils.get_kv_class = original
    importer = types.ModuleType("sglang.srt.disaggregation.prefill")
    importer.get_kv_class = original  # `from ..utils import get_kv_class`
    spec = importlib.util.spec_from_file_location("sglang.srt.arg_groups.choices",
                                                  sglang_root / "arg_groups/choices.py")
    choices = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(choices)
    for name in ("sglang", "sglang.srt", "sglang.srt.disaggregation", "sglang.srt.arg_groups"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setattr(sys.modules["sglang.srt.disaggregation"], "utils", utils, raising=False)
    monkeypatch.setattr(sys.modules["sglang.srt.arg_groups"], "choices", choices, raising=False)
    monkeypatch.setitem(sys.modules, utils.__name__, utils)
    monkeypatch.setitem(sys.modules, importer.__name__, importer)
    monkeypatch.setitem(sys.modules, choices.__name__, choices)

    ks.install()
    ks.install()  # idempotent
    TB, KC = utils.TransferBackend, utils.KVClassType
    assert TB("kvxfer") is TB.KVXFER and TB.KVXFER in list(TB)
    assert choices.DISAGG_TRANSFER_BACKEND_CHOICES.count("kvxfer") == 1
    for fn in (utils.get_kv_class, importer.get_kv_class):
        assert fn(TB.KVXFER, KC.MANAGER) is ks.KvxferKVManager
        assert fn(TB.KVXFER, KC.SENDER) is ks.KvxferKVSender
        assert fn(TB.KVXFER, KC.RECEIVER) is ks.KvxferKVReceiver
        assert fn(TB.KVXFER, KC.BOOTSTRAP_SERVER) is ks.KvxferKVBootstrapServer
    assert utils.get_kv_class(TB.KVXFER, KC.KVARGS) == "sglang's"  # KVArgs is shared
    assert utils.get_kv_class(TB.MOONCAKE, KC.SENDER) == "sglang's"
    assert (TB.MOONCAKE, KC.SENDER) in calls


# ---------------------------------------------------------------------------------------
# The bootstrap server


def _rank(**over):
    d = dict(attn_tp_size=1, attn_tp_rank=0, attn_cp_size=1, attn_cp_rank=0, attn_dp_size=1,
             attn_dp_rank=0, pp_size=2, pp_rank=0, system_dp_size=1, system_dp_rank=0,
             rank_ip="127.0.0.1", rank_port=5000, page_size=16, kv_cache_dtype="bfloat16")
    d.update(over)
    return d


def _raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            c = s.recv(65536)
            if not c:
                break
            chunks.append(c)
    return b"".join(chunks)


def test_bootstrap_server_answers_bad_requests_with_errors_and_keeps_serving():
    srv = ks.KvxferKVBootstrapServer("127.0.0.1", 0)
    base = f"http://{srv.address}"
    try:
        route = f"{base}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
        assert http_json("GET", f"{base}/health") == (200, "OK")
        status, body = http_json("GET", route)
        assert status == 503 and "not fully registered" in body
        bad = [
            (("PUT", "/route", {"attn_tp_size": 1}), 400, "missing fields"),
            (("PUT", "/route", [1, 2]), 400, "JSON object"),
            (("PUT", "/route", _rank(attn_tp_rank=3)), 400, "attn_tp_rank 3"),
            (("PUT", "/route", _rank(pp_size=0)), 400, "pp_size"),
            (("PUT", "/route", _rank(rank_port=70000)), 400, "rank_port"),
            (("PUT", "/route", _rank(rank_port="x")), 400, "rank_port"),
            (("PUT", "/route", _rank(rank_port=True)), 400, "rank_port"),
            (("PUT", "/route", _rank(kvxfer_address="nohostport")), 400, "kvxfer_address"),
            (("GET", "/route?prefill_dp_rank=0", None), 400, "missing query"),
            (("GET", "/route?prefill_dp_rank=a&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0", None),
             400, "prefill_dp_rank"),
            (("POST", "/register_dp_rank", {"bootstrap_room": 1}), 400, "dp_rank"),
            (("POST", "/query_dp_ranks", {"bootstrap_rooms": "x"}), 400, "bootstrap_rooms"),
            (("DELETE", "/route", None), 405, "not allowed"),
            (("GET", "/nothing", None), 404, "no route"),
        ]
        for (method, path, body_in), code, text in bad:
            status, body = http_json(method, base + path, body_in)
            assert status == code and text in body, (method, path, status, body)
        # Raw bytes: not JSON, no length, too long, garbage request line.
        r = _raw(srv.port, b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n{nope")
        assert b" 400 " in r.split(b"\r\n")[0] and b"not JSON" in r
        r = _raw(srv.port, b"PUT /route HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b" 411 " in r.split(b"\r\n")[0]
        r = _raw(srv.port, f"PUT /route HTTP/1.1\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n".encode())
        assert b" 413 " in r.split(b"\r\n")[0]
        r = _raw(srv.port, b"\x00\xff garbage\r\n\r\n")  # answered as HTTP/0.9: a body only
        assert b"400" in r and b"Bad request" in r
        # Still serving; a real registration flow works.
        assert http_json("PUT", base + "/route", _rank(rank_port=5000))[0] == 200
        assert http_json("GET", route)[0] == 503  # 1 of 2 pipeline ranks
        status, body = http_json("PUT", base + "/route", _rank(pp_size=4))
        assert status == 400 and "contradicts" in body and "pp_size" in body
        assert http_json("PUT", base + "/route", _rank(pp_rank=1, rank_port=5001,
                                                       kvxfer_address="127.0.0.1:6001"))[0] == 200
        status, body = http_json("GET", route)
        assert status == 200 and body["pp_size"] == 2 and body["transfer_backend"] == "kvxfer"
        status, body = http_json(
            "GET", f"{base}/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=1")
        assert status == 200 and body["kvxfer_address"] == "127.0.0.1:6001"
        status, body = http_json(
            "GET", f"{base}/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=5&target_pp_rank=0")
        assert status == 404 and "tp_rank=5" in body
        assert http_json("POST", base + "/register_dp_rank", {"bootstrap_room": 9, "dp_rank": 1})[0] == 200
        assert http_json("POST", base + "/query_dp_ranks", {"bootstrap_rooms": [9, 10]}) == (200, {"9": 1})
        assert http_json("GET", f"{base}/health") == (200, "OK")
    finally:
        srv.close()
    status, _ = http_json("GET", f"{base}/health", timeout=1)
    assert status == 0  # closed: connection refused, reported, not raised
    json.dumps(body)
