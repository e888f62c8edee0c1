"""Greedy runs checked against HF transformers, shared by test_greedy_equivalence.py and
test_block_table_mirror.py."""

from __future__ import annotations

from tests.engine.conftest import HFReference, greedy, run_all


def check_against_hf(outs: dict, prompts: list[list[int]], max_tokens: list[int], ref: HFReference) -> None:
    assert len(outs) == len(prompts)
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        out = outs[str(i)]
        assert out.prompt_token_ids == prompt
        expected = ref(prompt, n)
        for comp in out.outputs:
            assert comp.token_ids == expected, (
                f"request {i} (prompt {len(prompt)} tokens) sample {comp.index}"
            )
            assert comp.finish_reason == "length"


def run_batch(engine, prompts: list[list[int]], max_tokens: list[int], **kw) -> dict:
    """Add request str(i) for each prompt (greedy, max_tokens[i], `kw` to SamplingParams); run to the end."""
    for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        engine.add_request(str(i), p, greedy(n, **kw))
    return run_all(engine)
