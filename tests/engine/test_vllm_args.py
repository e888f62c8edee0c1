"""vLLM's engine arguments as the seeds pass them: each is accepted and works, or is refused at start with
what to use instead; the continuous-batching notebook's engine cell runs as written with `vllm` replaced by `pagedrs`."""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path

import pytest

from pagedrs import LLM, EngineArgs, LLMEngine, SamplingParams
from pagedrs.engine.arg_utils import default_swap_space
from pagedrs.entrypoints.cli import make_parser
from pagedrs.entrypoints.cli_args import make_engine_args
from tests.helpers import SEED_003_SERVER_FLAGS, make_tiny_llama
from tests.helpers_vllm_logs import (
    CASTING,
    CHUNKED_PREFILL,
    CONFIG_LINE,
    KV_CACHE_SIZE,
    MAX_CONCURRENCY,
    as_int,
    notebook_batches,
)

SEED_ARGS = (
    "tokenizer skip_tokenizer_init tokenizer_mode revision tokenizer_revision trust_remote_code dtype "
    "max_seq_len max_model_len download_dir load_format tensor_parallel_size pipeline_parallel_size "
    "disable_custom_all_reduce quantization enforce_eager kv_cache_dtype rope_scaling rope_theta seed "
    "served_model_name enable_prefix_caching enable_chunked_prefill disable_sliding_window disable_log_stats "
    "enable_log_batch_visualization max_num_batched_tokens max_num_seqs gpu_memory_utilization swap_space"
).split()
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CPU = dict(device="cpu", dtype="float32", disable_log_stats=True)


def test_every_seed_argument_is_an_engine_argument() -> None:
    fields = set(EngineArgs.field_names())
    assert not [a for a in SEED_ARGS if a not in fields]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"pipeline_parallel_size": 2}, ["pipeline_parallel_size=2", "tensor_parallel_size"]),
        ({"quantization": "bitsandbytes"}, ["quantization='bitsandbytes'", "gptq"]),
        ({"kv_cache_dtype": "int8"}, ["kv_cache_dtype", "'int8'", "fp8_e4m3"]),
        ({"tokenizer_mode": "mistral"}, ["tokenizer_mode='mistral'", "'slow'"]),
        ({"load_format": "bitsandbytes"}, ["load_format='bitsandbytes'", "dummy"]),
        ({"model": "/tmp", "revision": "v2"}, ["revision='v2'", "local path"]),
        ({"max_seq_len": 64, "max_model_len": 128}, ["max_seq_len=64", "max_model_len=128"]),
    ],
)
def test_unsupported_arguments_say_what_to_use(kwargs: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        EngineArgs(**kwargs).early_configs()
    for w in words:
        assert w in str(info.value)


def test_cli_takes_the_seed_flags() -> None:
    args = make_parser().parse_args(
        [
            "serve",
            *SEED_003_SERVER_FLAGS,
            "--skip-tokenizer-init",
            "--load-format",
            "dummy",
            "--rope-theta",
            "5000",
            "--rope-scaling",
            '{"rope_type": "linear", "factor": 2.0}',
            "--trust-remote-code",
        ]
    )
    ea = make_engine_args(args)
    assert ea.disable_sliding_window and ea.enable_log_batch_visualization and ea.skip_tokenizer_init
    assert ea.max_num_batched_tokens == 12 and ea.dtype == "half" and ea.load_format == "dummy"
    assert ea.rope_theta == 5000.0 and ea.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_disable_sliding_window_caps_the_context(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path, arch="mistral", sliding_window=12)
    llm = LLM(str(folder), disable_sliding_window=True, **CPU)
    assert llm.llm_engine.max_model_len == 12
    assert llm.llm_engine.runner.model.sliding_window is None
    windowed = LLM(str(folder), **CPU)
    short = [[1, 2, 3]]  # 3 + 8 tokens: inside the window, so both attend to the same keys
    a = llm.generate([{"prompt_token_ids": p} for p in short], GREEDY, use_tqdm=False)
    b = windowed.generate([{"prompt_token_ids": p} for p in short], GREEDY, use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="12"):
        llm.generate([{"prompt_token_ids": list(range(1, 14))}], GREEDY, use_tqdm=False)


def test_rope_theta_and_scaling_override_the_config(tmp_path: Path) -> None:
    base = make_tiny_llama(tmp_path, subdir="base")
    theta = make_tiny_llama(
        tmp_path, subdir="theta", rope_parameters={"rope_type": "default", "rope_theta": 500.0}
    )
    scaled = make_tiny_llama(
        tmp_path,
        subdir="scaled",
        rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    )
    prompt = [{"prompt_token_ids": list(range(5, 45))}]

    def ids(folder: Path, **kw: object) -> list[int]:
        return list(
            LLM(str(folder), **CPU, **kw).generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        )

    assert ids(base, rope_theta=500.0) == ids(theta)
    assert ids(base, rope_scaling={"type": "linear", "factor": 4.0}) == ids(scaled)
    assert ids(base) != ids(theta) or ids(base) != ids(scaled)


def test_load_format(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path)
    os.remove(folder / "model.safetensors")  # a config and a tokenizer, no weights
    with pytest.raises(ValueError, match="has no weights"):
        LLM(str(folder), **CPU)
    llm = LLM(str(folder), load_format="dummy", **CPU)
    out = llm.generate(["dummy weights"], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match="load_format='safetensors'"):
        LLM(str(folder), load_format="safetensors", **CPU)
    with pytest.raises(ValueError, match="load_format='gguf'"):
        LLM(str(folder), load_format="gguf", **CPU)


def test_skip_tokenizer_init(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path)
    with_tok = LLM(str(folder), **CPU).generate([{"prompt_token_ids": [3, 4, 5]}], GREEDY, use_tqdm=False)
    llm = LLM(str(folder), skip_tokenizer_init=True, **CPU)
    assert llm.get_tokenizer() is None
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == with_tok[0].outputs[0].token_ids
    assert out[0].outputs[0].text == ""
    with pytest.raises(ValueError, match="token ids"):
        llm.generate(["text needs a tokenizer"], GREEDY, use_tqdm=False)


def test_served_model_name_and_startup_lines(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = make_tiny_llama(tmp_path)
    with caplog.at_level(logging.INFO, logger="pagedrs"):
        llm = LLM(str(folder), served_model_name="my-model", swap_space=0.001, **CPU)
    assert llm.llm_engine.model_name == "my-model"
    text = caplog.text
    # vLLM 0.4's config line with the resolved values (the model path, torch's dtype, the context length
    # in force, the device), then the weights, the blocks and the cache size lines of later versions.
    m = CONFIG_LINE.search(text)
    assert m is not None, text
    assert (m["model"], m["dtype"], m["max_seq_len"], m["device"]) == (
        str(folder),
        "torch.float32",
        "1024",
        "cpu",
    )
    assert "served_model_name=my-model" in text and "swap_space=0.001" in text
    assert text.index("Initializing an LLM engine") < text.index("Loading model weights took")
    assert "# CPU blocks:" in text and "# swap blocks:" in text
    stats = llm.llm_engine.get_stats()
    size, most = KV_CACHE_SIZE.search(text), MAX_CONCURRENCY.search(text)
    assert size is not None and as_int(size["tokens"]) == stats.num_blocks * 16
    assert most is not None and as_int(most["len"]) == 1024  # the tiny model's context
    assert most["x"] == f"{stats.num_blocks * 16 / 1024:.2f}"
    chunked = CHUNKED_PREFILL.search(text)
    assert chunked is not None and chunked["n"] == "2048"
    assert not CASTING.search(text)  # a float32 checkpoint run in float32


def test_cast_line_and_swap_default(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A bfloat16 checkpoint run with dtype="half" logs vLLM's "Casting torch.bfloat16 to torch.float16."
    warning; no swap_space: vLLM 0.4's 4 GiB per GPU on CUDA, none on a CPU device (vLLM's CPU backend has
    no swap)."""
    import json

    folder = make_tiny_llama(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.INFO, logger="pagedrs"):
        llm = LLM(
            str(folder), device="cpu", dtype="half", disable_log_stats=True, enable_chunked_prefill=False
        )
    try:
        assert [r.levelname for r in caplog.records if CASTING.search(r.getMessage())] == ["WARNING"]
        m = CONFIG_LINE.search(caplog.text)
        assert m is not None and m["dtype"] == "torch.float16"
        assert not CHUNKED_PREFILL.search(caplog.text)  # only when it is on
        assert "# swap blocks: 0" in caplog.text and llm.llm_engine.get_stats().num_swap_blocks == 0
    finally:
        llm.shutdown()
    assert default_swap_space("cuda") == 4.0 and default_swap_space("cpu") == 0.0
    assert EngineArgs(device="cpu").early_configs()[1].swap_space == 0.0
    assert EngineArgs(device="cpu", swap_space=0.5).early_configs()[1].swap_space == 0.5


def test_shutdown_frees_the_engine(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path)
    llm = LLM(str(folder), **CPU)
    llm.generate(["x"], GREEDY, use_tqdm=False)
    llm.shutdown()
    runner = llm.llm_engine.model_executor.runner
    assert runner.kv_pool is None and not hasattr(runner, "model")  # no reference left to either
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(["x"], GREEDY, use_tqdm=False)


def test_seed_003_engine_cell(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The continuous-batching notebook's cell with `vllm` -> `pagedrs` (the default model instead of Phi-3, which is not on this
    machine): requests join one per step, each prints its text so far, then the notebook's cleanup lines.
    The log, written as the server writes it, holds one picture per step that the notebook's own parser
    reads as a batch."""
    from pagedrs.utils import random_uuid

    log_path = tmp_path / "engine.log"
    handler = logging.FileHandler(log_path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
    logging.getLogger("pagedrs").addHandler(handler)
    with caplog.at_level(logging.INFO, logger="pagedrs"):
        engine = LLMEngine.from_engine_args(
            EngineArgs(
                dtype="half",
                max_num_batched_tokens=9,
                max_num_seqs=8,
                disable_sliding_window=True,
                enable_chunked_prefill=True,
                disable_log_stats=True,
                enable_log_batch_visualization=True,
            )
        )
        prompts = [
            "Hello my name is",
            "The president's",
            "water boils at",
            "The capital of France",
            "Cats really like",
            "The sun rises",
            "Humans are a",
            "The largest planet is",
            "Snow is very very",
            "Birds use their",
            "Fish swim in",
        ]
        sampling_params = SamplingParams(temperature=0, top_p=0.95, max_tokens=4)
        all_requests = []
        for prompt in prompts:
            all_requests.append((random_uuid(), prompt, sampling_params))
        final: dict[str, object] = {}
        steps = 0
        while True:
            if all_requests:
                req_id, prompt, sp = all_requests.pop(0)
                engine.add_request(req_id, prompt, sp)
            outputs = engine.step()
            steps += 1
            for output in outputs:
                print(f"{output.prompt}: {output.outputs[0].text}")
                final[output.prompt] = output.outputs[0]
            if not engine.has_unfinished_requests():
                break
    assert sorted(final) == sorted(prompts)
    for out in final.values():
        n, reason = len(out.token_ids), out.finish_reason  # type: ignore[attr-defined]
        assert out.text and (n == 4 and reason == "length" or 1 <= n <= 4 and reason == "stop")  # type: ignore[attr-defined]
    logging.getLogger("pagedrs").removeHandler(handler)
    handler.close()
    assert steps >= len(prompts)  # one request joined per step, as the seed shows
    batches = notebook_batches(log_path)
    assert len(batches) == steps  # one picture per step (vLLM's enable_log_batch_visualization)
    header = " ".join(f"Batch {i}" for i in range(1, 9))  # max_num_seqs=8 columns
    assert all(" ".join(b.split("\n")[0].split()) == header for b in batches), batches[0]
    assert "│ Hello" in batches[0] and "│ The" not in batches[0]  # step 1: the first prompt alone
    # continuous batching: a request joining while others decode gives a row of boxes side by side
    assert max(line.count("┌") for b in batches for line in b.split("\n")) >= 3

    from pagedrs.distributed.parallel_state import destroy_model_parallel

    destroy_model_parallel()
    del engine.model_executor.driver_worker
    del engine
    gc.collect()


def test_output_repr_as_seed_000_prints_it() -> None:
    from pagedrs import CompletionOutput

    out = CompletionOutput(0, "\n\nHi.", [13, 13, 2], None, None, "stop")
    assert repr(out) == (
        "CompletionOutput(index=0, text='\\n\\nHi.', token_ids=[13, 13, 2], cumulative_logprob=None, "
        "logprobs=None, finish_reason=stop, stop_reason=None)"
    )


def test_token_box_visualization(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """batch_visualization_style="boxes": the notebook's picture, one column per batch slot, each token of
    each running request in a box."""
    folder = make_tiny_llama(tmp_path)
    llm = LLM(
        str(folder),
        enable_log_batch_visualization=True,
        batch_visualization_style="boxes",
        max_num_seqs=3,
        **CPU,
    )
    with caplog.at_level(logging.INFO, logger="pagedrs"):
        llm.generate(
            ["ab", "xyz"], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False
        )
    pictures = [r.getMessage() for r in caplog.records if "Batch 1" in r.getMessage()]
    assert pictures, caplog.text
    first = pictures[0]
    assert " Batch 1         Batch 2         Batch 3" in first
    assert "│ a            ││ x            │" in first  # row 0: the first token of each request
    assert "│ b            ││ y            │" in first
    with pytest.raises(ValueError, match="batch_visualization_style"):
        EngineArgs(batch_visualization_style="table").early_configs()


def test_seed_000_program(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM 0.4's Llama-2 run with `vllm` -> `pagedrs`: `LLM(...)` with every argument its config line shows (the
    default model, float32 on the CPU instead of Llama-2-13b in float16), a long document to summarize
    (prefilled in chunks), then that run's prints: the token count and `[CompletionOutput(...)]`, whose
    cumulative_logprob is filled although no logprobs were asked for."""
    import re

    doc = " ".join(
        f"In round {i} a proposer sends prepare({i}) to a majority of acceptors; each promises to ignore "
        f"lower numbers and reports the highest proposal it accepted, so at most one value is chosen."
        for i in range(30)
    )
    prompt = f"Summarize this paper in a few sentences.\n\n{doc}\n\nSummary:"
    with caplog.at_level(logging.INFO, logger="pagedrs"):
        llm = LLM(
            model=None,
            tokenizer=None,
            tokenizer_mode="auto",
            revision=None,
            tokenizer_revision=None,
            trust_remote_code=False,
            dtype="float32",
            max_model_len=2048,
            download_dir=None,
            load_format="auto",
            tensor_parallel_size=1,
            disable_custom_all_reduce=False,
            quantization=None,
            enforce_eager=True,
            kv_cache_dtype="auto",
            seed=0,
            device="cpu",
            max_num_batched_tokens=256,
        )
    try:
        for line in (
            "Initializing an LLM engine",
            "enforce_eager=True",
            "seed=0",
            "Loading model weights took",
        ):
            assert line in caplog.text, line
        assert re.search(r"# CPU blocks: \d+", caplog.text)
        outputs = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
        out = outputs[0].outputs[0]
        n_prompt = len(outputs[0].prompt_token_ids)
        assert n_prompt > 512  # several 256-token prefill chunks
        printed = f"OUTPUT: ({len(out.token_ids)} tokens)\n\n{out.text}\n\n{outputs[0].outputs}"
        assert printed.startswith(f"OUTPUT: ({len(out.token_ids)} tokens)") and 0 < len(out.token_ids) <= 40
        m = re.search(
            r"cumulative_logprob=(-?[0-9.e-]+), logprobs=None, finish_reason=(stop|length)", printed
        )
        assert m is not None, printed[-300:]
        assert f"[CompletionOutput(index=0, text={out.text!r}, token_ids={out.token_ids}, " in printed
        # the same number as the sum of the sampled tokens' logprobs of the same request with logprobs=0
        again = llm.generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=40, logprobs=0), use_tqdm=False
        )
        lp = again[0].outputs[0]
        assert lp.token_ids == out.token_ids and lp.logprobs is not None
        by_hand = sum(e[t].logprob for e, t in zip(lp.logprobs, lp.token_ids, strict=True))
        assert float(m.group(1)) < 0 and abs(float(m.group(1)) - by_hand) < 1e-3
    finally:
        llm.shutdown()
