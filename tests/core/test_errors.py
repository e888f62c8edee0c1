"""Error classes and argument checks of pagedrs._core: the offending value is in the message."""

import numpy as np
import pytest

from pagedrs._core import (
    InvalidRequestError,
    OutOfBlocksError,
    PagedrsError,
    ResizeError,
    Scheduler,
    UnknownRequestError,
    kernel_names,
    kernel_source,
)


def test_hierarchy() -> None:
    assert issubclass(InvalidRequestError, PagedrsError) and issubclass(InvalidRequestError, ValueError)
    assert issubclass(ResizeError, PagedrsError) and issubclass(ResizeError, ValueError)
    assert issubclass(UnknownRequestError, PagedrsError) and issubclass(UnknownRequestError, KeyError)
    assert issubclass(OutOfBlocksError, PagedrsError) and not issubclass(OutOfBlocksError, ValueError)
    assert issubclass(PagedrsError, Exception)
    assert InvalidRequestError.__module__ == "pagedrs._core"


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": -3}, "-3"),
        ({"num_blocks": 8, "block_size": 0}, "block_size"),
        ({"num_blocks": 8, "block_size": -16}, "-16"),
        ({"num_blocks": 8, "block_size": 12}, "12"),
        ({"num_blocks": 8, "max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"num_blocks": 8, "max_num_seqs": -1}, "-1"),
        ({"num_blocks": 8, "max_model_len": 0}, "max_model_len"),
        ({"num_blocks": 8, "num_swap_blocks": -2}, "-2"),
        ({"num_blocks": 8, "watermark": 1.0}, "1"),
        ({"num_blocks": 8, "watermark": -0.1}, "-0.1"),
        ({"num_blocks": 8, "vocab_size": 0}, "vocab_size"),
    ],
)
def test_bad_constructor_args(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=None) as e:
        Scheduler(**kwargs)
    assert isinstance(e.value, PagedrsError)
    assert needle in str(e.value)


def test_constructor_defaults_and_properties() -> None:
    s = Scheduler(num_blocks=10)
    assert (s.block_size, s.num_blocks, s.max_model_len) == (16, 10, 2048)
    with pytest.raises(TypeError):
        Scheduler(10)  # type: ignore[misc]


def test_bad_token_ids_name_the_value() -> None:
    s = Scheduler(num_blocks=8, block_size=4, vocab_size=100)
    with pytest.raises(InvalidRequestError, match="-5"):
        s.add_request([1], [3, -5], max_tokens=2)
    with pytest.raises(InvalidRequestError, match="100"):
        s.add_request([1], np.array([1, 100]), max_tokens=2)
    with pytest.raises(InvalidRequestError, match="-7"):
        s.add_request([1], [1], max_tokens=2, eos_token_ids=[-7])
    with pytest.raises(InvalidRequestError, match="str"):
        s.add_request([1], "hello", max_tokens=2)  # type: ignore[arg-type]
    s2 = Scheduler(num_blocks=8)
    with pytest.raises(InvalidRequestError, match=str(1 << 40)):
        s2.add_request([1], [1 << 40], max_tokens=2)
    assert not s.has_unfinished() and not s2.has_unfinished()


def test_request_rejections_name_both_numbers() -> None:
    s = Scheduler(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="empty"):
        s.add_request([1], [], max_tokens=2)
    with pytest.raises(InvalidRequestError) as e:
        s.add_request([1], list(range(1, 64)), max_tokens=2)  # 63 + 1 = 64 fits max_model_len ...
    assert "16" in str(e.value) and "4" in str(e.value)  # ... but needs 16 blocks of a 4-block pool
    with pytest.raises(InvalidRequestError) as e:
        s.add_request([1], list(range(1, 65)), max_tokens=2)
    assert "65" in str(e.value) and "64" in str(e.value)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        s.add_request([1], [1], max_tokens=0)
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        s.add_request([1], [1], max_tokens=2, min_tokens=3)
    with pytest.raises(InvalidRequestError, match="empty"):
        s.add_request([], [1], max_tokens=2)
    assert not s.has_unfinished()


def test_duplicate_and_unknown_ids() -> None:
    s = Scheduler(num_blocks=8, block_size=4)
    s.add_request([7], [1, 2], max_tokens=2)
    with pytest.raises(InvalidRequestError, match="7"):
        s.add_request([7], [1, 2], max_tokens=2)
    with pytest.raises(InvalidRequestError, match="9"):
        s.add_request([9, 9], [1, 2], max_tokens=2)
    with pytest.raises(UnknownRequestError, match="123"):
        s.num_cached_tokens(123)
    with pytest.raises(KeyError):
        s.num_cached_tokens(123)
    s.abort([123, 456])  # unknown ids are ignored
    assert s.num_unfinished() == 1


def test_update_checks_plan_and_lengths() -> None:
    s = Scheduler(num_blocks=8, block_size=4)
    s.add_request([1], [1, 2, 3], max_tokens=3)
    p = s.schedule()
    with pytest.raises(PagedrsError, match="update"):
        s.schedule()
    with pytest.raises(InvalidRequestError) as e:
        s.update(p, np.array([1, 2], dtype=np.int64))
    assert "2" in str(e.value) and "1" in str(e.value)
    with pytest.raises(InvalidRequestError, match="-4"):
        s.update(p, np.array([-4], dtype=np.int64))
    assert s.update(p, [5]) == []  # a list works too
    with pytest.raises(InvalidRequestError, match=str(p.step_id)):
        s.update(p, [5])  # already applied


def test_resize_errors() -> None:
    s = Scheduler(num_blocks=8, block_size=4)
    with pytest.raises(ResizeError, match="0"):
        s.resize(0)
    with pytest.raises(ResizeError, match="-1"):
        s.resize(-1)
    s.add_request([1], list(range(1, 13)), max_tokens=4)
    p = s.schedule()
    s.update(p, [1])
    with pytest.raises(ResizeError) as e:
        s.resize(2)  # 3 blocks in use
    assert "2 blocks" in str(e.value) and "3 blocks" in str(e.value)
    assert isinstance(e.value, ValueError)
    s.check_invariants()


def test_kernel_sources() -> None:
    assert set(kernel_names()) >= {"cache_kernels", "paged_attention"}
    assert isinstance(kernel_source("paged_attention"), str)
    with pytest.raises(ValueError, match="nope"):
        kernel_source("nope")
