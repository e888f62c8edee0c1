"""The prepare-for-device pass (pagedrs.models.prepare): the forms a model takes are given in one walk of
its modules, in the table's order; in an engine each model takes each form once, the draft model leaves
its layer kernels as loaded, and a liquid rank (whose dense weights move between ranks) leaves them
unpacked."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import pagedrs.models.prepare as prepare
from pagedrs.layers.device_form import DeviceForm, PrepareOptions
from pagedrs.layers.linear import _LinearBase
from pagedrs.layers.onednn import PackedDense, available
from pagedrs.loader import load_model
from tests.distributed.helpers_tp import tp_engine
from tests.helpers import make_tiny_gguf, make_tiny_llama

_SEEN: list[_Seen] = []


class _Seen(DeviceForm):
    """A form as a new one is added: this class, and one line in DEVICE_FORMS."""

    name = "seen"

    def __init__(self) -> None:
        self.modules: list[torch.nn.Module] = []
        _SEEN.append(self)

    @staticmethod
    def wanted(opts: PrepareOptions) -> bool:
        return True

    def visit(self, name: str, module: torch.nn.Module) -> None:
        self.modules.append(module)

    def finish(self, model: torch.nn.Module) -> int:
        return len(self.modules)


def test_one_walk_in_the_table_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    net = load_model(str(make_tiny_llama(tmp_path, seed=2)), dtype="float32", with_tokenizer=False).model
    assert prepare.prepare_for_device(net, PrepareOptions()) == {}  # no form turned on: no walk
    _SEEN.clear()
    monkeypatch.setattr(prepare, "DEVICE_FORMS", (*prepare.DEVICE_FORMS, _Seen))

    done = prepare.prepare_for_device(net, PrepareOptions(pack_dense=True, layer_kernels=False))
    assert list(done) == ["onednn", "layer_kernels", "seen"]  # the forms turned on, in the table's order
    (seen,) = _SEEN
    assert [id(m) for m in seen.modules] == [id(m) for m in net.modules()]  # each module once
    linears = [m for m in seen.modules if isinstance(m, _LinearBase)]
    if available():  # the later form sees each layer as the earlier one left it
        assert done["onednn"] == len(linears) + 1  # and the output head
        assert all(isinstance(m.qweight, PackedDense) for m in linears)


def _forms_by_model(monkeypatch: pytest.MonkeyPatch) -> dict[int, Counter[str]]:
    """{id(model): how often each form was given to it}, filled as the engine prepares its models (by
    whichever path: every form ends in its `finish`)."""
    seen: dict[int, Counter[str]] = defaultdict(Counter)
    for cls in prepare.DEVICE_FORMS:

        def spy(form: DeviceForm, model: torch.nn.Module, real: Any = cls.finish) -> int:
            seen[id(model)][form.name] += 1
            return int(real(form, model))

        monkeypatch.setattr(cls, "finish", spy)
    return seen


def test_the_engine_prepares_each_model_once_and_the_draft_keeps_its_layer_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = make_tiny_llama(tmp_path, seed=3)
    draft = make_tiny_llama(tmp_path, num_hidden_layers=1, seed=4, subdir="draft")
    seen = _forms_by_model(monkeypatch)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    engine = tp_engine(folder, 1, speculative_config=spec)
    target = id(engine.engine_core.executor.runner.model)  # type: ignore[attr-defined]
    assert set(seen) - {target}, "the draft model was prepared too"
    (other,) = set(seen) - {target}
    assert seen[target] == Counter({"after_load": 1, "onednn": 1, "layer_kernels": 1})
    assert seen[other] == Counter({"after_load": 1, "onednn": 1})  # the draft opts out of the layer kernels


def test_a_quantized_gguf_takes_its_cpu_forms_at_load_and_the_rest_in_the_runner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = make_tiny_gguf(tmp_path, "llama", qtype="Q8_0")
    seen = _forms_by_model(monkeypatch)
    engine = tp_engine(gguf, 1, dtype="auto")
    model = engine.engine_core.executor.runner.model  # type: ignore[attr-defined]
    assert dict(seen) == {
        id(model): Counter(
            {"after_load": 1, "cpu_fused_ops": 1, "cpu_decode": 1, "onednn": 1, "layer_kernels": 1}
        )
    }
    assert model.model.cpu_decode is not None


@pytest.mark.parametrize(
    ("liquid_gpu_range", "batch_invariant", "packs"),
    [(None, False, True), ((0,), True, True), ((0, 1), False, False), ((0, 1, 2, 3), True, False)],
)
def test_runner_options_leave_a_liquid_ranks_weights_unpacked(
    liquid_gpu_range: tuple[int, ...] | None, batch_invariant: bool, packs: bool
) -> None:
    config: Any = SimpleNamespace(
        parallel=SimpleNamespace(liquid_gpu_range=liquid_gpu_range),
        device=SimpleNamespace(batch_invariant=batch_invariant),
    )
    opts = prepare.runner_options(config, layer_kernels=True)
    assert opts == PrepareOptions(pack_dense=packs, integer_matmuls=batch_invariant, layer_kernels=True)
    assert prepare.runner_options(config).layer_kernels is None  # a draft model's
