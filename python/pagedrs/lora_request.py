"""`LoRARequest`: which adapter a request runs with (vLLM's `LoRARequest`: name, int id, path)."""

from __future__ import annotations

import msgspec

__all__ = ["LoRARequest"]


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """An adapter for one request, as vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`.

    `lora_int_id` (>= 1) identifies the adapter in the engine: requests with the same id share its slot
    and its prefix-cache blocks; two ids never share KV blocks. `lora_path` is a PEFT adapter folder
    (`adapter_config.json` + `adapter_model.safetensors`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if (
            not isinstance(self.lora_int_id, int)
            or isinstance(self.lora_int_id, bool)
            or self.lora_int_id < 1
        ):
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def cache_salt(self) -> str:
        """The prefix-cache key of this adapter's blocks (the scheduler hashes it into every block)."""
        return f"lora:{self.lora_int_id}:{self.lora_path}"
