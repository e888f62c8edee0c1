"""The layer description (`models.layer_desc`): each family's ops in order, built from its modules, and
the module path running them (the forward is the description)."""

from __future__ import annotations

import pytest
import torch

from pagedrs.layers.attention import ForwardContext
from pagedrs.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from pagedrs.models.layer_desc import Act, Norm, Residual
from pagedrs.models.llama import LlamaForCausalLM, Qwen3ForCausalLM
from tests.helpers import make_config
from tests.models.helpers_families import gemma2_config, gemma3_config, qwen3_config

LLAMA = ["Norm", "QKVProj", "Rope", "Attend", "Linear", "Norm", "Linear", "Act", "Linear"]
QWEN3 = ["Norm", "QKVProj", "HeadNorm", "Rope", "Attend", "Linear", "Norm", "Linear", "Act", "Linear"]
GEMMA2 = ["Norm", "QKVProj", "Rope", "Attend", "Linear", "Norm", "AddResidual"]
GEMMA2 += ["Norm", "Linear", "Act", "Linear", "Norm", "AddResidual"]
GEMMA3 = GEMMA2[:2] + ["HeadNorm"] + GEMMA2[2:]


def _names(model: torch.nn.Module) -> list[list[str]]:
    return [[type(op).__name__ for op in layer] for layer in model.model.desc.layers]


@pytest.mark.parametrize(
    ("make", "ops"),
    [
        (lambda: LlamaForCausalLM(make_config("llama"), dtype=torch.float32, device="cpu"), LLAMA),
        (lambda: Qwen3ForCausalLM(qwen3_config(), dtype=torch.float32, device="cpu"), QWEN3),
        (lambda: Gemma2ForCausalLM(gemma2_config(), dtype=torch.float32, device="cpu"), GEMMA2),
        (lambda: Gemma3ForCausalLM(gemma3_config(), dtype=torch.float32, device="cpu"), GEMMA3),
    ],
)
def test_each_family_is_its_ops_in_order(make: object, ops: list[str]) -> None:
    model = make()  # type: ignore[operator]
    assert all(layer == ops for layer in _names(model))
    desc = model.model.desc
    assert desc is model.model.desc  # built once
    first = desc.layers[0][0]
    assert isinstance(first, Norm) and first.module is model.model.layers[0].input_layernorm
    gemma = isinstance(model, Gemma2ForCausalLM)
    assert first.residual is (Residual.SAVE if gemma else Residual.FUSED)
    assert desc.final.module is model.model.norm


def test_the_module_path_runs_the_description(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward calls each op of the description once (an op patched here sees every layer), and
    a layer's own forward gives what the model's run of its ops gives."""
    model = LlamaForCausalLM(make_config("llama"), dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    seen: list[int] = []
    real = Act.run

    def spy(op: Act, s: object) -> None:
        seen.append(id(op.module))
        real(op, s)  # type: ignore[arg-type]

    monkeypatch.setattr(Act, "run", spy)
    ids, pos = torch.tensor([5, 9, 3]), torch.arange(3)
    ctx = ForwardContext(None, [])
    with torch.no_grad():
        hidden = model(ids, pos, ctx)
        x = model.model.embed_tokens(ids)
        residual = None
        for layer in model.model.layers:
            x, residual = layer(pos, x, residual, ctx, None)
        want, _ = model.model.norm(x, residual)
    assert seen[: len(model.model.layers)] == [id(layer.mlp.act_fn) for layer in model.model.layers]
    torch.testing.assert_close(hidden, want, rtol=0, atol=0)
