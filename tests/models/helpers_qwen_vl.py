"""Tiny random Qwen2.5-VL and Qwen3-VL checkpoints (float32, vision depth 2, hidden 32 -> text hidden 64,
vocab 320 with the image placeholder tokens inside it), images through HF's Qwen2VLImageProcessor (its PIL
backend: no torchvision), prompts with placeholders expanded as HF's processor does, and a paged run of the
pagedrs model that feeds each step its [3, T] positions and encoder rows as the runner does."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from pagedrs.multimodal import MultiModalBatch, MultiModalItem, item_tensors, tensor_bytes
from tests.helpers import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE
from tests.models.paged_harness import PagedHarness

IMAGE_ID, START_ID, END_ID, VIDEO_ID = 260, 259, 261, 262  # the ids `vl_tokenizer` gives them
SIZES = [(56, 56), (84, 112)]  # (height, width) of the test images: 4x4 and 6x8 patches of 14


def _text(**extra: Any) -> dict[str, Any]:
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        **extra,
    )


def vl_ids() -> dict[str, Any]:
    """The image and video token ids of the tiny configs (inside the 320-token vocabulary)."""
    return dict(
        image_token_id=IMAGE_ID,
        vision_start_token_id=START_ID,
        vision_end_token_id=END_ID,
        video_token_id=VIDEO_ID,
    )


def qwen2_5_vl_config() -> transformers.Qwen2_5_VLConfig:
    """Head size 16: blocked sections [2, 3, 3]; windows of 2x2 merged tokens, full attention in block 1."""
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=64,
        patch_size=14,
        window_size=56,
        fullatt_block_indexes=[1],
        spatial_merge_size=2,
    )
    text = _text(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **vl_ids())


def qwen3_vl_config() -> transformers.Qwen3VLConfig:
    """Head size 16: interleaved sections [2, 3, 3]; DeepStack from vision blocks 0 and 1 into decoder
    layers 0 and 1; a 4x4 learned position grid resampled to each image."""
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=64,
        patch_size=14,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0, 1],
        spatial_merge_size=2,
    )
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    }
    text = _text(head_dim=16, rope_parameters=rope)
    return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **vl_ids())


def make_vl_model(path: Path, config: transformers.PretrainedConfig, seed: int = 0) -> Path:
    """A random HF model of `config` saved in `path` (weights N(0, 0.2), norms around 1)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.2 if p.dim() > 1 else 0.1)
            if "norm" in name and name.endswith("weight") or name.endswith("ln_q.weight"):
                p.add_(1.0)
    model.save_pretrained(str(path))
    return path


def images(sizes: list[tuple[int, int]] = SIZES, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.RandomState(seed)
    return [(rng.rand(h, w, 3) * 255).astype("uint8") for h, w in sizes]


def process(imgs: list[np.ndarray]) -> list[dict[str, torch.Tensor]]:
    """Per image the processor's tensors (pixel_values, image_grid_thw), as a request's item carries."""
    proc = transformers.Qwen2VLImageProcessor(
        patch_size=14, merge_size=2, min_pixels=56 * 56, max_pixels=160 * 160
    )
    return [dict(proc(images=[img], return_tensors="pt")) for img in imgs]


@dataclass
class VLPrompt:
    ids: list[int]
    items: list[MultiModalItem]
    pixel_values: torch.Tensor
    grid: torch.Tensor


def build_prompt(texts: list[list[int]], data: list[dict[str, torch.Tensor]]) -> VLPrompt:
    """texts[0] <start> image 0 <end> texts[1] ... : the placeholder expanded to one token per merged patch."""
    ids = list(texts[0])
    items = []
    for text, d in zip(texts[1:], data, strict=True):
        n = int(d["image_grid_thw"].prod()) // 4
        ids.append(START_ID)
        data_bytes = {name: tensor_bytes(t) for name, t in d.items()}
        items.append(MultiModalItem("image", f"{len(items):032x}", len(ids), n, data_bytes))
        ids += [IMAGE_ID] * n + [END_ID] + list(text)
    return VLPrompt(
        ids,
        items,
        torch.cat([d["pixel_values"] for d in data]),
        torch.cat([d["image_grid_thw"] for d in data]),
    )


def hf_logits(hf: Any, prompt: VLPrompt, extra: list[int] = ()) -> torch.Tensor:
    """HF's logits over prompt + extra tokens (the extra ones at the positions decoding gives them)."""
    ids = torch.tensor([prompt.ids + list(extra)])
    with torch.no_grad():
        out = hf(
            input_ids=ids,
            pixel_values=prompt.pixel_values,
            image_grid_thw=prompt.grid,
            mm_token_type_ids=(ids == IMAGE_ID).int(),
        )
    return out.logits[0].float()


def hf_greedy(hf: Any, text: str, imgs: list[Any], n: int) -> list[int]:
    """HF's greedy ids for `text` with each `<|image_pad|>` expanded as the processor does, and `imgs`."""
    data = process(imgs)
    pieces = text.split("<|image_pad|>")
    expanded = pieces[0]
    for d, piece in zip(data, pieces[1:], strict=True):
        expanded += "<|image_pad|>" * (int(d["image_grid_thw"].prod()) // 4) + piece
    ids = torch.tensor([vl_tokenizer()(expanded)["input_ids"]])
    with torch.inference_mode():
        out = hf.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=torch.cat([d["pixel_values"] for d in data]),
            image_grid_thw=torch.cat([d["image_grid_thw"] for d in data]),
            mm_token_type_ids=(ids == IMAGE_ID).int(),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=[],
            pad_token_id=0,
        )
    return out[0, ids.shape[1] :].tolist()


class _StepFeeder(torch.nn.Module):
    """Stands in for the runner between PagedHarness and the model: per step, each request's [3, T]
    positions (its prompt's table, then pos + delta) and the encoder rows of its scheduled placeholders."""

    def __init__(self, model: Any, reqs: dict[int, tuple[VLPrompt, list[torch.Tensor]]]) -> None:
        super().__init__()
        self.model = model
        self.num_layers, self.num_kv_heads, self.head_size = (
            model.num_layers,
            model.num_kv_heads,
            model.head_size,
        )
        self.order: list[int] = []
        self.reqs = {}
        self.prompts = {rid: prompt for rid, (prompt, _) in reqs.items()}
        for rid, (prompt, rows) in reqs.items():
            pos, delta = model.get_mrope_input_positions(prompt.ids, prompt.items, model.config)
            mask = torch.tensor(prompt.ids) == IMAGE_ID
            self.reqs[rid] = (pos, delta, mask, torch.cat(rows), torch.cumsum(mask, 0) - 1)
        self.image_rows_seen = 0
        self.item_steps: dict[tuple[int, int], int] = {}  # (request, item offset) -> steps it was fed in

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, ctx: Any) -> torch.Tensor:
        qsl = ctx.attn_metadata.query_start_loc_cpu
        all_pos, masks, embeds = [], [], []
        for i, rid in enumerate(self.order):
            p = positions[qsl[i] : qsl[i + 1]]
            table, delta, mask, rows, rank = self.reqs[rid]
            length = table.shape[1]
            inside = p < length
            clamped = p.clamp(max=length - 1)
            all_pos.append(torch.where(inside, table[:, clamped], p + delta))
            m = mask[clamped] & inside
            masks.append(m)
            embeds.append(rows[rank[clamped][m]])
            for item in self.prompts[rid].items:
                if bool(((p >= item.offset) & (p < item.offset + item.length)).any()):
                    key = (rid, item.offset)
                    self.item_steps[key] = self.item_steps.get(key, 0) + 1
        mm = MultiModalBatch(embeds=torch.cat(embeds), mask=torch.cat(masks))
        self.image_rows_seen += int(mm.mask.sum())
        return self.model(ids, torch.cat(all_pos, dim=1), ctx, mm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


def paged_logits(
    model: Any, reqs: dict[int, tuple[VLPrompt, list[int]]], chunk: int
) -> tuple[dict[int, torch.Tensor], _StepFeeder]:
    """Each request's prompt prefilled in chunks of `chunk` tokens (all requests in each step), then its
    extra tokens one decode at a time; logits of every token per request."""
    with torch.no_grad():
        feeder = _StepFeeder(
            model,
            {
                rid: (p, model.embed_multimodal([item_tensors(i) for i in p.items]))
                for rid, (p, _) in reqs.items()
            },
        )
    harness = PagedHarness(feeder, num_blocks=96, block_size=4)
    seqs = {rid: p.ids + list(extra) for rid, (p, extra) in reqs.items()}
    done = dict.fromkeys(reqs, 0)
    out: dict[int, list[torch.Tensor]] = {rid: [] for rid in reqs}
    while any(done[r] < len(s) for r, s in seqs.items()):
        step = {}
        for rid, seq in seqs.items():
            n = chunk if done[rid] < len(reqs[rid][0].ids) else 1
            n = min(n, len(reqs[rid][0].ids) - done[rid]) if done[rid] < len(reqs[rid][0].ids) else n
            if done[rid] < len(seq):
                step[rid] = seq[done[rid] : done[rid] + n]
        feeder.order = list(step)
        for rid, logits in harness.step(step).items():
            out[rid].append(logits)
            done[rid] += len(step[rid])
    return {rid: torch.cat(v) for rid, v in out.items()}, feeder


def vl_tokenizer() -> Any:
    """The byte-level test tokenizer with Qwen's vision tokens (ids 259-262, as the tiny configs name)."""
    from tests.helpers import make_tokenizer

    tok = make_tokenizer()
    tok.add_tokens(
        ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"], special_tokens=True
    )
    assert tok.convert_tokens_to_ids("<|image_pad|>") == IMAGE_ID
    return tok


def vl_processor(model_cls: Any, hf_config: Any) -> Any:
    """pagedrs's MultiModalProcessor over HF's Qwen2VLImageProcessor and the test tokenizer, expanding
    each `<|image_pad|>` to one token per merged patch as HF's Qwen2_5_VLProcessor does (that class needs
    torchvision for its video processor, so it is not built here)."""
    from types import SimpleNamespace

    from pagedrs.multimodal.processing import MultiModalProcessor

    def replace_image_token(inputs: dict[str, torch.Tensor], i: int) -> str:
        return "<|image_pad|>" * (int(inputs["image_grid_thw"][i].prod()) // 4)

    image_processor = transformers.Qwen2VLImageProcessor(
        patch_size=14, merge_size=2, min_pixels=56 * 56, max_pixels=160 * 160
    )
    proc = SimpleNamespace(
        image_processor=image_processor,
        tokenizer=vl_tokenizer(),
        image_token="<|image_pad|>",
        replace_image_token=replace_image_token,
    )
    return MultiModalProcessor(proc, IMAGE_ID, model_cls=model_cls, hf_config=hf_config)
