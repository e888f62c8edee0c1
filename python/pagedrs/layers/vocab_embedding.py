"""Embedding tables with the vocabulary split across tensor-parallel ranks (vLLM's
vocab_parallel_embedding): the token embedding, a whole table on every rank (learned positions), and the
output head, which multiplies by its table (tied to the embedding's or its own).

A GGUF-quantized table on a CPU stays quantized (each rank its rows; `QuantSlot`, shared by a tied head):
rows are dequantized as they are looked up, and the head multiplies the blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedrs.distributed.group import TPGroup
from pagedrs.layers.linear_form import (
    Loaded,
    MatmulWeight,
    keeps_quantized,
    materialize,
    no_shard,
    param_with_loader,
    tp_group,
)
from pagedrs.layers.quantized import QuantizedWeight
from pagedrs.quantization.gguf_blocks import GGUFWeight

__all__ = ["ParallelLMHead", "QuantSlot", "ReplicatedEmbedding", "VocabParallelEmbedding"]


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
        self.tp = tp_group(tp, tp_rank, tp_size)
        self.tp_rank, self.tp_size = self.tp.position, self.tp.size
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.weight = param_with_loader(
            (self.num_embeddings_per_partition, embedding_dim), dtype, device, self.weight_loader
        )
        self.quant = QuantSlot()

    def weight_loader(self, param: Tensor, loaded_weight: Loaded, shard_id: object = None) -> None:
        no_shard(shard_id, "an embedding")
        if tuple(loaded_weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"shape mismatch: expected {(self.num_embeddings, self.embedding_dim)}, got {tuple(loaded_weight.shape)}"
            )
        n = max(0, min(self.num_embeddings_per_partition, self.num_embeddings - self.vocab_start))
        if n and isinstance(loaded_weight, GGUFWeight) and keeps_quantized(param, loaded_weight):
            # this rank's rows of the table (without the padding rows past the vocabulary)
            self.quant.weight = QuantizedWeight([loaded_weight.narrow(0, self.vocab_start, n)])
            param.data = torch.empty(0, self.embedding_dim, dtype=param.dtype)
            return
        if n:
            param.data[:n].copy_(materialize(loaded_weight.narrow(0, self.vocab_start, n)))
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
