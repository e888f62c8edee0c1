"""GPT-2: logits equal HF transformers (float32) through plain causal attention and through the paged
path (chunked prefill + decodes, batched), from safetensors and .bin; load errors name the tensor or the
architecture.

`assert_matches_hf` and `assert_load_errors` are shared by test_opt.py and test_phi3.py.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedrs.layers.attention import ForwardContext
from pagedrs.loader import load_model
from tests.helpers import BOS_ID, EOS_ID, VOCAB_SIZE, load_hf_model, make_tiny_model
from tests.models.paged_harness import PagedHarness

ATOL = 1e-4


def gpt2_config(**overrides: object) -> transformers.GPT2Config:
    kwargs: dict[str, object] = dict(
        vocab_size=VOCAB_SIZE,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=128,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    return transformers.GPT2Config(**{**kwargs, **overrides})


def random_prompts(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def _paged_logits(
    model: torch.nn.Module, seqs: Sequence[list[int]], prefill_lens: Sequence[int], chunk: int
) -> list[torch.Tensor]:
    """All requests in one batch per step: prompt i (its first prefill_lens[i] tokens) in chunks of at most
    `chunk` tokens, then its remaining tokens one decode at a time. Logits of every token, per request."""
    harness = PagedHarness(model, num_blocks=64, block_size=4)
    done = [0] * len(seqs)
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    while any(d < len(s) for d, s in zip(done, seqs, strict=True)):
        step: dict[int, list[int]] = {}
        for i, seq in enumerate(seqs):
            if done[i] < prefill_lens[i]:
                step[i] = seq[done[i] : min(done[i] + chunk, prefill_lens[i])]
            elif done[i] < len(seq):
                step[i] = seq[done[i] : done[i] + 1]
        for i, logits in harness.step(step).items():
            out[i].append(logits)
            done[i] += len(step[i])
    return [torch.cat(chunks) for chunks in out]


def assert_matches_hf(
    folder: Path, seqs: Sequence[list[int]], *, chunk: int = 5, num_decode: int = 4
) -> None:
    """pagedrs logits == HF logits for every token of every sequence, without a cache (one sequence at a
    time) and through the paged cache (the last `num_decode` tokens of each sequence as decodes)."""
    hf = load_hf_model(folder)
    model = load_model(str(folder), dtype="float32").model
    refs = []
    for seq in seqs:
        ids = torch.tensor(seq)
        with torch.no_grad():
            ref = hf(ids[None]).logits[0].float()
            plain = model.compute_logits(model(ids, torch.arange(len(seq)), ForwardContext(None, [])))
        torch.testing.assert_close(plain, ref, atol=ATOL, rtol=0)
        refs.append(ref)
    paged = _paged_logits(model, seqs, [len(s) - num_decode for s in seqs], chunk)
    for got, ref in zip(paged, refs, strict=True):
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def assert_load_errors(folder: Path, tensor: str, arch: str) -> None:
    """`folder` (safetensors): a missing tensor, a tensor of the wrong shape and an unknown architecture
    each fail in load_model with a ValueError naming it. The folder is restored afterwards."""
    path = folder / "model.safetensors"
    state = load_file(str(path))
    good = state[tensor]

    del state[tensor]
    save_file(state, str(path))
    with pytest.raises(ValueError, match=f"missing.*{tensor}"):
        load_model(str(folder), dtype="float32")

    state[tensor] = good[..., :-1].contiguous()
    save_file(state, str(path))
    with pytest.raises(ValueError, match=f"{tensor}.*shape"):
        load_model(str(folder), dtype="float32")

    state[tensor] = good
    save_file(state, str(path))
    config_path = folder / "config.json"
    original = config_path.read_text()
    config = json.loads(original)
    config["architectures"] = ["NoSuchForCausalLM"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"NoSuchForCausalLM.*{arch}"):
        load_model(str(folder), dtype="float32")
    config_path.write_text(original)
    load_model(str(folder), dtype="float32")  # restored: loads again


@pytest.mark.parametrize("weights_format", ["safetensors", "bin"])
def test_gpt2_matches_hf(tmp_path: Path, weights_format: str) -> None:
    folder = make_tiny_model(tmp_path / "gpt2", gpt2_config(), weights_format=weights_format)
    assert_matches_hf(folder, random_prompts([21, 9, 14]))


def test_gpt2_variants_match_hf(tmp_path: Path) -> None:
    """Untied LM head, an explicit n_inner, relu, and attention scaled by 1/(layer+1) (GPT-2's options)."""
    config = gpt2_config(
        tie_word_embeddings=False,
        n_inner=96,
        activation_function="relu",
        scale_attn_by_inverse_layer_idx=True,
    )
    folder = make_tiny_model(tmp_path / "gpt2-var", config)
    assert_matches_hf(folder, random_prompts([17, 8], seed=1))


def test_gpt2_loads_unprefixed_checkpoint_with_mask_buffers(tmp_path: Path) -> None:
    """openai-community/gpt2 stores "h.0.attn.c_attn.weight" (no "transformer.") plus attn.bias buffers."""
    folder = make_tiny_model(tmp_path / "gpt2-old", gpt2_config())
    path = folder / "model.safetensors"
    state = {k.removeprefix("transformer."): v for k, v in load_file(str(path)).items()}
    for i in range(2):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 128, 128))
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(state, str(path))
    assert_matches_hf(folder, random_prompts([12]), num_decode=2)


def test_gpt2_load_errors(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "gpt2", gpt2_config())
    model = load_model(str(folder), dtype="float32").model
    assert (model.num_layers, model.num_kv_heads, model.head_size) == (2, 4, 16)
    assert model.sliding_window is None and model.max_position == 128
    assert_load_errors(folder, "transformer.h.1.attn.c_attn.weight", "GPT2LMHeadModel")
