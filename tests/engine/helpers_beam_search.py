"""HF transformers' beam search as the reference for `LLM.beam_search` (test_beam_search.py and the
server's test_openai_beam_search.py)."""

from __future__ import annotations

from typing import Any

import torch

from tests.helpers import PAD_ID


def hf_beam_search(
    model: Any, prompt: list[int], beam_width: int, max_tokens: int, length_penalty: float = 1.0
) -> list[tuple[list[int], float]]:
    """HF `generate(num_beams=beam_width, do_sample=False)` with no EOS (eos_token_id=[]), so every beam
    runs max_tokens tokens: (generated ids, cumulative logprob) of the beam_width beams, best first.

    This is the setting where HF's and vLLM's beam search are the same algorithm: each step keeps the
    beam_width best continuations by cumulative logprob, and at the end all beams have the same length,
    so HF's score (cum / generated_len ** length_penalty) and vLLM's (cum / total_len ** length_penalty)
    rank them alike. With EOS they differ (HF finalizes an EOS beam only when it is among the top
    beam_width candidates of its step and stops early; vLLM keeps every EOS candidate and runs max_tokens
    rounds), so EOS handling is tested against vLLM's rule instead."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            num_beams=beam_width,
            num_return_sequences=beam_width,
            max_new_tokens=max_tokens,
            eos_token_id=[],
            pad_token_id=PAD_ID,
            length_penalty=length_penalty,
            early_stopping=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    scale = max_tokens**length_penalty  # HF's sequences_scores are cum_logprob / max_tokens ** lp
    return [
        (seq[len(prompt) :].tolist(), float(score) * scale)
        for seq, score in zip(out.sequences, out.sequences_scores, strict=True)
    ]
