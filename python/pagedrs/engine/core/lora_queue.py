"""LoRA requests beside the step: the adapter check at submit, the slot a request takes when it joins the
scheduler, the requests parked (outside the scheduler) while every slot is busy, and the per-step row
mapping. The slots themselves are the `LoRAManager`'s.

INVARIANT: a parked request holds no slot and no scheduler state; it joins, in arrival order, once its
adapter finds a slot (`take_parked` hands them all back to be tried again each step).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pagedrs import _core
from pagedrs.engine.core.messages import EngineCoreRequest
from pagedrs.lora.manager import LoRAManager
from pagedrs.lora_request import LoRARequest

__all__ = ["LoRAQueue"]


class LoRAQueue:
    def __init__(self, manager: LoRAManager | None) -> None:
        self.manager = manager  # None: the engine runs without LoRA
        self._parked: list[tuple[EngineCoreRequest, Any]] = []  # (request, its compiled grammar)

    def check(self, req: EngineCoreRequest) -> None:
        """ValueError (nothing queued yet) for an adapter the engine cannot run: LoRA off, a bad folder, a
        rank above max_lora_rank. Loads the adapter onto the host."""
        if req.lora_request is None:
            return
        self._need_manager("lora_request needs an engine started with enable_lora=True").add_adapter(
            req.lora_request
        )

    def activate(self, req: EngineCoreRequest, compiled: Any, seq_ids: list[int]) -> bool:
        """Give the request's sequences its adapter's slot; False (the request is parked) when every slot
        holds an adapter that live requests use. True for a base-model request."""
        lora = req.lora_request
        if lora is None:
            return True
        if self._need_manager("lora_request needs an engine started with enable_lora=True").try_activate(
            req.request_id, lora, seq_ids
        ):
            return True
        self._parked.append((req, compiled))
        return False

    def take_parked(self) -> list[tuple[EngineCoreRequest, Any]]:
        """Every parked request (removed from the queue), in arrival order, to try `activate` again."""
        parked, self._parked = self._parked, []
        return parked

    def drop(self, request_ids: Iterable[str]) -> None:
        """Parked requests among `request_ids` leave the queue (an abort)."""
        if self._parked:
            gone = set(request_ids)
            self._parked = [(r, c) for r, c in self._parked if r.request_id not in gone]

    def release(self, request_id: str) -> None:
        """The request left the scheduler: its adapter's slot may be reused once no one else uses it."""
        if self.manager is not None:
            self.manager.release(request_id)

    def prepare(self, plan: _core.StepPlan) -> None:
        """Which token rows of this step take which adapter's deltas."""
        if self.manager is not None:
            self.manager.prepare(plan)

    def __contains__(self, request_id: str) -> bool:
        return any(r.request_id == request_id for r, _ in self._parked)

    def __len__(self) -> int:
        return len(self._parked)

    # ---- the core's utility calls (vLLM's add_lora / remove_lora / list_loras) -------------------------
    def add_lora(self, name: str, lora_int_id: int, path: str) -> None:
        self._need_manager().add_adapter(LoRARequest(name, int(lora_int_id), path))

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._need_manager().remove_adapter(int(lora_int_id))

    def list_loras(self) -> list[tuple[str, int, str]]:
        if self.manager is None:
            return []
        return [(r.lora_name, r.lora_int_id, r.lora_path) for r in self.manager.list_adapters()]

    def _need_manager(
        self, message: str = "LoRA adapters need an engine started with enable_lora=True"
    ) -> LoRAManager:
        if self.manager is None:
            raise ValueError(message)
        return self.manager
