"""SamplingParams: vLLM's defaults, normalisation, and a ValueError naming field and value for each bad one."""

from __future__ import annotations

import pytest

from pagedrs import SamplingParams
from pagedrs.sampling_params import SamplingType


def test_defaults_follow_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs, p.seed) == (16, 0, None, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert (p.ignore_eos, p.skip_special_tokens, p.spaces_between_special_tokens) == (False, True, True)
    assert p.include_stop_str_in_output is False
    assert p.sampling_type == SamplingType.RANDOM


def test_normalisation() -> None:
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=5, min_p=0.2)
    assert p.sampling_type == SamplingType.GREEDY
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)  # cannot change an argmax
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=1e-3).temperature == pytest.approx(1e-2)
    assert SamplingParams(stop=["ab", "c"]).output_text_buffer_length == 1
    assert SamplingParams(stop=["ab"], include_stop_str_in_output=True).output_text_buffer_length == 0


def test_child_params_get_distinct_seeds() -> None:
    p = SamplingParams(n=3, seed=10, temperature=1.0)
    kids = [p.child(i) for i in range(3)]
    assert [k.seed for k in kids] == [10, 11, 12]
    assert all(k.n == 1 for k in kids)
    assert p.n == 3 and p.seed == 10


BAD = [
    ("n", 0),
    ("n", 1.5),
    ("best_of", 3),
    ("presence_penalty", 2.5),
    ("presence_penalty", "x"),
    ("frequency_penalty", -2.1),
    ("repetition_penalty", 0.0),
    ("temperature", -0.1),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.1),
    ("top_k", -2),
    ("top_k", 1.5),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("seed", 1.5),
    ("stop", [""]),
    ("stop", [1]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["a"]),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("min_tokens", -1),
    ("logprobs", -1),
    ("prompt_logprobs", -3),
    ("ignore_eos", "yes"),
    ("skip_special_tokens", None),
    ("logit_bias", {"a": 1.0}),
]


@pytest.mark.parametrize(("field", "value"), BAD)
def test_invalid_field_raises_value_error_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    msg = str(e.value)
    assert field in msg
    assert repr(value) in msg or str(value) in msg


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match=r"min_tokens .*max_tokens \(4\).*got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
