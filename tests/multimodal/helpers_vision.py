"""Tiny random Gemma 3 vision checkpoints built locally (config, weights, byte-level tokenizer with Gemma 3's
image tokens, image processor and processor config), and images of several sizes."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from tests.helpers import make_tokenizer
from tests.models.helpers_families import gemma3_config

__all__ = ["CHAT_TEMPLATE", "IMAGE_TOKENS", "data_url", "make_gemma3_vision", "random_image"]

IMAGE_TOKENS = 4  # mm_tokens_per_image of the tiny checkpoints
# The processor's chat template: text parts as they are, an image part as Gemma 3's image token.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<start_of_image>{% else %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def random_image(height: int, width: int, seed: int) -> object:
    from PIL import Image

    rs = np.random.RandomState(seed)
    return Image.fromarray((rs.rand(height, width, 3) * 255).astype("uint8"))


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    tok = make_tokenizer()
    tok.add_tokens(["<start_of_image>", "<image_soft_token>", "<end_of_image>"], special_tokens=True)
    tok._set_model_specific_special_tokens(
        special_tokens={
            "boi_token": "<start_of_image>",
            "image_token": "<image_soft_token>",
            "eoi_token": "<end_of_image>",
        }
    )
    return tok


def make_gemma3_vision(path: Path, *, seed: int = 0) -> Path:
    """A Gemma3ForConditionalGeneration folder: the tiny Gemma 3 text model (sliding and global layers),
    a one-layer SigLIP tower over 32x32 images in 8x8 patches, pooled to 4 tokens an image; weights drawn
    as `make_tiny_model` draws them (varied logits), saved with its processor."""
    path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer()
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        vision_use_head=False,
    )
    config = transformers.Gemma3Config(
        text_config=gemma3_config().to_dict(),
        vision_config=vision,
        mm_tokens_per_image=IMAGE_TOKENS,
        image_token_id=tok.image_token_id,
        boi_token_id=tok.boi_token_id,
        eoi_token_id=tok.eoi_token_id,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.2 if p.dim() > 1 else 0.1)
            if "norm" in name and name.endswith("weight"):
                p.add_(1.0)
    model.eval().save_pretrained(str(path))
    image_processor = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor = transformers.Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tok,
        image_seq_length=IMAGE_TOKENS,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(path))
    return path


def data_url(image: Any) -> str:
    """A PNG data URL of a PIL image."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
