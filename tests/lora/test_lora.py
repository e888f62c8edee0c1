"""LoRA adapters through the whole engine: greedy outputs equal HF transformers + PEFT token for token
(tiny float32 Llama / Qwen2 / Mistral, GPT-2, OPT, Phi-3), a batch mixing adapters and the base model equals each run alone,
adapters wait for a slot when `max_loras` are busy, and the prefix cache never shares KV across adapters."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pagedrs import LoRARequest, SamplingParams
from pagedrs.engine.llm_engine import EngineArgs, LLMEngine
from pagedrs.entrypoints.llm import LLM
from pagedrs.outputs import RequestOutput
from tests.helpers import make_tiny_llama, make_tiny_model
from tests.lora.helpers_lora import ATTN_MLP, PeftReference, make_peft_adapter
from tests.models.helpers_configs import gpt2_config, opt_config, phi3_config
from tests.models.helpers_families import gemma2_config, qwen3_config

ARCHS = ("llama", "qwen2", "mistral")
MAX_TOKENS = 10


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _engine(base: Path, **kw: object) -> LLMEngine:
    args = dict(device="cpu", disable_log_stats=True, num_kv_blocks=256, enable_lora=True)
    args.update(kw)
    return LLMEngine.from_engine_args(EngineArgs(model=str(base), **args))  # type: ignore[arg-type]


def _run(engine: LLMEngine) -> dict[str, RequestOutput]:
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert isinstance(out, RequestOutput)
                final[out.request_id] = out
    return final


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-base")
    return {arch: make_tiny_llama(root, arch=arch, seed=i) for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="module")
def llama_adapters(bases: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three adapters of the tiny Llama: every projection; rsLoRA with per-module ranks and alphas on the
    packed q|k|v and gate|up layers; q and v only (the other slices of qkv_proj stay the base's)."""
    root = tmp_path_factory.mktemp("lora-adapters")
    base = bases["llama"]
    return [
        make_peft_adapter(base, root / "all", seed=1, r=8),
        make_peft_adapter(
            base,
            root / "rs",
            seed=2,
            r=4,
            lora_alpha=8,
            use_rslora=True,
            rank_pattern={"k_proj": 2, "layers.1.mlp.up_proj": 6},
            alpha_pattern={"v_proj": 3},
        ),
        make_peft_adapter(base, root / "qv", seed=3, r=8, target_modules=("q_proj", "v_proj")),
    ]


@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_matches_peft(arch: str, bases: dict[str, Path], tmp_path: Path) -> None:
    adapter = make_peft_adapter(bases[arch], tmp_path / "a", seed=7)
    prompts = [_prompt(5, 1), _prompt(37, 2)]
    ref = PeftReference(bases[arch], adapter)
    merged = PeftReference(bases[arch], adapter, merged=True)
    base_ref = PeftReference(bases[arch], None)
    llm = LLM(str(bases[arch]), device="cpu", disable_log_stats=True, num_kv_blocks=128, enable_lora=True)
    lora = LoRARequest("a", 1, str(adapter))
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False, lora_request=lora
    )
    for p, out in zip(prompts, outs, strict=True):
        expected = ref(p, MAX_TOKENS)
        assert out.outputs[0].token_ids == expected
        assert out.outputs[0].token_ids == merged(p, MAX_TOKENS)  # the adapter merged into the weights
        assert expected != base_ref(p, MAX_TOKENS)  # the adapter changes the output: the test can fail


# The other architectures' projections, as PEFT names them: GPT-2's fused c_attn (Conv1D), OPT's
# separate q/k/v and fc1/fc2, Phi-3's fused qkv_proj and gate_up_proj, Qwen3's and Gemma 2's q/k/v (the
# q/k norms and soft caps after them) and gate/up/down.
OTHER_ARCHS = {
    "gpt2": (
        lambda d: make_tiny_model(d / "gpt2", gpt2_config(vocab_size=259)),
        ("c_attn", "c_proj", "c_fc"),
    ),
    "opt": (
        lambda d: make_tiny_model(d / "opt", opt_config()),
        ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
    ),
    "phi3": (
        lambda d: make_tiny_model(d / "phi3", phi3_config()),
        ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    ),
    "qwen3": (lambda d: make_tiny_model(d / "qwen3", qwen3_config()), ATTN_MLP),
    "gemma2": (lambda d: make_tiny_model(d / "gemma2", gemma2_config()), ATTN_MLP),
}


@pytest.mark.parametrize("arch", list(OTHER_ARCHS))
def test_adapter_matches_peft_on_other_architectures(arch: str, tmp_path: Path) -> None:
    make, targets = OTHER_ARCHS[arch]
    base = make(tmp_path)
    adapter = make_peft_adapter(base, tmp_path / "a", seed=7, target_modules=targets)
    prompts = [_prompt(6, 3), _prompt(29, 4)]
    ref = PeftReference(base, adapter)
    merged = PeftReference(base, adapter, merged=True)
    base_ref = PeftReference(base, None)
    llm = LLM(str(base), device="cpu", disable_log_stats=True, num_kv_blocks=128, enable_lora=True)
    lora = LoRARequest("a", 1, str(adapter))
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False, lora_request=lora
    )
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)
    for p, out, without in zip(prompts, outs, plain, strict=True):
        expected = ref(p, MAX_TOKENS)
        assert out.outputs[0].token_ids == expected == merged(p, MAX_TOKENS)
        assert without.outputs[0].token_ids == base_ref(p, MAX_TOKENS) != expected


def test_rslora_patterns_and_partial_targets_match_peft(
    bases: dict[str, Path], llama_adapters: list[Path]
) -> None:
    base = bases["llama"]
    prompt = _prompt(21, 3)
    llm = LLM(
        str(base), device="cpu", disable_log_stats=True, num_kv_blocks=128, enable_lora=True, max_loras=2
    )
    for i, adapter in enumerate(llama_adapters[1:], start=2):
        out = llm.generate(
            [{"prompt_token_ids": prompt}],
            _greedy(),
            use_tqdm=False,
            lora_request=LoRARequest(adapter.name, i, str(adapter)),
        )
        assert out[0].outputs[0].token_ids == PeftReference(base, adapter)(prompt, MAX_TOKENS)


def test_mixed_batch_equals_each_alone(bases: dict[str, Path], llama_adapters: list[Path]) -> None:
    """Three adapters and the base model in the same steps (prefills and decodes mixed); each request's
    tokens are those of its adapter alone."""
    base = bases["llama"]
    engine = _engine(base, max_loras=3)
    loras: list[LoRARequest | None] = [
        LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(llama_adapters)
    ] + [None]
    prompts = [_prompt(n, 10 + n) for n in (3, 30, 17, 9, 12, 40)]
    which = [0, 1, 2, 3, 0, 2]  # adapter index per prompt (3 = the base model)
    for i, (p, w) in enumerate(zip(prompts, which, strict=True)):
        engine.add_request(str(i), {"prompt_token_ids": p}, _greedy(), lora_request=loras[w])
    engine.step()
    manager = engine.engine_core.lora
    assert manager is not None
    rows = manager.batch.slot_of_row
    assert rows is not None  # one step held rows of all three adapters and the base's
    assert sorted(set(rows.tolist())) == [-1, 0, 1, 2]
    outs = _run(engine)
    refs = [PeftReference(base, p) for p in llama_adapters] + [PeftReference(base, None)]
    for i, (p, w) in enumerate(zip(prompts, which, strict=True)):
        assert outs[str(i)].outputs[0].token_ids == refs[w](p, MAX_TOKENS), f"request {i} (adapter {w})"


def test_requests_wait_for_a_free_slot(bases: dict[str, Path], llama_adapters: list[Path]) -> None:
    """max_loras=1 and two adapters: the second adapter's request waits until the first's finishes (its
    slot is then reused), and both are right."""
    base = bases["llama"]
    engine = _engine(base, max_loras=1)
    prompt = _prompt(11, 5)
    for i, p in enumerate(llama_adapters[:2]):
        engine.add_request(
            str(i), {"prompt_token_ids": prompt}, _greedy(), lora_request=LoRARequest(p.name, i + 1, str(p))
        )
    engine.step()
    stats = engine.get_stats()
    assert engine.engine_core.get_num_unfinished_requests() == 2
    assert (stats.num_running, stats.num_waiting) == (1, 0)  # the second waits outside the scheduler
    outs = _run(engine)
    for i, p in enumerate(llama_adapters[:2]):
        assert outs[str(i)].outputs[0].token_ids == PeftReference(base, p)(prompt, MAX_TOKENS)


def test_prefix_cache_is_keyed_by_adapter(bases: dict[str, Path], llama_adapters: list[Path]) -> None:
    """The same 3-block prompt under adapter 1, then adapter 2, then the base, then adapter 1 again: only
    the last reuses cached blocks, and adapter 2's output is its own (not computed over adapter 1's KV)."""
    base = bases["llama"]
    llm = LLM(
        str(base), device="cpu", disable_log_stats=True, num_kv_blocks=128, enable_lora=True, max_loras=2
    )
    prompt = {"prompt_token_ids": _prompt(50, 9)}
    a1 = LoRARequest("all", 1, str(llama_adapters[0]))
    a2 = LoRARequest("rs", 2, str(llama_adapters[1]))
    runs = [
        llm.generate(prompt, _greedy(), use_tqdm=False, lora_request=lora)[0] for lora in (a1, a2, None, a1)
    ]
    assert [r.num_cached_tokens for r in runs] == [0, 0, 0, 48]
    assert runs[1].outputs[0].token_ids == PeftReference(base, llama_adapters[1])(
        prompt["prompt_token_ids"], MAX_TOKENS
    )
    assert runs[3].outputs[0].token_ids == runs[0].outputs[0].token_ids


def test_rank_above_max_lora_rank_is_a_value_error(
    bases: dict[str, Path], llama_adapters: list[Path]
) -> None:
    llm = LLM(
        str(bases["llama"]),
        device="cpu",
        disable_log_stats=True,
        num_kv_blocks=64,
        enable_lora=True,
        max_lora_rank=4,
    )
    with pytest.raises(ValueError, match=r"rank 8 .*max_lora_rank \(4\)"):
        llm.generate(
            "hi", _greedy(), use_tqdm=False, lora_request=LoRARequest("all", 1, str(llama_adapters[0]))
        )
    assert not llm.llm_engine.has_unfinished_requests()


def test_lora_request_needs_enable_lora(bases: dict[str, Path], llama_adapters: list[Path]) -> None:
    llm = LLM(str(bases["llama"]), device="cpu", disable_log_stats=True, num_kv_blocks=64)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate(
            "hi", _greedy(), use_tqdm=False, lora_request=LoRARequest("all", 1, str(llama_adapters[0]))
        )


def test_add_list_remove_adapters(bases: dict[str, Path], llama_adapters: list[Path]) -> None:
    engine = _engine(bases["llama"], max_loras=1)
    core = engine.engine_core
    assert core.add_lora("all", 1, str(llama_adapters[0]))
    assert core.list_loras() == [("all", 1, str(llama_adapters[0]))]
    with pytest.raises(ValueError, match="already loaded"):
        core.add_lora("other", 1, str(llama_adapters[1]))
    assert core.remove_lora(1) and not core.remove_lora(1)
    assert core.list_loras() == []
