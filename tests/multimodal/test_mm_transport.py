"""The multimodal contract without a model: items survive the msgspec channel byte for byte, the
scheduler's ids key the prefix cache by image, the runner's encoder cache slices an item split by a
chunk, counts hits and runs and stays bounded, and the scheduler never ends a chunk inside an atomic span."""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from pagedrs import _core
from pagedrs.engine.core.messages import EngineCoreRequest, input_decoder
from pagedrs.multimodal import MultiModalItem, item_tensors, scheduler_token_ids, tensor_bytes
from pagedrs.multimodal.encoder_cache import EncoderCache
from pagedrs.multimodal.mrope import mrope_table, step_mrope_positions
from pagedrs.sampling_params import SamplingParams


def _item(key: str, offset: int, length: int) -> MultiModalItem:
    pix = torch.arange(6, dtype=torch.float32).reshape(1, 2, 3) + len(key)
    grid = torch.tensor([[1, 2, 3]], dtype=torch.int64)
    return MultiModalItem(
        "image", key, offset, length, {"pixel_values": tensor_bytes(pix), "grid": tensor_bytes(grid)}
    )


def test_items_cross_the_channel() -> None:
    item = _item("ab" * 16, 3, 4)
    req = EngineCoreRequest("r", [1, 2, 3, 9, 9, 9, 9], SamplingParams(), 4, 0.0, mm_items=[item])
    back = input_decoder().decode(msgspec.msgpack.encode(req))
    assert isinstance(back, EngineCoreRequest)
    t = item_tensors(back.mm_items[0])
    torch.testing.assert_close(t["pixel_values"], torch.arange(6, dtype=torch.float32).reshape(1, 2, 3) + 32)
    assert t["grid"].dtype == torch.int64 and t["grid"].tolist() == [[1, 2, 3]]


def test_scheduler_ids_key_by_image() -> None:
    prompt = [5, 6, 7, 100, 100, 100, 100, 8]
    a = scheduler_token_ids(prompt, [MultiModalItem("image", "aa" * 16, 3, 4)], 320)
    a2 = scheduler_token_ids(prompt, [MultiModalItem("image", "aa" * 16, 3, 4)], 320)
    b = scheduler_token_ids(prompt, [MultiModalItem("image", "bb" * 16, 3, 4)], 320)
    assert a == a2 and a != b
    assert a[:3] == b[:3] == [5, 6, 7] and a[7] == b[7] == 8
    assert all(0 <= t < 320 for t in a + b)
    assert prompt == [5, 6, 7, 100, 100, 100, 100, 8]  # the real ids are left as they are


def test_encoder_cache_slices_counts_and_bounds() -> None:
    calls: list[int] = []

    def embed(items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        calls.append(len(items))
        return [
            torch.arange(4 * 2, dtype=torch.float32).reshape(4, 2) + it["pixel_values"][0, 0, 0]
            for it in items
        ]

    cache = EncoderCache(cache_tokens=8)
    x, y = _item("x", 2, 4), _item("yy", 1, 4)
    cache.add([10], [x])
    cache.add([11, 12], [y])
    # seq 10 computes [0, 4): rows 2..3 of its prompt are x's rows 0..1; seq 11 computes [3, 5): y rows 2..3
    qsl = np.array([0, 4, 6])
    step = cache.step(
        np.array([10, 11]),
        np.array([0, 3]),
        np.array([4, 2]),
        qsl,
        np.array([0, 1, 2, 3, 3, 4]),
        embed,
        torch.device("cpu"),
        bidirectional=True,
    )
    assert step is not None and calls == [2] and (cache.runs, cache.hits, cache.split_slices) == (2, 0, 2)
    assert step.batch.mask.tolist() == [False, False, True, True, True, True]
    ex = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    torch.testing.assert_close(step.batch.embeds, torch.cat([ex[0:2] + 1, ex[2:4] + 2]))
    assert step.key_limits is not None and step.key_limits.tolist() == [1, 2, 6, 6, 5, 5]
    assert step.key_limit_reqs == [0, 1]
    # the rest of x in a later step: a hit, no encoder call
    step = cache.step(
        np.array([10]),
        np.array([4]),
        np.array([3]),
        np.array([0, 3]),
        np.array([4, 5, 6]),
        embed,
        torch.device("cpu"),
        bidirectional=False,
    )
    assert step is not None and calls == [2] and cache.hits == 1 and step.key_limits is None
    assert step.batch.mask.tolist() == [True, True, False]
    # a third image evicts the least recently used (the bound is 8 rows)
    cache.add([13], [_item("zzz", 0, 4)])
    cache.step(
        np.array([13]),
        np.array([0]),
        np.array([4]),
        np.array([0, 4]),
        np.arange(4),
        embed,
        torch.device("cpu"),
        bidirectional=False,
    )
    assert cache.num_rows <= 8 and "yy" not in cache.outputs and "x" in cache.outputs
    cache.drop([10, 11, 12, 13])
    assert (
        cache.step(
            np.array([10]),
            np.array([0]),
            np.array([4]),
            np.array([0, 4]),
            np.arange(4),
            embed,
            torch.device("cpu"),
            bidirectional=False,
        )
        is None
    )


def test_scheduler_never_ends_a_chunk_inside_a_span() -> None:
    s = _core.Scheduler(
        num_blocks=64, block_size=4, max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64
    )
    s.add_request([1], np.arange(20, dtype=np.int64), max_tokens=2)
    s.set_atomic_spans(1, [(6, 10)])
    plan = s.schedule()
    assert plan.num_scheduled_tokens.tolist() == [6]  # [0, 8) would end inside [6, 10)
    s.update(plan, np.zeros(len(plan.logits_indices), dtype=np.int64))
    plan = s.schedule()
    assert plan.num_scheduled_tokens.tolist() == [8]  # [6, 14) takes the span whole


def test_mrope_step_positions() -> None:
    """Prompt rows from the request's table, later rows p + delta in all three; a request without a table
    takes p in all three."""
    table = mrope_table([0, 1, 1, 1, 3] + [0, 1, 1, 2, 3] + [0, 1, 2, 1, 3], delta=-1)
    # seq 5 (table, prompt of 5) computes positions 3..6; seq 6 (no table) decodes position 9
    pos = np.array([3, 4, 5, 6, 9])
    out = step_mrope_positions(pos, np.array([0, 4, 5]), np.array([5, 6]), {5: table})
    assert out.tolist() == [[1, 3, 4, 5, 9], [2, 3, 4, 5, 9], [1, 3, 4, 5, 9]]
