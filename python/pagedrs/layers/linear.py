"""Linear layers that know how they split across tensor-parallel ranks.

- ColumnParallelLinear splits its output dim (weight dim 0): each rank computes a slice of the outputs.
- RowParallelLinear splits its input dim (weight dim 1): each rank computes a partial sum, then an
  all-reduce (torch.distributed) adds them; the bias is added once, after the reduce.
- MergedColumnParallelLinear / QKVParallelLinear are column layers whose output is several HF tensors
  stacked (gate|up, q|k|v); each rank holds its slice of every piece, so the pieces stay contiguous.
- VocabParallelEmbedding / ParallelLMHead split the vocabulary.

Every parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that takes the *full* HF
tensor, cuts this rank's share and checks the shape (ValueError on a mismatch; the model adds the name).
The HF tensor may be a lazy slice of a checkpoint file (anything with `shape`, `dim()`, `narrow()`, `t()`
and `materialize()`): then only this rank's share is ever read.

Weight format: a layer holds its weight dense (`weight`, multiplied by torch) or, when the checkpoint hands
it GGUF-quantized pieces of types the CPU kernels take (`GGUFWeight`), as a `QuantizedWeight`, or GPTQ /
AWQ / FP8 pieces kept packed for a GPU (`PackedInt`, `Fp8`), as a `DevicePackedWeight`, or (a dense float32
weight on a CPU, once the engine has loaded it) packed for oneDNN's matmul, as a `PackedDense`; each owns
the matmul (`qweight`; the dense `weight` is then an empty placeholder). `forward` is the same call either
way, so model code never branches on the format.

A layer takes its rank and size from `tp` (a `TPGroup`, whose collectives it uses), or from
`tp_rank`/`tp_size` alone (no process group: enough to load and check a shard, not to run a forward that
needs a collective).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedrs.distributed.group import TPGroup
from pagedrs.layers.packed import DevicePackedWeight, PackedPiece
from pagedrs.layers.quantized import QuantizedWeight
from pagedrs.quantization.gguf_blocks import GGUFWeight
from pagedrs.quantization.packed_parts import Fp8, PackedInt

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


# What a weight loader takes: a tensor, a lazy checkpoint slice, a GGUF-quantized tensor, or a GPTQ/AWQ/FP8
# layer kept packed for the GPU.
Loaded = Tensor | GGUFWeight | PackedInt | Fp8


class MatmulWeight(Protocol):
    """A weight held in a format that owns `x @ W^T` (`QuantizedWeight`, `DevicePackedWeight`, oneDNN's
    `PackedDense`)."""

    def matmul(self, x: Tensor, bias: Tensor | None = None) -> Tensor: ...


def _materialize(loaded: Loaded) -> Tensor:
    """A lazy checkpoint slice is read here, once it is cut to this rank's share (a GGUF-quantized one is
    dequantized)."""
    if isinstance(loaded, (GGUFWeight, PackedInt, Fp8)):
        return loaded.materialize()
    read = getattr(loaded, "materialize", None)
    return read() if read is not None else loaded


def _copy_checked(param: Tensor, loaded: Loaded, what: str = "") -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        where = f" ({what})" if what else ""
        raise ValueError(f"shape mismatch{where}: expected {tuple(param.shape)}, got {tuple(loaded.shape)}")
    param.data.copy_(_materialize(loaded))


def _check_dim(loaded: Loaded, dim: int, expected: int, what: str = "") -> None:
    """The HF tensor's size along `dim` (the split dim) must be `expected`."""
    if loaded.dim() <= dim or loaded.shape[dim] != expected:
        where = f" ({what})" if what else ""
        raise ValueError(
            f"shape mismatch{where}: expected dim {dim} of {expected}, got {tuple(loaded.shape)}"
        )


def _no_shard(shard_id: object, owner: str) -> None:
    if shard_id is not None:
        raise ValueError(f"unexpected shard {shard_id!r} for {owner}")


def default_weight_loader(param: Tensor, loaded_weight: Loaded, shard_id: object = None) -> None:
    """Replicated parameter: the HF tensor must match exactly."""
    _no_shard(shard_id, "a replicated parameter")
    _copy_checked(param, loaded_weight)


def _param(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str, loader: Callable) -> Tensor:
    p = torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]  # our attribute on a torch Parameter
    return p


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


def _group(tp: TPGroup | None, tp_rank: int, tp_size: int) -> TPGroup:
    if tp is not None:
        return tp
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
    return TPGroup(tp_rank, tp_size)


def _keeps_quantized(param: Tensor, loaded: Loaded) -> bool:
    """A float32 CPU weight keeps a GGUF piece of a type the kernels take in its block layout; a GPTQ, AWQ
    or FP8 piece is kept packed (the loader hands those over only for a GPU)."""
    if isinstance(loaded, (PackedInt, Fp8)):
        return True
    return (
        isinstance(loaded, GGUFWeight)
        and loaded.has_kernel
        and param.device.type == "cpu"
        and param.dtype == torch.float32
    )


class _LinearBase(torch.nn.Module):
    def __init__(self, tp_rank: int, tp_size: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = _group(tp, tp_rank, tp_size)
        self.tp_rank = self.tp.position  # which slice this rank holds
        self.tp_size = self.tp.size
        self.weight: Tensor
        self.bias: Tensor | None
        self.qweight: MatmulWeight | None = None
        # Until every row of the weight has arrived: quantized pieces by first row, and dense rows seen.
        self._qpieces: dict[int, GGUFWeight | PackedPiece] = {}
        self._dense_rows = 0

    def forward(self, x: Tensor) -> Tensor:
        return self._matmul(x, self.bias)

    def _matmul(self, x: Tensor, bias: Tensor | None) -> Tensor:
        if self.qweight is not None:
            return self.qweight.matmul(x, bias)
        return F.linear(x, self.weight, bias)

    def _load_rows(self, param: Tensor, offset: int, loaded: Loaded, what: str = "") -> None:
        """Rows [offset, offset + len(loaded)) of this rank's weight (`param`, 2-D). Quantized pieces are
        kept until the last row arrives; then the layer takes the quantized format if every piece was
        quantized, else the pieces are dequantized into the dense weight."""
        n = int(loaded.shape[0])
        if not _keeps_quantized(param, loaded):
            _copy_checked(param.data.narrow(0, offset, n), loaded, what)
            self._dense_rows += n
        else:
            assert isinstance(loaded, (GGUFWeight, PackedInt, Fp8))  # narrowed by _keeps_quantized
            want = (n, int(param.shape[1]))
            if tuple(loaded.shape) != want or offset + n > param.shape[0]:
                where = f" ({what})" if what else ""
                raise ValueError(f"shape mismatch{where}: expected {want}, got {tuple(loaded.shape)}")
            self._qpieces[offset] = loaded
        if sum(p.shape[0] for p in self._qpieces.values()) + self._dense_rows < param.shape[0]:
            return
        pieces = [self._qpieces[o] for o in sorted(self._qpieces)]
        gguf = [p for p in pieces if isinstance(p, GGUFWeight)]
        packed = [p for p in pieces if not isinstance(p, GGUFWeight)]
        if pieces and not self._dense_rows and (not gguf or not packed):
            self.qweight = QuantizedWeight(gguf) if gguf else DevicePackedWeight(packed, param.device)
            param.data = torch.empty(0, param.shape[1], dtype=param.dtype)  # the dense copy is never made
        else:  # mixed dense and quantized pieces: all dense
            for o in sorted(self._qpieces):
                p = self._qpieces[o]
                param.data.narrow(0, o, p.shape[0]).copy_(p.materialize())
        self._qpieces, self._dense_rows = {}, 0


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
        self.weight = _param((output_size, input_size), dtype, device, default_weight_loader)
        self.bias = _param((output_size,), dtype, device, default_weight_loader) if bias else None


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
        self.weight = _param((n, input_size), dtype, device, self.weight_loader)
        self.bias = _param((n,), dtype, device, self.weight_loader) if bias else None

    def weight_loader(self, param: Tensor, loaded_weight: Loaded, shard_id: object = None) -> None:
        _no_shard(shard_id, type(self).__name__)
        n = self.output_size_per_partition
        _check_dim(loaded_weight, 0, n * self.tp_size)
        if param is self.weight:
            self._load_rows(param, 0, loaded_weight.narrow(0, self.tp_rank * n, n))
        else:
            _copy_checked(param, loaded_weight.narrow(0, self.tp_rank * n, n))


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
        tp = _group(tp, tp_rank, tp_size)
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
            _copy_checked(param.data.narrow(0, offset, n), piece, f"shard {shard_id}")

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
        tp = _group(tp, tp_rank, tp_size)
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
        self.weight = _param((output_size, self.input_size_per_partition), dtype, device, self.weight_loader)
        self.bias = _param((output_size,), dtype, device, self.weight_loader) if bias else None

    def weight_loader(self, param: Tensor, loaded_weight: Loaded, shard_id: object = None) -> None:
        _no_shard(shard_id, "RowParallelLinear")
        if param.dim() == 1:  # bias: replicated, added once after the reduce
            _copy_checked(param, loaded_weight)
            return
        n = self.input_size_per_partition
        _check_dim(loaded_weight, 1, n * self.tp_size)
        if isinstance(loaded_weight, GGUFWeight) and _keeps_quantized(param, loaded_weight):
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


class QuantSlot:
    """Where an embedding table keeps its quantized format; an output head tied to the table shares the
    slot (a plain object, not a module: the tie adds no parameter and no submodule)."""

    def __init__(self) -> None:
        self.weight: QuantizedWeight | None = None


class VocabParallelEmbedding(torch.nn.Module):
    """Token embedding with the vocabulary split across ranks (padded to a multiple of tp_size). A
    GGUF-quantized table on CPU stays quantized (each rank its rows): rows are dequantized as they are
    looked up."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp: TPGroup | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp = _group(tp, tp_rank, tp_size)
        self.tp_rank, self.tp_size = self.tp.position, self.tp.size
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.weight = _param(
            (self.num_embeddings_per_partition, embedding_dim), dtype, device, self.weight_loader
        )
        self.quant = QuantSlot()

    def weight_loader(self, param: Tensor, loaded_weight: Loaded, shard_id: object = None) -> None:
        _no_shard(shard_id, "an embedding")
        if tuple(loaded_weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"shape mismatch: expected {(self.num_embeddings, self.embedding_dim)}, got {tuple(loaded_weight.shape)}"
            )
        n = max(0, min(self.num_embeddings_per_partition, self.num_embeddings - self.vocab_start))
        if n and isinstance(loaded_weight, GGUFWeight) and _keeps_quantized(param, loaded_weight):
            # this rank's rows of the table (without the padding rows past the vocabulary)
            self.quant.weight = QuantizedWeight([loaded_weight.narrow(0, self.vocab_start, n)])
            param.data = torch.empty(0, self.embedding_dim, dtype=param.dtype)
            return
        if n:
            param.data[:n].copy_(_materialize(loaded_weight.narrow(0, self.vocab_start, n)))
        param.data[n:].zero_()

    def forward(self, input_ids: Tensor) -> Tensor:
        qweight = self.quant.weight
        if self.tp_size == 1:
            return qweight.rows(input_ids) if qweight is not None else F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        held = qweight.out_features if qweight is not None else self.num_embeddings_per_partition
        mask = (local < 0) | (local >= held)
        local = local.masked_fill(mask, 0)
        out = qweight.rows(local) if qweight is not None else F.embedding(local, self.weight)
        out.masked_fill_(mask[:, None], 0)
        return self.tp.all_reduce(out)


class ReplicatedEmbedding(VocabParallelEmbedding):
    """A whole table on every rank (learned position embeddings: small, and no all-reduce needed)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, tp=TPGroup(), dtype=dtype, device=device)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection hidden -> vocab (this rank's slice of the vocabulary)."""

    packed: MatmulWeight | None = None  # the float32 table packed for oneDNN's matmul (layers/onednn.py)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's table, in whichever format it is loaded."""
        self.weight = embedding.weight
        self.quant = embedding.quant

    def compute_logits(self, hidden: Tensor) -> Tensor | None:
        """[N, hidden] -> [N, vocab] float32 on rank 0 (each rank's vocabulary slice gathered there);
        None on the other ranks."""
        qweight = self.quant.weight
        if qweight is not None:
            local = qweight.matmul(hidden)
        elif self.packed is not None and hidden.dtype == torch.float32:
            local = self.packed.matmul(hidden)
        else:
            local = F.linear(hidden, self.weight)
        if local.shape[-1] < self.num_embeddings_per_partition:  # a quantized slice holds no padding rows
            local = F.pad(local, (0, self.num_embeddings_per_partition - local.shape[-1]))
        logits = self.tp.gather_last_dim(local)
        if logits is None:
            return None
        return logits[..., : self.num_embeddings].float()

    def forward(self, hidden: Tensor) -> Tensor | None:  # type: ignore[override]  # None on ranks that get no logits
        return self.compute_logits(hidden)
