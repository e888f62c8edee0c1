"""Model classes by `config.architectures`, imported lazily (a model's module loads only when used)."""

from __future__ import annotations

import importlib

from transformers import PretrainedConfig

from pagedrs.models.interface import CausalLM

__all__ = ["MODEL_REGISTRY", "get_model_class", "supported_architectures", "text_part"]

# architecture name -> (module under pagedrs.models, class name)
MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "Qwen3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma3_mm", "Gemma3ForConditionalGeneration"),
    "Gemma4ForCausalLM": ("gemma4", "Gemma4ForCausalLM"),
    "Gemma4ForConditionalGeneration": ("gemma4", "Gemma4ForConditionalGeneration"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen_moe", "Qwen3MoeForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "SmolLM3ForCausalLM": ("smollm3", "SmolLM3ForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "Qwen3_5ForConditionalGeneration": ("qwen3_vl", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_vl", "Qwen3_5MoeForConditionalGeneration"),
}

# config.model_type -> architecture, for configs that name no architectures (e.g. built in code)
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gemma4_text": "Gemma4ForCausalLM",
    "gemma4": "Gemma4ForConditionalGeneration",
    "gpt2": "GPT2LMHeadModel",
    "opt": "OPTForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}


# Multimodal checkpoints whose text model pagedrs runs (config.text_config): architecture -> the text model's.
# (None at present: the multimodal checkpoints pagedrs knows load with their vision towers.)
TEXT_PARTS: dict[str, str] = {}


# Multimodal checkpoints pagedrs runs with their vision tower: architecture -> the top-level config fields
# carried over onto the text config the model is built from (`text_part`).
VISION_PARTS: dict[str, tuple[str, ...]] = {
    "Gemma3ForConditionalGeneration": (
        "vision_config",
        "mm_tokens_per_image",
        "image_token_id",
        "boi_token_id",
        "eoi_token_id",
    ),
    **dict.fromkeys(
        (
            "Qwen2_5_VLForConditionalGeneration",
            "Qwen3VLForConditionalGeneration",
            "Qwen3_5ForConditionalGeneration",
            "Qwen3_5MoeForConditionalGeneration",
        ),
        ("vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"),
    ),
}


def text_part(config: PretrainedConfig) -> PretrainedConfig:
    """The config pagedrs builds a model from: for a multimodal checkpoint of `TEXT_PARTS`, its text config
    (naming the text architecture, with the checkpoint's `tie_word_embeddings`); for one of `VISION_PARTS`,
    its text config naming the multimodal architecture, with the vision fields copied onto it (every
    reader of vocab_size, layers and heads sees the text model's); else `config` itself."""
    text = getattr(config, "text_config", None)
    for arch in getattr(config, "architectures", None) or []:
        if text is None or text is config:
            break
        if arch in TEXT_PARTS or arch in VISION_PARTS:
            text.architectures = [TEXT_PARTS.get(arch, arch)]
            text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
            for name in VISION_PARTS.get(arch, ()):
                setattr(text, name, getattr(config, name))
            return text
    return config


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def get_model_class(config: PretrainedConfig) -> type[CausalLM]:
    """The class for the first of `config.architectures` pagedrs supports; ValueError listing the
    supported ones otherwise. A config naming no architectures falls back on its model_type."""
    archs = list(getattr(config, "architectures", None) or [])
    if not archs and getattr(config, "model_type", None) in MODEL_TYPES:
        archs = [MODEL_TYPES[config.model_type]]
    for arch in archs:
        if arch in MODEL_REGISTRY:
            module_name, class_name = MODEL_REGISTRY[arch]
            module = importlib.import_module(f"pagedrs.models.{module_name}")
            return getattr(module, class_name)
    raise ValueError(
        f"unsupported model architecture {archs or '(config.json names none)'}; "
        f"supported: {', '.join(supported_architectures())}"
    )
