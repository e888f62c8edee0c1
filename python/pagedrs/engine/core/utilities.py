"""The engine core's utility methods: what a frontend may call between steps through `UtilityCall` (stats,
pool resize, prefix-cache reset, liquid moves, LoRA adapters, ping), each by name through `call_utility`.
`CoreUtilitiesMixin` is a part of `EngineCore` (`engine_core.py`), which sets every attribute declared
here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagedrs import _core
from pagedrs.config import EngineConfig
from pagedrs.engine.core.lora_queue import LoRAQueue
from pagedrs.executor.liquid.control import LiquidControl
from pagedrs.metrics import EngineStats

__all__ = ["CoreUtilitiesMixin"]


class CoreUtilitiesMixin:
    """`EngineCore`'s utility methods."""

    # Methods a frontend may call through `UtilityCall` (name -> bound method is looked up here only).
    UTILITY_METHODS = frozenset(
        {
            "get_stats",
            "resize",
            "reset_prefix_cache",
            "ping",
            "liquid",
            "liquid_degree",
            "add_lora",
            "remove_lora",
            "list_loras",
            "cached_block_hashes",
        }
    )

    scheduler: _core.Scheduler
    _kv_block_bytes: int  # one block's bytes on one rank (the host tier's unit of transfer)
    config: EngineConfig
    liquid_control: LiquidControl | None
    _loras: LoRAQueue
    _prompt_tokens_total: int
    _generation_tokens_total: int
    _num_steps: int
    _last_step_time: float
    _last_batch: int
    _waiting_prompt_tokens: Callable[[], int]
    _kv_pool_names: list[str]  # `kv_pool_names`: the labels of `kv_pool_usage`

    def kv_pool_names(self, has_full_layers: bool) -> list[str]:
        """The label of each KV pool that stores some layer's KV, in the order of `kv_pool_usage`: `full`,
        the full-attention pool (unless every layer is windowed: then it is bookkeeping), then every
        KV-cache group's name (`window:W`)."""
        return (["full"] if has_full_layers else []) + [g[0] for g in self.scheduler.kv_group_pools()]

    def kv_pool_usage(self, s: Any) -> dict[str, float]:
        """Each KV pool's usage (0..1) of scheduler stats `s`, by its label (`kv_pool_names`)."""
        full = 1.0 - s.num_free_blocks / s.num_blocks if s.num_blocks else 0.0
        usage = ([full] if self._kv_pool_names[:1] == ["full"] else []) + list(s.group_kv_usage)
        return dict(zip(self._kv_pool_names, (float(u) for u in usage), strict=True))

    def get_stats(self) -> EngineStats:
        s = self.scheduler.stats()
        return EngineStats(
            num_running=int(s.num_running),
            num_waiting=int(s.num_waiting),
            num_swapped=int(s.num_swapped),
            kv_usage=float(s.kv_usage),
            prefix_cache_queries=int(s.prefix_cache_queries),
            prefix_cache_hits=int(s.prefix_cache_hits),
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            num_preemptions=int(s.num_preemptions),
            num_blocks=int(s.num_blocks),
            num_free_blocks=int(s.num_free_blocks),
            num_swap_blocks=s.num_swap_blocks,
            num_free_swap_blocks=s.num_free_swap_blocks,
            num_steps=self._num_steps,
            step_time_s=self._last_step_time,
            batch_size=self._last_batch,
            spec_num_drafts=int(s.spec_num_drafts),
            spec_num_draft_tokens=int(s.spec_num_draft_tokens),
            spec_num_accepted_tokens=int(s.spec_num_accepted_tokens),
            spec_num_pauses=int(s.spec_num_pauses),
            kv_group_usage=self.kv_pool_usage(s),
            **tier_stats(s, self.config.cache.block_size, self._kv_block_bytes),
        )

    def resize(self, num_blocks: int) -> int:
        """Resize the KV pool (the next step's plan moves and truncates blocks); returns the new count."""
        self.scheduler.resize(int(num_blocks))
        return int(self.scheduler.num_blocks)

    def liquid_degree(self) -> int:
        """Active ranks under liquid scaling (1 without it)."""
        return self.liquid_control.degree if self.liquid_control is not None else 1

    def liquid(self, target: int) -> list[dict[str, Any]]:
        """Move to `target` active ranks between steps (`LiquidControl.move`); one record per event."""
        if self.liquid_control is None:
            raise ValueError("liquid scaling needs an engine started with liquid_gpu_range=[...]")
        return self.liquid_control.move(target)

    def idle_tick(self) -> None:
        """Nothing to run: the liquid policy still sees the (idle) cache usage."""
        if self.liquid_control is not None:
            self.liquid_control.tick(self._waiting_prompt_tokens())

    def reset_prefix_cache(self) -> bool:
        return bool(self.scheduler.reset_prefix_cache())

    def cached_block_hashes(self) -> list[int]:
        """The hashes of the blocks in the prefix cache now, sorted: what the KV events add up to."""
        return self.scheduler.cached_block_hashes()

    def add_lora(self, name: str, lora_int_id: int, path: str) -> bool:
        """Load an adapter onto the host now (vLLM's `add_lora`); ValueError for a bad adapter."""
        self._loras.add_lora(name, lora_int_id, path)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter (False if unknown); ValueError while requests use it."""
        return self._loras.remove_lora(lora_int_id)

    def list_loras(self) -> list[tuple[str, int, str]]:
        """(name, id, path) of every adapter loaded on the host."""
        return self._loras.list_loras()

    def ping(self) -> str:
        return "pong"

    def call_utility(self, method: str, args: Sequence[Any]) -> Any:
        if method not in self.UTILITY_METHODS:
            raise ValueError(f"unknown utility method {method!r}; one of {sorted(self.UTILITY_METHODS)}")
        return getattr(self, method)(*args)


def tier_stats(s: _core.SchedulerStats, block_size: int, block_bytes: int) -> dict[str, int]:
    """The host KV tier's `EngineStats` fields from the scheduler's block counts."""
    return {
        "kv_offload_blocks": int(s.num_tier_blocks),
        "kv_offload_used_blocks": int(s.num_used_tier_blocks),
        "external_prefix_cache_queries": int(s.tier_queried_blocks) * block_size,
        "external_prefix_cache_hits": int(s.tier_hit_blocks) * block_size,
        "kv_offload_bytes_stored": int(s.tier_stored_blocks) * block_bytes,
        "kv_offload_bytes_loaded": int(s.tier_loaded_blocks) * block_bytes,
        "kv_offload_evicted_blocks": int(s.tier_evicted_blocks),
    }
