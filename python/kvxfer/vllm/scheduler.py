"""The scheduler side of the vLLM connector: which requests get a room, when blocks
may be freed, and what the worker side must do each step.

vLLM's scheduler (engine core process) calls the connector's scheduler methods; the
connector class forwards them to :class:`PrefillScheduler` or :class:`DecodeScheduler`
with plain values (request ids, params dicts, block id lists), so this module needs
neither vLLM nor an engine and is tested on its own.

The rules it keeps are vLLM's asserts (`vllm/v1/core/sched/scheduler.py`): a prefill
request whose ``request_finished`` returned True keeps its blocks until its id comes
back in ``finished_sending``; a decode request waiting for its KV leaves that state
only through ``finished_recving``, which must name it once and only while vLLM still
holds it.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any, Mapping, Optional

from .plan import (
    AbortRoom,
    BadParams,
    RecvRoom,
    RemotePrefill,
    SendRoom,
    StepPlan,
    mark_processed,
    prefill_params,
    remote_prefill,
    room_and_prefill,
)

logger = logging.getLogger("vllm.kvxfer")

ABORTED_REASON = "the decode request was aborted before its KV arrived"
NOT_LOADED_REASON = "the decode computes this request itself"


class PrefillScheduler:
    """Prefill (``kv_producer``): a request that finished with params
    ``do_remote_decode`` gets a fresh room; its blocks are sent as one chunk on the
    worker's next step and stay allocated until the worker reports the room ended
    (succeeded or failed) and drained."""

    def __init__(self, rng: Optional[secrets.SystemRandom] = None):
        self._rng = rng or secrets.SystemRandom()
        self._addresses: Optional[list[str]] = None
        self._plan = StepPlan()
        # Requests whose blocks this connector holds: req_id -> room.
        self._sending: dict[str, int] = {}
        self._rooms: set[int] = set()

    def set_addresses(self, by_rank: Mapping[int, str]) -> None:
        """The libkvxfer engine address of every TP rank (from the workers'
        handshake metadata)."""
        ranks = sorted(by_rank)
        if ranks != list(range(len(ranks))) or not ranks:
            raise ValueError(f"kvxfer: engine addresses for TP ranks {ranks}, expected 0..n-1")
        self._addresses = [by_rank[r] for r in ranks]

    def new_room(self) -> int:
        """A room id unused by any request this prefill still holds."""
        while True:
            room = self._rng.getrandbits(64)
            if room not in self._rooms:
                return room

    def request_finished(
        self,
        req_id: str,
        params: Optional[Mapping[str, Any]],
        block_ids: list[int],
        finished_normally: bool,
        num_computed_tokens: int,
    ) -> tuple[bool, Optional[dict[str, Any]]]:
        """vLLM's ``request_finished``: ``(keep the blocks, params for the decode)``."""
        if not params or not params.get("do_remote_decode"):
            return False, None
        if not finished_normally:
            # Aborted or failed here: no room exists yet, the decode never hears of it.
            return False, None
        if not block_ids:
            return False, None
        if self._addresses is None:
            logger.error("kvxfer: request %s finished before the workers' engine addresses "
                         "were known; its KV is not sent", req_id)
            return False, None
        if req_id in self._sending:
            raise AssertionError(f"kvxfer: request_finished twice for {req_id}")
        room = self.new_room()
        self._sending[req_id] = room
        self._rooms.add(room)
        self._plan.send.append(SendRoom(req_id, room, [int(b) for b in block_ids]))
        return True, prefill_params(room, self._addresses, int(num_computed_tokens),
                                    len(block_ids))

    def finished_sending(self, req_ids: Any) -> None:
        """The worker reported these requests' rooms ended: vLLM frees their blocks."""
        for req_id in req_ids or ():
            room = self._sending.pop(req_id, None)
            if room is not None:
                self._rooms.discard(room)

    def build_plan(self) -> StepPlan:
        plan, self._plan = self._plan, StepPlan()
        return plan

    @property
    def pending_requests(self) -> int:
        """Requests whose blocks wait for their room to end."""
        return len(self._sending)


class DecodeScheduler:
    """Decode (``kv_consumer``): a request whose params name a kvxfer room loads its
    whole prompt asynchronously into the blocks vLLM allocates for it; vLLM's prefix
    cache must be off (a local hit would leave fewer destination blocks than the
    prefill sends)."""

    def __init__(self, tp_size: int = 1):
        self.tp_size = int(tp_size)
        self._plan = StepPlan()
        # Requests waiting for their KV: req_id -> room.
        self._recving: dict[str, int] = {}

    def _usable(
        self, params: Optional[Mapping[str, Any]], num_prompt_tokens: int, num_computed_tokens: int
    ) -> Optional[RemotePrefill]:
        rp = remote_prefill(params)
        if rp is None:
            return None
        if len(rp.prefill) != self.tp_size:
            raise BadParams(
                f"{len(rp.prefill)} prefill TP ranks but this decode has {self.tp_size} "
                "(different TP sizes are not supported yet)")
        if rp.num_tokens is not None and rp.num_tokens != num_prompt_tokens:
            raise BadParams(f"the prefill holds {rp.num_tokens} tokens, the prompt here has "
                            f"{num_prompt_tokens}")
        if num_computed_tokens:
            raise BadParams(f"{num_computed_tokens} tokens are cached here already "
                            "(decode prefix caching is not supported yet)")
        return rp

    def num_new_matched_tokens(
        self,
        params: Optional[Mapping[str, Any]],
        num_prompt_tokens: int,
        num_computed_tokens: int,
    ) -> tuple[int, bool]:
        """vLLM's ``get_num_new_matched_tokens``; side-effect free."""
        try:
            rp = self._usable(params, num_prompt_tokens, num_computed_tokens)
        except BadParams:
            return 0, False  # computed here; update_state_after_alloc says why
        if rp is None or num_prompt_tokens <= 0:
            return 0, False
        return num_prompt_tokens, True

    def after_alloc(
        self,
        req_id: str,
        params: Optional[dict[str, Any]],
        num_prompt_tokens: int,
        block_ids: list[int],
        num_external_tokens: int,
    ) -> None:
        """vLLM's ``update_state_after_alloc`` (``block_ids``: the request's blocks not
        found in the local cache, in order). A request whose params this decode cannot
        use is computed here, and its room is aborted so the prefill frees its blocks."""
        try:
            rp = self._usable(params, num_prompt_tokens, 0)
            why = None
        except BadParams as e:
            rp, why = None, str(e)
        if rp is None and why is None:
            return
        assert params is not None
        mark_processed(params)
        if rp is not None and num_external_tokens > 0:
            # vLLM now waits for this request's KV: it leaves that state only when the
            # worker reports the room ended (a block count that does not match the
            # prefill's fails the room, with the library's reason).
            self._recving[req_id] = rp.room
            self._plan.recv.append(RecvRoom(req_id, rp.room, rp.prefill, [int(b) for b in block_ids]))
            return
        why = why or "some of its tokens are cached here (decode prefix caching is not supported yet)"
        logger.warning("kvxfer: request %s is computed here, not loaded: %s", req_id, why)
        self._notify(req_id, params, f"{NOT_LOADED_REASON}: {why}")

    def _notify(self, req_id: str, params: Optional[Mapping[str, Any]], reason: str) -> None:
        found = room_and_prefill(params)
        if found is not None:
            room, prefill = found
            self._plan.abort.append(AbortRoom(req_id, room, reason, prefill, notify_only=True))

    def request_finished(
        self, req_id: str, params: Optional[dict[str, Any]]
    ) -> tuple[bool, Optional[dict[str, Any]]]:
        """vLLM's ``request_finished``. vLLM itself keeps the blocks of a request that
        was waiting for its KV until the worker reports it; the worker aborts the room
        first."""
        room = self._recving.get(req_id)
        if room is not None:
            self._plan.abort.append(AbortRoom(req_id, room, ABORTED_REASON))
        elif remote_prefill_unread(params):
            # Dropped before it was scheduled: no blocks here, but the prefill holds
            # blocks for it until told.
            assert params is not None
            mark_processed(params)
            self._notify(req_id, params, ABORTED_REASON)
        return False, None

    def finished_recving(self, req_ids: Any) -> None:
        for req_id in req_ids or ():
            self._recving.pop(req_id, None)

    def build_plan(self) -> StepPlan:
        plan, self._plan = self._plan, StepPlan()
        return plan

    @property
    def pending_requests(self) -> int:
        """Requests waiting for their KV (their blocks allocated here)."""
        return len(self._recving)


def remote_prefill_unread(params: Optional[Mapping[str, Any]]) -> bool:
    """Whether params name a kvxfer room this decode has not acted on yet."""
    try:
        return remote_prefill(params) is not None
    except BadParams:
        return room_and_prefill(params) is not None  # malformed otherwise, but not read yet
