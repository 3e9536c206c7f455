"""The bootstrap server through which decode ranks find the prefill engines.

The same HTTP interface as SGLang's ``CommonKVBootstrapServer`` (so SGLang's own
helpers, such as ``CommonKVReceiver.query_prefill_dp_ranks``, work against it), built on
the standard library's ``http.server``:

- ``PUT /route``: a prefill rank registers its topology and its libkvxfer engine
  address (``rank_ip``, ``rank_port``, and ``kvxfer_address`` in ``host:port`` form).
- ``GET /route?prefill_dp_rank=&prefill_cp_rank=&target_tp_rank=&target_pp_rank=``:
  with every value -1, the prefill server's topology (503 until every rank
  registered); otherwise the address of that rank (404 if unknown).
- ``POST /register_dp_rank`` ``{"bootstrap_room", "dp_rank"}`` and
  ``POST /query_dp_ranks`` ``{"bootstrap_rooms": [...]}``: which prefill DP rank took
  a request, for routers that do not follow the bootstrap room.
- ``GET /health``.

A malformed request (bad JSON, a missing or ill-typed field, a rank outside its size,
a topology that contradicts the first registration, a body over 1 MiB) is answered
with a 4xx status and a message saying what is wrong; the server never stops for one.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional
from urllib.parse import parse_qs, urlsplit

from ._compat import BaseKVBootstrapServer

logger = logging.getLogger("kvxfer.sglang")

MAX_BODY = 1 << 20
"""Largest request body accepted, in bytes."""

DP_RANK_TTL_S = 600.0
"""How long a ``register_dp_rank`` entry is kept."""

MAX_DP_RANK_ENTRIES = 1 << 20
"""Most ``register_dp_rank`` entries kept (the oldest go first)."""

_INT_FIELDS = (
    "attn_tp_size",
    "attn_tp_rank",
    "attn_cp_size",
    "attn_cp_rank",
    "attn_dp_size",
    "attn_dp_rank",
    "pp_size",
    "pp_rank",
    "system_dp_size",
    "system_dp_rank",
    "rank_port",
    "page_size",
)
_RANKS = (
    ("attn_tp_rank", "attn_tp_size"),
    ("attn_cp_rank", "attn_cp_size"),
    ("attn_dp_rank", "attn_dp_size"),
    ("pp_rank", "pp_size"),
    ("system_dp_rank", "system_dp_size"),
)


class BadRequest(Exception):
    """A request the server refuses; carries the HTTP status and the message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise BadRequest(400, f"{what} must be an integer, not {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise BadRequest(400, f"{what} must be an integer, not {value!r}")


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def split_address(address: str) -> tuple[str, int]:
    """The host and port of a ``host:port`` (``[v6]:port``) address."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{address!r} is not host:port")
    return host.strip("[]"), int(port)


class _Registry:
    """The bootstrap server's tables, behind one lock."""

    TOPOLOGY = ("attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size", "kv_cache_dtype")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.topology: Optional[dict[str, Any]] = None
        self.ranks: dict[tuple[int, int, int, int], dict[str, Any]] = {}
        self.room_to_dp_rank: dict[int, tuple[int, float]] = {}

    def register(self, data: Any) -> None:
        if not isinstance(data, dict):
            raise BadRequest(400, "the body must be a JSON object")
        missing = [f for f in _INT_FIELDS + ("rank_ip", "kv_cache_dtype") if f not in data]
        if missing:
            raise BadRequest(400, "missing fields: " + ", ".join(missing))
        v = {f: _int(data[f], f) for f in _INT_FIELDS}
        for rank, size in _RANKS:
            if v[size] < 1:
                raise BadRequest(400, f"{size} must be at least 1, not {v[size]}")
            if not 0 <= v[rank] < v[size]:
                raise BadRequest(400, f"{rank} {v[rank]} is outside 0..{v[size] - 1}")
        if not 0 < v["rank_port"] < 65536:
            raise BadRequest(400, f"rank_port {v['rank_port']} is not a TCP port")
        rank_ip = data["rank_ip"]
        if not isinstance(rank_ip, str) or not rank_ip:
            raise BadRequest(400, f"rank_ip must be a host name or address, not {rank_ip!r}")
        address = data.get("kvxfer_address") or format_address(rank_ip, v["rank_port"])
        if not isinstance(address, str):
            raise BadRequest(400, f"kvxfer_address must be host:port, not {address!r}")
        try:
            split_address(address)
        except ValueError as e:
            raise BadRequest(400, f"kvxfer_address: {e}") from None
        dp_size = v["attn_dp_size"] if v["system_dp_size"] == 1 else v["system_dp_size"]
        dp_group = v["attn_dp_rank"] if v["system_dp_size"] == 1 else v["system_dp_rank"]
        topology = {
            "attn_tp_size": v["attn_tp_size"],
            "attn_cp_size": v["attn_cp_size"],
            "dp_size": dp_size,
            "pp_size": v["pp_size"],
            "page_size": v["page_size"],
            "kv_cache_dtype": data["kv_cache_dtype"],
        }
        with self.lock:
            if self.topology is None:
                self.topology = dict(
                    topology,
                    kv_layout=data.get("kv_layout"),
                    follow_bootstrap_room=data.get("load_balance_method", "follow_bootstrap_room")
                    == "follow_bootstrap_room",
                    decode_allocation_policy=data.get("decode_allocation_policy", "early"),
                    transfer_backend=data.get("transfer_backend", "kvxfer"),
                )
            else:
                clash = [k for k in self.TOPOLOGY if self.topology[k] != topology[k]]
                if clash:
                    raise BadRequest(
                        400,
                        "registration contradicts the first one: "
                        + ", ".join(f"{k} {topology[k]!r} != {self.topology[k]!r}" for k in clash),
                    )
            # A rank that registers again (a restarted prefill) replaces its entry.
            self.ranks[(dp_group, v["attn_cp_rank"], v["attn_tp_rank"], v["pp_rank"])] = {
                "rank_ip": rank_ip,
                "rank_port": v["rank_port"],
                "kvxfer_address": address,
            }

    def expected(self) -> int:
        t = self.topology
        return 0 if t is None else t["dp_size"] * t["attn_cp_size"] * t["attn_tp_size"] * t["pp_size"]

    def ready(self) -> bool:
        return self.topology is not None and len(self.ranks) >= self.expected()

    def route(self, query: dict[str, list[str]]) -> dict[str, Any]:
        keys = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
        missing = [k for k in keys if not query.get(k)]
        if missing:
            raise BadRequest(400, "missing query parameters: " + ", ".join(missing))
        dp, cp, tp, pp = (_int(query[k][0], k) for k in keys)
        with self.lock:
            if not self.ready():
                raise BadRequest(
                    503,
                    f"prefill server not fully registered yet ({len(self.ranks)} of "
                    f"{self.expected() or '?'} ranks)",
                )
            if (dp, cp, tp, pp) == (-1, -1, -1, -1):
                return dict(self.topology)  # type: ignore[arg-type]
            info = self.ranks.get((dp, cp, tp, pp))
            if info is None:
                raise BadRequest(
                    404,
                    f"bootstrap info not found for dp_rank={dp} cp_rank={cp} tp_rank={tp} pp_rank={pp}",
                )
            return dict(info)

    def register_dp_rank(self, data: Any) -> None:
        if not isinstance(data, dict) or "bootstrap_room" not in data or "dp_rank" not in data:
            raise BadRequest(400, "the body must be {\"bootstrap_room\": int, \"dp_rank\": int}")
        room = _int(data["bootstrap_room"], "bootstrap_room")
        dp_rank = _int(data["dp_rank"], "dp_rank")
        now = time.monotonic()
        with self.lock:
            self.room_to_dp_rank.pop(room, None)
            self.room_to_dp_rank[room] = (dp_rank, now)
            # Dicts keep insertion order: the oldest entries are first.
            while self.room_to_dp_rank:
                oldest, (_, t) = next(iter(self.room_to_dp_rank.items()))
                if t > now - DP_RANK_TTL_S and len(self.room_to_dp_rank) <= MAX_DP_RANK_ENTRIES:
                    break
                del self.room_to_dp_rank[oldest]

    def query_dp_ranks(self, data: Any) -> dict[str, int]:
        rooms = data.get("bootstrap_rooms") if isinstance(data, dict) else None
        if not isinstance(rooms, list):
            raise BadRequest(400, "the body must be {\"bootstrap_rooms\": [int, ...]}")
        ids = [_int(r, "bootstrap_rooms[]") for r in rooms]
        with self.lock:
            return {str(r): self.room_to_dp_rank[r][0] for r in ids if r in self.room_to_dp_rank}


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    protocol_version = "HTTP/1.1"
    timeout = 30  # a client that stalls mid-request loses its connection, not a thread

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
        logger.debug("bootstrap %s: " + format, self.client_address[0], *args)

    def _reply(self, status: int, body: Any) -> None:
        if isinstance(body, str):
            data, ctype = body.encode(), "text/plain; charset=utf-8"
        else:
            data, ctype = json.dumps(body).encode(), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _json(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None:
            raise BadRequest(411, "Content-Length required")
        n = _int(length, "Content-Length")
        if not 0 <= n <= MAX_BODY:
            self.close_connection = True
            raise BadRequest(413, f"body of {n} bytes is over the {MAX_BODY}-byte limit")
        raw = self.rfile.read(n)
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(400, f"body is not JSON: {e}") from None

    def _dispatch(self, method: str) -> None:
        try:
            url = urlsplit(self.path)
            reg = self.server.registry
            routes = {
                "/route": ("GET", "PUT"),
                "/register_dp_rank": ("POST",),
                "/query_dp_ranks": ("POST",),
                "/health": ("GET",),
            }
            if url.path not in routes:
                raise BadRequest(404, f"no route {url.path}")
            if method not in routes[url.path]:
                raise BadRequest(405, f"{method} not allowed on {url.path}")
            if url.path == "/health":
                self._reply(200, "OK")
            elif url.path == "/route" and method == "PUT":
                reg.register(self._json())
                self._reply(200, "OK")
            elif url.path == "/route":
                self._reply(200, reg.route(parse_qs(url.query)))
            elif url.path == "/register_dp_rank":
                reg.register_dp_rank(self._json())
                self._reply(200, "OK")
            else:
                self._reply(200, reg.query_dp_ranks(self._json()))
        except BadRequest as e:
            self._reply(e.status, e.message)
        except Exception as e:  # a bug here must cost one request, not the server
            logger.exception("bootstrap server: %s %s failed", method, self.path)
            self._reply(500, f"internal error: {type(e).__name__}: {e}")

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int]):
        self.registry = _Registry()
        if ":" in address[0]:
            import socket

            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)


class KvxferKVBootstrapServer(BaseKVBootstrapServer):
    """The bootstrap server, started in a daemon thread by the constructor (as SGLang
    starts its own in the prefill's HTTP server process). ``port=0`` picks a free port
    (see :attr:`port`)."""

    def __init__(self, host: str, port: int):
        self.host = host
        self._server = _Server((host, port))
        self.port = self._server.server_address[1]
        self.thread = threading.Thread(
            target=self._server.serve_forever, name="kvxfer-bootstrap", daemon=True
        )
        self.thread.start()
        logger.info("kvxfer bootstrap server on %s", format_address(host, self.port))

    @property
    def address(self) -> str:
        """``host:port`` of the server (what SGLang calls the bootstrap address)."""
        return format_address(self.host, self.port)

    def close(self) -> None:
        """Stops the server and joins its thread."""
        self._server.shutdown()
        self._server.server_close()
        self.thread.join(timeout=5)


def http_json(
    method: str, url: str, body: Any = None, timeout: float = 5.0
) -> tuple[int, Any]:
    """One HTTP request with an optional JSON body: ``(status, parsed JSON or text)``;
    status 0 with the error text when the server cannot be reached."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw, status, ctype = resp.read(), resp.status, resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        raw, status, ctype = e.read(), e.code, e.headers.get("Content-Type", "")
    except (urllib.error.URLError, OSError) as e:
        return 0, str(getattr(e, "reason", e))
    text = raw.decode("utf-8", "replace")
    if ctype.startswith("application/json"):
        try:
            return status, json.loads(text)
        except ValueError:
            pass
    return status, text
