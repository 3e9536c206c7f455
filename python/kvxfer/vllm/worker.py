"""The worker side of the vLLM connector: the libkvxfer engine, its rooms, and what
each step reports back to vLLM's scheduler.

vLLM's model runner (worker process) calls the connector's worker methods; the
connector class forwards them to :class:`ConnectorWorker` with plain values (layer
buffers as integer addresses, a :class:`~kvxfer.vllm.plan.StepPlan`), so this module
needs neither vLLM nor torch and is tested with real engines on loopback.

Each step the worker applies the scheduler's plan (create rooms, send or receive,
abort) and sweeps its rooms: a room is reported only once it is terminal **and**
``room_drained`` (no transfer can still touch its blocks), then cleared. Every room
ends (libkvxfer's deadlines), so every request held for a transfer is given back.

One log line per room that failed, under the ``vllm.kvxfer`` logger::

    kvxfer: room <id> of request <req_id> FAILED: <reason>                    (WARNING)
    kvxfer: room <id> of request <req_id> FAILED after its abort: <reason>    (INFO)

the second when the request was aborted here (the client went away); a room that
succeeded is logged at DEBUG (``... SUCCESS``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Mapping, Optional

import kvxfer
from kvxfer import AlreadyExistsError, Engine, KvxferError, NotFoundError, RoomState

from .plan import StepPlan

logger = logging.getLogger("vllm.kvxfer")
engine_logger = logging.getLogger("vllm.kvxfer.engine")

ROLES = {"kv_producer": "prefill", "kv_consumer": "decode"}
"""vLLM's ``kv_role`` -> libkvxfer's ``role``."""


@dataclasses.dataclass(frozen=True)
class LayerBuffer:
    """One layer's KV cache: ``nbytes`` at address ``base``, one page (vLLM block, K
    and V together) every ``page_bytes``."""

    name: str
    layer: int
    base: int
    nbytes: int
    page_bytes: int
    device: Optional[int] = None
    """The CUDA device index of a KV cache in GPU memory; None for CPU memory."""


@dataclasses.dataclass
class StepResults:
    """What one step reports to vLLM's scheduler."""

    finished_sending: set[str] = dataclasses.field(default_factory=set)
    finished_recving: set[str] = dataclasses.field(default_factory=set)
    failed_recving: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class _Room:
    room: int
    req_id: str
    blocks: list[int]
    report: bool  # the request's id goes back to vLLM when the room ends
    aborted: bool = False  # aborted by this side because vLLM dropped the request
    started: float = dataclasses.field(default_factory=time.monotonic)


def engine_config(role: str, keys: Mapping[str, Any]) -> kvxfer.Config:
    """The engine configuration: ``role``, then every key of ``keys`` (vLLM's
    ``kv_connector_extra_config``), each checked by the library (an unknown key or
    bad value raises, naming it)."""
    if "role" in keys:
        raise ValueError("kvxfer: 'role' comes from kv_role, not kv_connector_extra_config")
    cfg = kvxfer.Config(role=role, log_sink=engine_logger)
    try:
        for k, v in keys.items():
            cfg.set(k, v)
    except BaseException:
        cfg.close()
        raise
    return cfg


class ConnectorWorker:
    """One TP rank's engine and rooms. ``role`` is ``"prefill"`` or ``"decode"``."""

    def __init__(self, role: str, keys: Mapping[str, Any], tp_rank: int = 0,
                 single_group: bool = True):
        if role not in ("prefill", "decode"):
            raise ValueError(f"kvxfer: role {role!r}")
        self.role = role
        self.tp_rank = int(tp_rank)
        self._keys = dict(keys)
        engine_config(role, self._keys).close()  # fail at start-up on a bad key
        self._single_group = single_group
        self.engine: Optional[Engine] = None
        self.buffers: list[LayerBuffer] = []
        self._rooms: dict[int, _Room] = {}
        self._by_req: dict[str, int] = {}
        self._done_now = StepResults()
        self._load_errors: set[int] = set()
        self._outcomes = {"rooms_succeeded": 0, "rooms_failed": 0, "rooms_aborted": 0}
        self._last_bytes = (0, 0)
        self._last_rooms: Optional[int] = None

    # -- set-up ------------------------------------------------------------------------

    def register(self, buffers: list[LayerBuffer]) -> None:
        """Starts the engine and registers one KV buffer per layer, paired with the
        peer's by layer index. Buffers that alias one another (layers sharing a KV
        cache) are registered once."""
        if self.engine is not None:
            raise RuntimeError("kvxfer: KV caches registered twice")
        seen: set[int] = set()
        uniq = []
        for b in sorted(buffers, key=lambda b: (b.layer, b.name)):
            if b.base in seen:
                continue
            seen.add(b.base)
            if b.page_bytes <= 0 or b.nbytes % b.page_bytes:
                raise ValueError(f"kvxfer: layer {b.name}: {b.nbytes} bytes are not whole "
                                 f"pages of {b.page_bytes}")
            uniq.append(b)
        if not uniq:
            raise ValueError("kvxfer: no KV cache to register")
        if len({b.device is None for b in uniq}) > 1:
            raise ValueError("kvxfer: some layers' KV caches are in GPU memory and some in "
                             "CPU memory; register one kind")
        with engine_config(self.role, self._keys) as cfg:
            engine = Engine(cfg)
        try:
            # GPU memory goes through kvxfer_register_kv_desc (checked against the CUDA
            # driver; moved through pinned staging over TCP).
            engine.register_kv_layers(
                [kvxfer.Buffer(b.base, b.nbytes, b.page_bytes) if b.device is None
                 else kvxfer.Buffer(b.base, b.nbytes, b.page_bytes, None,
                                    kvxfer.MemoryKind.CUDA, b.device)
                 for b in uniq],
                [b.layer for b in uniq])
        except BaseException:
            engine.close()
            raise
        self.engine, self.buffers = engine, uniq
        logger.info("kvxfer: %s engine at %s, %d layers of %d blocks x %d bytes",
                    self.role, engine.address, len(uniq), uniq[0].nbytes // uniq[0].page_bytes,
                    uniq[0].page_bytes)

    @property
    def address(self) -> str:
        if self.engine is None:
            raise RuntimeError("kvxfer: no engine before the KV caches are registered")
        return self.engine.address

    def close(self) -> None:
        """Stops the engine: live rooms fail with "engine shut down"."""
        if self.engine is not None:
            self.engine.close()

    # -- each step ---------------------------------------------------------------------

    def apply(self, plan: Optional[StepPlan]) -> None:
        """Acts on the scheduler's plan for this step."""
        if not plan:
            return
        engine = self._engine()
        for s in plan.send:
            self._send(engine, s.req_id, s.room, s.blocks)
        for r in plan.recv:
            self._recv(engine, r.req_id, r.room, r.prefill[self.tp_rank], r.blocks)
        for a in plan.abort:
            if a.notify_only:
                if self.tp_rank == 0 and a.prefill:
                    self._notify(engine, a.req_id, a.room, a.prefill, a.reason)
                continue
            room = self._by_req.get(a.req_id)
            if room is None:
                continue  # already reported: nothing of this request is left here
            rec = self._rooms[room]
            rec.aborted = True
            engine.room_abort(room, a.reason)

    def _engine(self) -> Engine:
        if self.engine is None:
            raise RuntimeError("kvxfer: a transfer was planned before the KV caches were registered")
        return self.engine

    def _track(self, room: int, req_id: str, blocks: list[int], report: bool) -> _Room:
        rec = _Room(room, req_id, blocks, report)
        self._rooms[room] = rec
        if report:
            self._by_req[req_id] = room
        return rec

    def _fail_now(self, req_id: str, blocks: list[int], why: str) -> None:
        """A request whose room could not be made: reported at the next sweep."""
        logger.warning("kvxfer: request %s FAILED before its room existed: %s", req_id, why)
        self._outcomes["rooms_failed"] += 1
        if self.role == "prefill":
            self._done_now.finished_sending.add(req_id)
        else:
            self._done_now.finished_recving.add(req_id)
            self._done_now.failed_recving.add(req_id)
            if self._single_group:
                self._load_errors.update(blocks)

    def _send(self, engine: Engine, req_id: str, room: int, blocks: list[int]) -> None:
        try:
            engine.room_create(room, decode_engines=1)
        except KvxferError as e:
            self._fail_now(req_id, blocks, f"room {room}: {e}")
            return
        self._track(room, req_id, blocks, report=True)
        try:
            engine.enqueue_chunk(room, blocks, is_last=True)
        except KvxferError as e:
            engine.room_abort(room, f"could not send the request's blocks: {e}")

    def _recv(self, engine: Engine, req_id: str, room: int, prefill: str, blocks: list[int]) -> None:
        try:
            engine.room_create(room, [prefill])
        except AlreadyExistsError:
            # Another request here pulls this room (params replayed by a client): leave
            # that one alone and fail this one.
            self._fail_now(req_id, blocks, f"room {room} is already in use on this decode")
            return
        except KvxferError as e:
            self._fail_now(req_id, blocks, f"room {room}: {e}")
            return
        self._track(room, req_id, blocks, report=True)
        try:
            engine.room_set_destination(room, blocks)
        except KvxferError as e:
            engine.room_abort(room, f"could not set the destination blocks: {e}")

    def _notify(self, engine: Engine, req_id: str, room: int, prefill: list[str],
                reason: str) -> None:
        # One room on every prefill engine that holds it (all its TP ranks), made only
        # to be aborted: the abort reaches each of them.
        try:
            engine.room_create(room, prefill)
        except KvxferError as e:
            # Live here for another request (or the address is bad): nothing to tell.
            logger.info("kvxfer: room %d of dropped request %s left alone: %s", room, req_id, e)
            return
        self._track(room, req_id, [], report=False).aborted = True
        engine.room_abort(room, reason)

    def results(self) -> StepResults:
        """Sweeps the rooms: those terminal and drained are cleared and reported."""
        out, self._done_now = self._done_now, StepResults()
        engine = self.engine
        if engine is None:
            return out
        for room, rec in list(self._rooms.items()):
            try:
                state = engine.room_poll(room)
                if state not in kvxfer.TERMINAL_STATES or not engine.room_drained(room):
                    continue
                reason = engine.room_failure(room) if state == RoomState.FAILED else None
            except NotFoundError:
                state, reason = RoomState.FAILED, "the room vanished from the engine"
            try:
                engine.room_clear(room)
            except NotFoundError:
                pass
            del self._rooms[room]
            if rec.report:
                del self._by_req[rec.req_id]
            self._ended(rec, state, reason, out)
        return out

    def _ended(self, rec: _Room, state: RoomState, reason: Optional[str], out: StepResults) -> None:
        ms = (time.monotonic() - rec.started) * 1e3
        if state == RoomState.SUCCESS:
            self._outcomes["rooms_succeeded"] += 1
            logger.debug("kvxfer: room %d of request %s SUCCESS (%d blocks, %.1f ms)",
                         rec.room, rec.req_id, len(rec.blocks), ms)
        elif rec.aborted:
            self._outcomes["rooms_aborted"] += 1
            logger.info("kvxfer: room %d of request %s FAILED after its abort: %s",
                        rec.room, rec.req_id, reason)
        else:
            self._outcomes["rooms_failed"] += 1
            logger.warning("kvxfer: room %d of request %s FAILED: %s", rec.room, rec.req_id, reason)
        if not rec.report:
            return
        if self.role == "prefill":
            out.finished_sending.add(rec.req_id)
            return
        out.finished_recving.add(rec.req_id)
        if state == RoomState.FAILED and not rec.aborted:
            # vLLM fails the request (kv_load_failure_policy "fail") or computes it
            # again ("recompute"); the blocks' contents are never used.
            out.failed_recving.add(rec.req_id)
            if self._single_group:
                self._load_errors.update(rec.blocks)

    def take_load_errors(self) -> set[int]:
        """Block ids of decode rooms that failed since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- introspection -----------------------------------------------------------------

    @property
    def rooms(self) -> dict[int, str]:
        """The rooms this worker holds: room id -> request id."""
        return {room: rec.req_id for room, rec in self._rooms.items()}

    def stats(self) -> Optional[dict[str, Any]]:
        """This step's stats for vLLM (see :func:`merge_stats`), or None when nothing
        changed since the last call."""
        if self.engine is None:
            return None
        m = self.engine.metrics()
        rooms = sum(m["rooms_by_state"].values())
        sent, received = m["bytes_sent"], m["bytes_received"]
        delta = dict(self._outcomes)
        delta["bytes_sent"] = sent - self._last_bytes[0]
        delta["bytes_received"] = received - self._last_bytes[1]
        if rooms == self._last_rooms and not any(delta.values()):
            return None
        self._last_rooms, self._last_bytes = rooms, (sent, received)
        self._outcomes = dict.fromkeys(self._outcomes, 0)
        return {"ranks": {str(self.tp_rank): {"rooms": rooms, "tracked": len(self._rooms)}},
                "delta": delta}


def merge_stats(older: Mapping[str, Any], newer: Mapping[str, Any]) -> dict[str, Any]:
    """Merges two stats payloads: of several TP ranks in one step, of the worker and
    the scheduler side, or of successive steps (``newer`` the later). Gauges (per rank
    ``rooms``: rooms present in the engine; ``pending_requests``: requests whose blocks
    the connector holds) take the newer value; deltas add up."""
    out: dict[str, Any] = {}
    ranks = {**older.get("ranks", {}), **newer.get("ranks", {})}
    if ranks:
        out["ranks"] = ranks
    delta = dict(older.get("delta", {}))
    for k, v in newer.get("delta", {}).items():
        delta[k] = delta.get(k, 0) + v
    if delta:
        out["delta"] = delta
    for src in (older, newer):
        if "pending_requests" in src:
            out["pending_requests"] = src["pending_requests"]
    return out


def reduce_stats(data: Mapping[str, Any]) -> dict[str, int | float]:
    """The one-line summary vLLM logs every interval."""
    d = data.get("delta", {})
    out: dict[str, int | float] = {}
    if "ranks" in data:
        out["rooms"] = sum(r["rooms"] for r in data["ranks"].values())
    if "pending_requests" in data:
        out["pending_requests"] = data["pending_requests"]
    for k in ("rooms_succeeded", "rooms_failed", "rooms_aborted"):
        out[k] = d.get(k, 0)
    out["MB_sent"] = round(d.get("bytes_sent", 0) / 1e6, 3)
    out["MB_received"] = round(d.get("bytes_received", 0) / 1e6, 3)
    return out
