"""The vision towers of the multimodal checkpoints, in torch (CPU and CUDA): each maps the processor's
pixel_values and patch grids to one row per LLM placeholder token."""

from pagedrs.models.vision.qwen2_5 import Qwen2_5VisionTransformer
from pagedrs.models.vision.qwen3 import Qwen3VisionTransformer

__all__ = ["Qwen2_5VisionTransformer", "Qwen3VisionTransformer"]
