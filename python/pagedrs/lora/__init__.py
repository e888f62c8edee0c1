"""Multi-LoRA serving: PEFT adapter folders (`adapter`), the per-request `LoRARequest` (`request`), the
deltas added to the base model's linear layers (`layers`) and the resident adapter slots (`manager`)."""

from pagedrs.lora.request import LoRARequest

__all__ = ["LoRARequest"]
