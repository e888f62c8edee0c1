"""Multi-LoRA serving: PEFT adapter folders (`adapter`), the deltas added to the base model's linear
layers (`layers`) and the resident adapter slots (`manager`). The per-request `LoRARequest` lives in
`pagedrs.lora_request`, beside the sampling and pooling params."""

from pagedrs.lora_request import LoRARequest

__all__ = ["LoRARequest"]
