"""Batch invariance on the CPU (`batch_invariant=True`, vLLM's VLLM_BATCH_INVARIANT): a token's arithmetic
does not depend on what else its step computes, so greedy outputs are the same whatever the batching,
chunked prefill, prefix-cache hits, preemption or speculation.

The main job's model keeps its GGUF weights quantized and quantizes activations to 8 bits per block, which
turns a last-bit difference (torch's SDPA over a whole prompt against the per-token kernel over a cached
prefix; a float GEMM over a long chunk against the integer kernels) into a different rounding step:
without the setting, a second run of the same prompts served from the prefix cache gave other greedy
answers for 11 of the 15 `bench/spec_decode.py` prompts within 128 tokens on the development machine."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedrs import LLM, SamplingParams
from pagedrs.config import DeviceConfig
from pagedrs.entrypoints.cli_args import make_engine_args, make_serve_parser
from pagedrs.layers.attention.torch_ref import TorchAttentionBackend, step_plan
from pagedrs.layers.quantized import DEQUANT_MIN_ROWS_X8, QuantizedWeight
from tests.helpers import make_step_metadata, make_tiny_gguf
from tests.layers.helpers_quant import Q, random_weight

SYSTEM = (
    "You are a careful assistant. Answer briefly and precisely, keep code in code blocks, and repeat "
    "quoted text exactly when asked to."
)
TEXTS = [
    "Repeat exactly: The library opens at nine in the morning and closes at six in the evening on weekdays.",
    "Write a short poem about the sea and the wind.",
    "def add(a, b):\n    return a + b\n\nExplain this function.",
    "List three uses of copper, one line each.",
    "Rewrite in a code block: SELECT name FROM customers WHERE id = 4 ORDER BY name;",
    "What is the capital of Italy? Answer in one sentence, then name two rivers there.",
    "Translate to French: the cat sleeps on the warm windowsill.",
    "Give two reasons to learn Rust.",
    "Summarise: Members may borrow up to eight books at a time for three weeks.",
    "Count from one to ten in words.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _prompts(llm: LLM) -> list[str]:
    tok = llm.get_tokenizer()
    return [
        tok.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": t}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for t in TEXTS
    ]


def _ids(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_default_model_greedy_ids_do_not_depend_on_the_step() -> None:
    """The default model, quantized: all prompts at once from a cold cache (one prefill step of over
    DEQUANT_MIN_ROWS_X8 rows, where the float GEMM would take over), the same again from the prefix cache,
    one at a time, in chunks of 8 tokens without prefix caching, under forced preemption and with n-gram
    speculation: the same greedy ids every time."""
    base = {"batch_invariant": True, "disable_log_stats": True, "cpu_kv_cache_gb": 0.25}
    llm = LLM(**base)
    prompts = _prompts(llm)
    tok = llm.get_tokenizer()
    assert sum(len(tok(p)["input_ids"]) for p in prompts) > DEQUANT_MIN_ROWS_X8
    cold = _ids(llm, prompts)
    assert _ids(llm, prompts) == cold  # the prompts' full blocks now come from the prefix cache
    assert llm.llm_engine.get_stats().prefix_cache_hits > 0
    assert [_ids(llm, [p])[0] for p in prompts[:4]] == cold[:4]
    chunked = LLM(**base, enable_prefix_caching=False, max_num_batched_tokens=8, max_num_seqs=3)
    assert _ids(chunked, prompts[:4]) == cold[:4]
    tight = LLM(**base, enable_prefix_caching=False, num_kv_blocks=14)
    assert _ids(tight, prompts[:6]) == cold[:6]
    assert tight.llm_engine.get_stats().num_preemptions > 0
    spec = LLM(**base, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert _ids(spec, prompts[:4]) == cold[:4]


def _attend(backend: TorchAttentionBackend, cache: torch.Tensor, qkv: list[torch.Tensor], seq: int, new: int):
    meta, _ = make_step_metadata([seq], [new], block_size=8, num_blocks=8, seed=0)  # same blocks for any seq
    q, k, v = (t[seq - new : seq] for t in qkv)
    return backend.forward(q, k, v, cache, meta, scale=0.125, sliding_window=None), meta


def test_a_prompt_attended_whole_equals_its_chunks_bit_for_bit() -> None:
    """The torch backend with batch_invariant: a 40-token prompt attended in one chunk (which otherwise goes
    through torch's SDPA) gives each token the bits it gets in chunks of 7 and 33 over the cached prefix
    (the per-token CPU kernel both times)."""
    gen = torch.Generator().manual_seed(0)
    qkv = [torch.randn(40, h, 64, generator=gen) for h in (4, 2, 2)]
    backend = TorchAttentionBackend(batch_invariant=True)
    whole, meta = _attend(backend, torch.zeros(2, 8, 8, 2, 64), qkv, 40, 40)
    plan = step_plan(meta, every_token=True)
    assert plan.prefills == [] and plan.decode_groups == []
    assert plan.cpu_decodes is not None and len(plan.cpu_decodes.seq_lens) == 40
    assert step_plan(meta).prefills == [(0, 0, 40)]  # without: one SDPA prefill
    cache = torch.zeros(2, 8, 8, 2, 64)
    first, _ = _attend(backend, cache, qkv, 7, 7)
    rest, _ = _attend(backend, cache, qkv, 40, 33)
    assert torch.equal(torch.cat([first, rest]), whole)


def test_quantized_weights_keep_the_integer_kernels_at_any_row_count() -> None:
    """From DEQUANT_MIN_ROWS_X8 rows a 4-bit weight multiplies through a float GEMM over its dequantized
    copy, which rounds a row differently than the integer kernel; `keep_integer_kernels` gives a row the
    bits it gets alone at any row count."""
    weight = QuantizedWeight([random_weight(Q.Q4_1, 64, 64, seed=3)])
    x = np.random.default_rng(1).standard_normal((weight.dequant_min_rows + 8, 64)).astype(np.float32)
    alone = np.concatenate([weight.matmul_rows(x[i : i + 1]) for i in range(0, len(x), 97)])
    assert not np.array_equal(weight.matmul_rows(x)[::97], alone)  # the GEMM's rounding
    weight.keep_integer_kernels()
    assert weight.dequant_min_rows == sys.maxsize
    assert np.array_equal(weight.matmul_rows(x)[::97], alone)


def test_batch_invariant_is_validated_and_reaches_the_engine() -> None:
    with pytest.raises(ValueError, match="batch_invariant.*CPU path"):
        DeviceConfig(device=torch.device("cuda"), batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant.*bool"):
        DeviceConfig(device=torch.device("cpu"), batch_invariant=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="PAGEDRS_CPU_KERNELS"):
        TorchAttentionBackend(use_cpu_kernels=False, batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant needs float32"):
        LLM(batch_invariant=True, dtype="bfloat16", disable_log_stats=True)
    args = make_serve_parser().parse_args(["--batch-invariant"])
    assert make_engine_args(args).batch_invariant is True
    assert make_engine_args(make_serve_parser().parse_args([])).batch_invariant is False


def test_tensor_parallel_ranks_take_the_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """batch_invariant under tensor parallelism, on a tiny GGUF model kept quantized (the path the setting
    makes exact: dense float32 matmuls may round by row count): two CPU ranks give the same greedy ids from
    a cold and from a warm cache, and one rank's ids."""
    monkeypatch.setenv("PAGEDRS_CACHE", str(tmp_path / "cache"))  # conversions here; the ranks inherit it
    path = make_tiny_gguf(tmp_path, "llama", qtype="Q8_0")
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10] * 6}, {"prompt_token_ids": [11, 12, 13]}]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = LLM(str(path), batch_invariant=True, disable_log_stats=True)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    two = LLM(str(path), batch_invariant=True, tensor_parallel_size=2, disable_log_stats=True)
    try:
        for _ in range(2):
            assert [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)] == want
    finally:
        two.llm_engine.shutdown()
