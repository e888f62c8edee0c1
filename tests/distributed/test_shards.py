"""Pieces of tensor parallelism that need no second process: the step packet round trip, lazy checkpoint
slices, and each rank reading only its shard of the weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagedrs import _core
from pagedrs.distributed import TPGroup
from pagedrs.executor.step_packet import Op, pack_step, unpack_step
from pagedrs.loader import load_model
from pagedrs.loader.safetensors import TensorSlice
from tests.helpers import make_tiny_llama, plan_fields


def test_step_packet_round_trip() -> None:
    sched = _core.Scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=6, max_model_len=64)
    sched.add_request([0], np.arange(10, dtype=np.int64), max_tokens=4)
    sched.add_request([1, 2], np.arange(3, dtype=np.int64), max_tokens=4)
    plan = sched.schedule()
    extra = np.array([3, 1], dtype=np.int64)
    header, payload = pack_step(plan, extra)
    assert header[0] == Op.EXECUTE and header[1] == payload.numel()
    step, got_extra = unpack_step(header.numpy(), payload.numpy())
    assert isinstance(step, _core.StepPlan)
    for name in plan_fields():  # every field of the plan, as the stub declares them
        got, want = getattr(step, name), getattr(plan, name)
        if isinstance(want, np.ndarray):
            assert got.dtype == want.dtype and got.shape == want.shape, name
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            assert got == want, name
    np.testing.assert_array_equal(got_extra, extra)
    with pytest.raises(ValueError, match="payload"):
        unpack_step(header.numpy(), payload.numpy()[:-1])


def test_tensor_slice_reads_only_its_rectangle(tmp_path: Path) -> None:
    full = torch.arange(6 * 10, dtype=torch.float32).reshape(6, 10)
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        s = TensorSlice.of(f.get_slice("w"))
        assert s.shape == (6, 10) and s.dim() == 2
        torch.testing.assert_close(s.narrow(1, 2, 5).materialize(), full.narrow(1, 2, 5))
        torch.testing.assert_close(s.t().narrow(0, 4, 3).materialize(), full.t().narrow(0, 4, 3))
        torch.testing.assert_close(s.narrow(0, 1, 4).t().narrow(1, 1, 2).materialize(), full[1:5].t()[:, 1:3])
        with pytest.raises(IndexError):
            s.narrow(0, 5, 2)


def test_each_rank_reads_only_its_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading rank 1 of 2 reads about half the checkpoint (norms and rotary are replicated but tiny)."""
    folder = make_tiny_llama(tmp_path, num_key_value_heads=2)
    total = 0
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            total += int(np.prod(f.get_slice(name).get_shape()))
    read: list[int] = []
    inner = TensorSlice.materialize

    def counting(self: TensorSlice) -> torch.Tensor:
        t = inner(self)
        read.append(t.numel())
        return t

    monkeypatch.setattr(TensorSlice, "materialize", counting)
    loaded = load_model(str(folder), device="cpu", tp=TPGroup(1, 2), with_tokenizer=False)
    assert 0.45 * total < sum(read) < 0.55 * total, (sum(read), total)
    attn = loaded.model.model.layers[0].self_attn
    assert attn.attn.num_heads == 2 and attn.attn.num_kv_heads == 1
    assert loaded.tokenizer is None
