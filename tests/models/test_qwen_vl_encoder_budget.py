"""The image-encoder budget (`max_num_encoder_input_tokens`) charges an image once, as vLLM's encoder cache
manager does: an image whose encoder output is cached, or that the step already charged (the same image in
two requests, or twice in one prompt), costs nothing; a request preempted for recompute pays again only for
the images whose outputs left the encoder cache. Checked on a tiny random Qwen2.5-VL against HF's greedy
ids, with the rows the scheduler charged equal to the rows the encoder ran, step by step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from PIL import Image

from pagedrs.engine.llm_engine import LLMEngine
from pagedrs.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from tests.engine.conftest import assert_pool_free, greedy, make_engine, run_all
from tests.models.helpers_qwen_vl import (
    SIZES,
    hf_greedy,
    images,
    make_vl_model,
    qwen2_5_vl_config,
    vl_processor,
)

ONE = "ab<|vision_start|><|image_pad|><|vision_end|>cd"
TWO = "x<|vision_start|><|image_pad|><|vision_end|>y<|vision_start|><|image_pad|><|vision_end|>zz"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_vl_model(tmp_path_factory.mktemp("qwen2_5_vl"), qwen2_5_vl_config())


@pytest.fixture(scope="module")
def hf(folder: Path) -> Any:
    return transformers.AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32).eval()


class StepLedger:
    """Per step: the encoder rows the scheduler charged, the rows the encoder ran, the sequences preempted."""

    def __init__(self, engine: LLMEngine) -> None:
        self.charged: list[int] = []
        self.ran: list[int] = []
        self.preempted = 0
        core = engine.engine_core
        execute, model = core.executor.execute, core.executor.runner.model
        embed = model.embed_multimodal

        def spy_execute(plan: Any, *args: Any, **kwargs: Any) -> Any:
            self.charged.append(core.scheduler.encoder_rows_charged())
            self.ran.append(0)
            self.preempted += len(plan.preempted)
            return execute(plan, *args, **kwargs)

        def spy_embed(items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
            out = embed(items)
            self.ran[-1] += sum(o.shape[0] for o in out)
            return out

        core.executor.execute = spy_execute
        model.embed_multimodal = spy_embed


def vl_engine(folder: Path, **kwargs: Any) -> LLMEngine:
    engine = make_engine(folder, dtype="float32", block_size=4, skip_tokenizer_init=True, **kwargs)
    engine.input_processor.mm_processor = vl_processor(Qwen2_5_VLForConditionalGeneration, engine.hf_config)
    return engine


def run_wave(engine: LLMEngine, hf: Any, wave: list[tuple[str, str, list[Any]]], n: int) -> None:
    for rid, text, imgs in wave:
        engine.add_request(rid, {"prompt": text, "multi_modal_data": {"image": imgs}}, greedy(n))
    outs = run_all(engine)
    for rid, text, imgs in wave:
        assert outs[rid].outputs[0].token_ids == hf_greedy(hf, text, imgs, n), rid


def test_an_image_is_charged_once(folder: Path, hf: Any) -> None:
    """Budget 12 rows: the same 4-row image in two requests and twice in one prompt is charged 4 rows in
    their step (not 12); then a prompt with that image (cached) and a 12-row image fits one step (without
    the cache it would take 16 rows and be split over two)."""
    engine = vl_engine(folder, max_num_batched_tokens=64, max_num_encoder_input_tokens=12)
    ledger = StepLedger(engine)
    small, large = (Image.fromarray(a) for a in images())  # 4 and 12 encoder rows
    same_twice = TWO.replace("zz", "")
    run_wave(
        engine, hf, [("a", ONE, [small]), ("b", ONE + "e", [small]), ("c", same_twice, [small, small])], 4
    )
    assert ledger.charged[0] == ledger.ran[0] == 4, ledger.charged
    assert sum(ledger.charged) == 4
    first = len(ledger.charged)
    run_wave(engine, hf, [("d", TWO, [small, large])], 4)
    assert ledger.charged[first:] == ledger.ran[first:] == [12, 0, 0, 0], ledger.charged
    assert_pool_free(engine)


@pytest.mark.parametrize("dropped", [False, True])
def test_preempted_request_pays_again_only_for_dropped_outputs(folder: Path, hf: Any, dropped: bool) -> None:
    """A pool too small for the batch preempts (recompute): with the encoder outputs kept, the re-prefill
    charges and runs nothing; with an encoder cache of one output, the preempted request's image was dropped
    and is charged and run again. Every step charges exactly the rows the encoder ran (r0 and r2 share an
    image: charged once in their step)."""
    engine = vl_engine(
        folder,
        num_kv_blocks=10,
        max_num_batched_tokens=32,
        max_num_encoder_input_tokens=12,
        enable_prefix_caching=False,  # a preempted prompt is recomputed from its start, images included
    )
    cache = engine.engine_core.executor.runner.encoder_cache
    assert cache is not None
    if dropped:
        cache.cache_tokens = 1  # holds only the last output stored
    ledger = StepLedger(engine)
    a, b = (Image.fromarray(images(SIZES[:1], seed=s)[0]) for s in (1, 2))  # 4 rows each
    wave = [(f"r{i}", ONE + "e" * i, [img]) for i, img in enumerate([a, b, a])]
    run_wave(engine, hf, wave, 10)
    assert ledger.preempted > 0
    assert ledger.charged == ledger.ran, (ledger.charged, ledger.ran)
    # a and b once; with one output cached (b, stored last), the preempted r2 runs a again
    assert (sum(ledger.ran) > 8) == dropped, ledger.ran
    assert_pool_free(engine)
