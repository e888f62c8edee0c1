"""A gpt-oss checkpoint with MXFP4 experts (OpenAI's layout, written from a tiny random model) loaded on
the CPU with dtype "auto" keeps its experts 4-bit: ggml MXFP4 blocks on the stacked experts kernel, whose
values equal the dequantize-at-load run's weights exactly (dtype float32, the path CUDA takes too).

Tolerance against that run: the kernel quantizes the activations to 8 bits per block of 32 before each
projection (as for every GGUF type), so logits are within 5% of the largest (the dense quantized path's
bound, as tests/models/test_moe_gguf.py) at every position whose experts both runs chose alike; a position
where a later layer's router had a near-tie (k-th and next logit within 0.02) may pick another expert and
is only required to be that near-tie. Greedy ids through the engine, under chunked prefill and
preemption, are equal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedrs.engine.llm_engine import LLMEngine
from pagedrs.layers.moe import GgufCpuExperts
from pagedrs.loader import load_model
from pagedrs.quantization.mxfp4 import GGML_MXFP4
from tests.engine.conftest import PlanSpy, greedy, make_engine, run_all
from tests.engine.conftest import random_prompts as engine_prompts
from tests.helpers import logits_of
from tests.models.helpers_gpt_oss import make_tiny_gpt_oss, write_mxfp4_pair


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    tiny = make_tiny_gpt_oss(root / "model")
    write_mxfp4_pair(tiny, root / "mxfp4", root / "dequantized")
    return root / "mxfp4"


def test_experts_kept_mxfp4_match_the_dequantized_run(mxfp4: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kept, dense = load_model(str(mxfp4)), load_model(str(mxfp4), dtype="float32")
    assert kept.quantization == dense.quantization == "mxfp4"
    cfg = kept.hf_config
    for layer, ref in zip(kept.model.model.layers, dense.model.model.layers, strict=True):
        ex, dx = layer.mlp.experts, ref.mlp.experts
        for w, d in ((ex.gate_up, dx.gate_up), (ex.down, dx.down)):
            assert w.qweight is not None and w.qweight.ggml_type == GGML_MXFP4
            assert w.weight.numel() == 0 and d.qweight is None
            assert w.qweight.nbytes == w.num_experts * w.rows * w.cols // 32 * 17  # 4.25 bits a weight
            assert torch.equal(w.dense(), d.weight)  # gate rows then up rows, as the float path
    assert kept.model.model.layers[0].mlp.experts.gate_up.rows == 2 * cfg.intermediate_size

    import pagedrs.layers.moe.method as method_mod

    assert all(isinstance(layer.mlp.experts.method, GgufCpuExperts) for layer in kept.model.model.layers)

    def no_fallback(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the MXFP4 experts left the Rust kernel")

    k = cfg.num_experts_per_tok
    for ids in ([7, 8, 9, 10, 120, 3, 55, 201, 17, 4, 90, 33], [5, 6, 7]):
        with monkeypatch.context() as m:
            m.setattr(method_mod, "fused_experts_torch", no_fallback)
            lq, rq = _logits_and_router(kept, ids)
        ld, rd = _logits_and_router(dense, ids)
        same = torch.ones(len(ids), dtype=torch.bool)
        for q, d in zip(rq, rd, strict=True):
            chosen = q.topk(k, -1).indices.sort(-1).values
            alike = (chosen == d.topk(k, -1).indices.sort(-1).values).all(-1)
            top = q.topk(k + 1, -1).values
            assert (top[~alike, k - 1] - top[~alike, k] < 0.02).all()  # only near-ties choose differently
            same &= alike
        assert same.sum() >= len(ids) - 1
        assert (lq - ld)[same].abs().max() <= 0.05 * ld.abs().max()
        assert not torch.equal(lq, ld)  # the 8-bit activations show: the kernel ran, not float32
        assert torch.equal(lq[same].argmax(-1), ld[same].argmax(-1))


def _logits_and_router(loaded: object, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The logits and every layer's router logits [T, E] of one prefill."""
    router: list[torch.Tensor] = []
    layers = loaded.model.model.layers  # type: ignore[attr-defined]
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out: router.append(out)) for layer in layers]
    try:
        logits = logits_of(loaded, ids)
    finally:
        for h in hooks:
            h.remove()
    return logits, [r[0] if isinstance(r, tuple) else r for r in router]


def test_engine_greedy_ids_equal_the_dequantized_run(mxfp4: Path) -> None:
    prompts = engine_prompts([18, 11, 15], seed=1)

    def ids(engine: LLMEngine) -> list[list[int]]:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, greedy(8))
        outs = run_all(engine)
        return [list(outs[str(i)].outputs[0].token_ids) for i in range(len(prompts))]

    small = dict(block_size=4, num_kv_blocks=10, max_num_batched_tokens=8, enable_prefix_caching=False)
    kept = make_engine(mxfp4, dtype="auto", **small)
    spy = PlanSpy().attach(kept)
    got = ids(kept)
    assert spy.chunked_prefills > 0 and spy.preemptions > 0
    assert kept.model is not None and kept.model.model.layers[0].mlp.experts.down.qweight is not None
    assert got == ids(make_engine(mxfp4, dtype="float32", **small))
