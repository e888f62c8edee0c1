"""Linear layers that know how they split across tensor-parallel ranks.

- ColumnParallelLinear splits its output dim (weight dim 0): each rank computes a slice of the outputs.
- RowParallelLinear splits its input dim (weight dim 1): each rank computes a partial sum, then an
  all-reduce (torch.distributed) adds them; the bias is added once, after the reduce.
- MergedColumnParallelLinear / QKVParallelLinear are column layers whose output is several HF tensors
  stacked (gate|up, q|k|v); each rank holds its slice of every piece, so the pieces stay contiguous.
- VocabParallelEmbedding / ParallelLMHead split the vocabulary (`vocab_embedding`, exported here too).

Every parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that takes the *full* HF
tensor, cuts this rank's share and checks the shape (ValueError on a mismatch; the model adds the name).
The HF tensor may be a lazy slice of a checkpoint file (anything with `shape`, `dim()`, `narrow()`, `t()`
and `materialize()`): then only this rank's share is ever read.

Weight format: a layer holds its weight dense (`weight`, multiplied by torch) or in a format that owns the
matmul (`qweight`: GGUF blocks for the CPU kernels, GPTQ / AWQ / FP8 packed for a GPU, oneDNN's packed
float32; the dense `weight` is then an empty placeholder), chosen once, when the weight's last row is in
(`linear_form.HeldRows`), or by the prepare walk (`pagedrs.models.prepare`). `forward` is the same call
either way, so model code never branches on the format.

A layer takes its rank and size from `tp` (a `TPGroup`, whose collectives it uses), or from
`tp_rank`/`tp_size` alone (no process group: enough to load and check a shard, not to run a forward that
needs a collective).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedrs.distributed.group import TPGroup
from pagedrs.layers.linear_form import (
    HeldRows,
    Loaded,
    MatmulWeight,
    copy_checked,
    keeps_quantized,
    no_shard,
    param_with_loader,
    tp_group,
)
from pagedrs.layers.vocab_embedding import (
    ParallelLMHead,
    QuantSlot,
    ReplicatedEmbedding,
    VocabParallelEmbedding,
)
from pagedrs.quantization.gguf_blocks import GGUFWeight

__all__ = [
    "ColumnParallelLinear",
    "Loaded",
    "MatmulWeight",
    "QuantSlot",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "ReplicatedEmbedding",
    "ReplicatedLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ParallelLMHead",
    "default_weight_loader",
]


def _check_dim(loaded: Loaded, dim: int, expected: int, what: str = "") -> None:
    """The HF tensor's size along `dim` (the split dim) must be `expected`."""
    if loaded.dim() <= dim or loaded.shape[dim] != expected:
        where = f" ({what})" if what else ""
        raise ValueError(
            f"shape mismatch{where}: expected dim {dim} of {expected}, got {tuple(loaded.shape)}"
        )


def default_weight_loader(param: Tensor, loaded_weight: Loaded, shard_id: object = None) -> None:
    """Replicated parameter: the HF tensor must match exactly."""
    no_shard(shard_id, "a replicated parameter")
    copy_checked(param, loaded_weight)


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


class _LinearBase(torch.nn.Module):
    def __init__(self, tp_rank: int, tp_size: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp_group(tp, tp_rank, tp_size)
        self.tp_rank = self.tp.position  # which slice this rank holds
        self.tp_size = self.tp.size
        self.weight: Tensor
        self.bias: Tensor | None
        self.qweight: MatmulWeight | None = None
        self._rows = HeldRows()  # until every row of the weight has arrived: its form chosen then

    def forward(self, x: Tensor) -> Tensor:
        return self._matmul(x, self.bias)

    def _matmul(self, x: Tensor, bias: Tensor | None) -> Tensor:
        if self.qweight is not None:
            return self.qweight.matmul(x, bias)
        return F.linear(x, self.weight, bias)

    def _load_rows(self, param: Tensor, offset: int, loaded: Loaded, what: str = "") -> None:
        """Rows [offset, offset + len(loaded)) of this rank's weight (`param`, 2-D); once the last row is in,
        the weight's form (`linear_form.HeldRows`): a quantized format where every piece was quantized
        alike, else dense."""
        form = self._rows.add(param, offset, loaded, what)
        if form is not None:
            self.qweight = form


class ReplicatedLinear(_LinearBase):
    """The full weight on every rank."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(0, 1)
        self.input_size, self.output_size = input_size, output_size
        self.weight = param_with_loader((output_size, input_size), dtype, device, default_weight_loader)
        self.bias = param_with_loader((output_size,), dtype, device, default_weight_loader) if bias else None


class ColumnParallelLinear(_LinearBase):
    """Y = X W^T + b with W split along its output dim (dim 0); the output stays split."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp: TPGroup | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(tp_rank, tp_size, tp)
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = _divide(output_size, self.tp_size, "output size")
        n = self.output_size_per_partition
        self.weight = param_with_loader((n, input_size), dtype, device, self.weight_loader)
        self.bias = param_with_loader((n,), dtype, device, self.weight_loader) if bias else None

    def weight_loader(self, param: Tensor, loaded_weight: Loaded, shard_id: object = None) -> None:
        no_shard(shard_id, type(self).__name__)
        n = self.output_size_per_partition
        _check_dim(loaded_weight, 0, n * self.tp_size)
        if param is self.weight:
            self._load_rows(param, 0, loaded_weight.narrow(0, self.tp_rank * n, n))
        else:
            copy_checked(param, loaded_weight.narrow(0, self.tp_rank * n, n))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column layers stacked along the output dim (e.g. gate_proj | up_proj); shard_id = index."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp: TPGroup | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        tp = tp_group(tp, tp_rank, tp_size)
        self.output_sizes = list(output_sizes)
        for s in self.output_sizes:
            _divide(s, tp.size, "output size")
        super().__init__(
            input_size,
            sum(self.output_sizes),
            bias,
            tp=tp,
            dtype=dtype,
            device=device,
        )
        self.shard_ids: tuple[object, ...] = tuple(range(len(self.output_sizes)))

    def piece(self, shard_id: object) -> tuple[int, int, int, int]:
        """Where one piece's rows go on this rank: (offset in this rank's output, rows per rank, the full
        HF piece's rows, the first of its rows this rank holds). The weight loader cuts a checkpoint tensor
        with it, and LoRA the rows of a B matrix."""
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"unknown shard {shard_id!r}")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        full = self.output_sizes[shard_id]
        n = full // self.tp_size
        return offset, n, full, self.tp_rank * n

    def weight_loader(self, param: Tensor, loaded_weight: Loaded, shard_id: object = None) -> None:
        if shard_id is None:
            # A checkpoint that already stores the fused tensor (e.g. Phi-3's gate_up_proj).
            _check_dim(loaded_weight, 0, sum(self._full_sizes()))
            start = 0
            for sid, full in zip(self.shard_ids, self._full_sizes(), strict=True):
                self.weight_loader(param, loaded_weight.narrow(0, start, full), sid)
                start += full
            return
        self._load_piece(param, loaded_weight, shard_id, *self.piece(shard_id))

    def _load_piece(
        self, param: Tensor, loaded: Loaded, shard_id: object, offset: int, n: int, full: int, start: int
    ) -> None:
        """Rows [start, start + n) of the full HF piece (dim 0 of `full`) -> rows [offset, offset + n)."""
        _check_dim(loaded, 0, full, f"shard {shard_id}")
        piece = loaded.narrow(0, start, n)
        if param is self.weight:
            self._load_rows(param, offset, piece, f"shard {shard_id}")
        else:
            copy_checked(param.data.narrow(0, offset, n), piece, f"shard {shard_id}")

    def _full_sizes(self) -> list[int]:
        return self.output_sizes


class QKVParallelLinear(MergedColumnParallelLinear):
    """q_proj | k_proj | v_proj stacked; shard_id in {"q", "k", "v"}. Heads are split across ranks; when
    there are fewer KV heads than ranks, each KV head is replicated on several ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp: TPGroup | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        tp = tp_group(tp, tp_rank, tp_size)
        tp_size = tp.size
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp_size, "number of attention heads")
        if total_num_kv_heads >= tp_size:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size, "number of KV heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            if tp_size % total_num_kv_heads:
                raise ValueError(
                    f"the tensor-parallel size ({tp_size}) must be a multiple of the number of KV heads "
                    f"({total_num_kv_heads}) when it is larger (each KV head is replicated on tp/kv ranks)"
                )
            self.kv_replicas = tp_size // total_num_kv_heads
        q_size = total_num_heads * head_size
        kv_size = self.num_kv_heads * tp_size * head_size  # per-rank size x ranks (counts replicas)
        super().__init__(
            hidden_size,
            [q_size, kv_size, kv_size],
            bias,
            tp=tp,
            dtype=dtype,
            device=device,
        )
        self.shard_ids = ("q", "k", "v")
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size

    def _full_sizes(self) -> list[int]:
        kv = self.total_num_kv_heads * self.head_size
        return [self.total_num_heads * self.head_size, kv, kv]

    def piece(self, shard_id: object) -> tuple[int, int, int, int]:
        """As `MergedColumnParallelLinear.piece` for "q", "k" or "v": a KV head replicated on several ranks
        is the same rows on each."""
        if shard_id not in self.shard_ids:
            raise ValueError(f"unknown shard {shard_id!r}")
        if shard_id == "q":
            return 0, self.q_size, self.total_num_heads * self.head_size, self.tp_rank * self.q_size
        offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
        n = self.kv_size
        return offset, n, self.total_num_kv_heads * self.head_size, (self.tp_rank // self.kv_replicas) * n

    def split_qkv(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(_LinearBase):
    """Y = X W^T + b with W split along its input dim (dim 1); partial sums are all-reduced."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        reduce_results: bool = True,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp: TPGroup | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(tp_rank, tp_size, tp)
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = _divide(input_size, self.tp_size, "input size")
        self.reduce_results = reduce_results
        # Called as hook(x, partial output) on each rank before the all-reduce (tp_size > 1): what is added
        # there is summed over ranks with the products (LoRA's row-parallel deltas).
        self.partial_hooks: list[Callable[[Tensor, Tensor], None]] = []
        self.weight = param_with_loader(
            (output_size, self.input_size_per_partition), dtype, device, self.weight_loader
        )
        self.bias = param_with_loader((output_size,), dtype, device, self.weight_loader) if bias else None

    def weight_loader(self, param: Tensor, loaded_weight: Loaded, shard_id: object = None) -> None:
        no_shard(shard_id, "RowParallelLinear")
        if param.dim() == 1:  # bias: replicated, added once after the reduce
            copy_checked(param, loaded_weight)
            return
        n = self.input_size_per_partition
        _check_dim(loaded_weight, 1, n * self.tp_size)
        if isinstance(loaded_weight, GGUFWeight) and keeps_quantized(param, loaded_weight):
            block = loaded_weight.block_size
            if n % block:
                raise ValueError(
                    f"tensor parallelism over {self.tp_size} ranks gives each rank {n} of this "
                    f"{loaded_weight.type_name} weight's {n * self.tp_size} input columns, which cuts its "
                    f"{block}-weight blocks: use a tensor-parallel size that divides {n * self.tp_size // block} "
                    "blocks, or dtype='float32' to load it dequantized"
                )
        self._load_rows(param, 0, loaded_weight.narrow(1, self.tp_rank * n, n))

    def forward(self, x: Tensor) -> Tensor:
        if self.tp_size == 1:
            return self._matmul(x, self.bias)
        out = self._matmul(x, None)
        for hook in self.partial_hooks:
            hook(x, out)
        if self.reduce_results:
            self.tp.all_reduce(out)
        return out + self.bias if self.bias is not None else out
