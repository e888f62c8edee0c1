"""A large vocabulary's tied table on the CPU (150k rows of a tiny hidden size, as Qwen2.5's 151k; Q8_0 and
Q6_K, the types llama.cpp stores a tied token_embd in): loaded as the GGUF loader hands it over, it stays in
its blocks (no float32 copy), the lookup and the output head read the same blocks, the head's logits are
within the 8-bit-activation bound of the dequantized float32 head's, and the greedy sampler without
logprobs takes the argmax and the sampled token's logprob without a vocabulary-sized log-softmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedrs.layers.sampler import Sampler, SamplingMetadata
from pagedrs.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from tests.layers.helpers_quant import Q, dequantized, error_bound, random_weight


@pytest.mark.parametrize(
    ("qtype", "vocab", "hidden"), [(Q.Q8_0, 150_000, 64), (Q.Q6_K, 20_000, 256)], ids=["Q8_0", "Q6_K"]
)
def test_tied_table_stays_quantized_and_greedy_skips_the_softmax(
    qtype: Q, vocab: int, hidden: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = random_weight(qtype, vocab, hidden, seed=3)
    embed = VocabParallelEmbedding(vocab, hidden)
    embed.weight_loader(embed.weight, table)
    head = ParallelLMHead(vocab, hidden)
    head.tie_to(embed)
    q = head.quant.weight
    assert q is not None and q is embed.quant.weight and q.type_names == [qtype.name]
    assert embed.weight.numel() == 0  # no float32 copy of the table
    # a token's head reads the file's bytes: 3.8x (Q8_0) to 4.9x (Q6_K) fewer than a float32 table's
    assert q.nbytes == table.data.nbytes and 3.7 * q.nbytes < vocab * hidden * 4

    dense = dequantized(table)
    ids = torch.tensor([0, 1, vocab // 2, vocab - 1])
    assert torch.equal(embed(ids), dense[ids])  # the lookup reads the same blocks, exactly

    # hidden states along some tokens' embeddings (a tied model about to predict them), and noise
    noise = torch.from_numpy(np.random.default_rng(0).standard_normal((5, hidden), dtype=np.float32))
    targets = dense.norm(dim=1).topk(3).indices  # rows no other row's dot product can outgrow
    x = torch.cat([dense[targets] / dense[targets].std(dim=1, keepdim=True), noise[3:]])
    logits = head.compute_logits(x)
    assert logits is not None and logits.shape == (5, vocab)
    ref = x @ dense.T
    bound = error_bound(x, dense)
    assert ((logits - ref).abs() <= bound).all()

    def no_softmax(*args: object, **kwargs: object) -> None:
        raise AssertionError("a vocabulary-sized softmax on the greedy path without logprobs")

    with monkeypatch.context() as m:
        for owner in (torch, torch.Tensor):
            for name in ("log_softmax", "softmax", "logsumexp"):
                m.setattr(owner, name, no_softmax)
        out = Sampler()(logits, SamplingMetadata.greedy(5))
    assert out.logprobs is None and out.sampled_logprobs is not None
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    want = logits.log_softmax(-1).gather(1, out.sampled_token_ids[:, None])[:, 0]
    torch.testing.assert_close(out.sampled_logprobs, want, atol=1e-4, rtol=0)
    # where the float32 head's top token stays above every other token even with both bounds against it,
    # the quantized head picks it too
    top = ref.argmax(-1)
    rows = torch.arange(5)
    others = (ref + bound).index_put((rows, top), torch.tensor(float("-inf")))
    decided = ref[rows, top] - bound[rows, top] > others.amax(-1)
    assert decided[:3].all() and torch.equal(top[:3], targets)
    assert torch.equal(out.sampled_token_ids[decided], top[decided])
