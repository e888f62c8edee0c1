"""LlamaForCausalLM (Llama 2/3.1, Qwen2, Mistral, SmolLM2-style tied) against HF transformers, float32."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedrs.layers.attention import ForwardContext
from pagedrs.loader import load_model
from pagedrs.models.llama import LlamaForCausalLM
from pagedrs.models.registry import MODEL_REGISTRY, get_model_class
from tests.helpers import load_hf_model, make_config, make_step_metadata, make_tiny_llama
from tests.models.paged_harness import PagedHarness

ARCHS = {
    "llama": {},
    "llama3": {},
    "qwen2": {},
    "mistral": {"sliding_window": 6},
    "smollm2": {},
}


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request, tmp_path_factory):
    arch = request.param
    path = make_tiny_llama(tmp_path_factory.mktemp(arch), arch, **ARCHS[arch])
    return arch, load_model(str(path)).model, load_hf_model(path)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_full_prompt_logits_match_hf(pair):
    arch, model, hf = pair
    ids = torch.randint(0, 320, (29,), generator=torch.Generator().manual_seed(1)).tolist()
    meta, positions = make_step_metadata([29], [29], block_size=4, num_blocks=12)
    caches = [torch.zeros(2, 12, 4, model.num_kv_heads, model.head_size) for _ in range(model.num_layers)]
    from pagedrs.layers.attention.torch_ref import TorchAttentionBackend

    ctx = ForwardContext(meta, caches, TorchAttentionBackend())
    with torch.no_grad():
        logits = model.compute_logits(model(torch.tensor(ids), positions, ctx))
        no_cache = model.compute_logits(model(torch.tensor(ids), positions, ForwardContext(None, [], None)))
    ref = hf_logits(hf, ids)
    assert logits.dtype == torch.float32 and logits.shape == (29, 320)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(no_cache, ref, atol=1e-4, rtol=1e-4)
    if arch == "mistral":
        assert model.sliding_window == 6 < len(ids)


def test_paged_chunked_prefill_and_decode_match_hf(pair):
    _, model, hf = pair
    gen = torch.Generator().manual_seed(2)
    prompts = {r: torch.randint(0, 320, (n,), generator=gen).tolist() for r, n in [(0, 19), (1, 5), (2, 11)]}
    h = PagedHarness(model, num_blocks=40, block_size=4)
    got: dict[int, list[torch.Tensor]] = {r: [] for r in prompts}
    # step 1: request 0 prefills a chunk, request 1 its whole prompt; step 2: 0 continues over its cached
    # prefix, 2 starts; then every request decodes a few tokens, in a shuffled batch order
    schedule = [
        {0: prompts[0][:8], 1: prompts[1]},
        {2: prompts[2][:6], 0: prompts[0][8:]},
        {2: prompts[2][6:]},
    ]
    for chunks in schedule:
        for r, lg in h.step(chunks).items():
            got[r].append(lg)
    seqs = {r: list(p) for r, p in prompts.items()}
    for step in range(4):
        order = [1, 0, 2] if step % 2 else [2, 1, 0]
        nxt = {r: [int(got[r][-1][-1].argmax())] for r in order}
        for r, t in nxt.items():
            seqs[r] += t
        for r, lg in h.step(nxt).items():
            got[r].append(lg)
    for r, seq in seqs.items():
        ours = torch.cat(got[r])
        torch.testing.assert_close(ours, hf_logits(hf, seq), atol=1e-4, rtol=1e-4)


def test_model_attributes(tmp_path):
    path = make_tiny_llama(tmp_path, "mistral", sliding_window=16, num_key_value_heads=1, head_dim=32)
    model = load_model(str(path)).model
    assert (model.num_layers, model.num_kv_heads, model.head_size) == (2, 1, 32)
    assert model.sliding_window == 16 and model.max_position == 1024
    qwen = LlamaForCausalLM(
        make_config("qwen2", sliding_window=8, use_sliding_window=False), dtype=torch.float32, device="cpu"
    )
    assert qwen.sliding_window is None
    assert qwen.model.layers[0].self_attn.qkv_proj.bias is not None
    assert qwen.model.layers[0].self_attn.o_proj.bias is None


def test_tied_embeddings_share_storage(tmp_path):
    model = load_model(str(make_tiny_llama(tmp_path, "smollm2"))).model
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_llama3_rope_scaling_is_applied():
    scaled = LlamaForCausalLM(make_config("llama3"), dtype=torch.float32, device="cpu")
    plain = LlamaForCausalLM(
        make_config("llama", rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
        dtype=torch.float32,
        device="cpu",
    )
    a, b = scaled.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq
    assert a[0] == b[0] and a[-1] < b[-1]  # high frequencies kept, low ones divided


def test_half_precision_forward(tmp_path):
    model = load_model(str(make_tiny_llama(tmp_path, "llama")), dtype="bfloat16").model
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = torch.arange(10)
    meta, pos = make_step_metadata([10], [10], block_size=4, num_blocks=3)
    caches = [torch.zeros(2, 3, 4, 2, 16, dtype=torch.bfloat16) for _ in range(2)]
    from pagedrs.layers.attention.torch_ref import TorchAttentionBackend

    with torch.no_grad():
        logits = model.compute_logits(model(ids, pos, ForwardContext(meta, caches, TorchAttentionBackend())))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_registry():
    assert get_model_class(make_config("llama")) is LlamaForCausalLM
    assert get_model_class(make_config("qwen2")).__name__ == "Qwen2ForCausalLM"
    for arch in ("GPT2LMHeadModel", "OPTForCausalLM", "Phi3ForCausalLM"):
        assert arch in MODEL_REGISTRY
    cfg = transformers.PretrainedConfig(architectures=["BertForMaskedLM"])
    with pytest.raises(ValueError, match="BertForMaskedLM.*supported: .*LlamaForCausalLM"):
        get_model_class(cfg)
