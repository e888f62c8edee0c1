"""python/pagedrs/_core.pyi must list exactly what pagedrs._core exports."""

import ast
from pathlib import Path

import pagedrs._core as core
from tests.helpers import plan_fields

PYI = Path(__file__).resolve().parents[2] / "python" / "pagedrs" / "_core.pyi"


def _stub() -> tuple[set[str], dict[str, set[str]]]:
    tree = ast.parse(PYI.read_text())
    names: set[str] = set()
    members: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        if isinstance(node, ast.ClassDef):
            members[node.name] = {
                n.name for n in node.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("__")
            }
    return names, members


def _public(obj: object) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


def test_module_names_match_stub() -> None:
    names, _ = _stub()
    assert names == _public(core) - {"__all__"}


def test_class_members_match_stub() -> None:
    _, members = _stub()
    for cls in ("Scheduler", "StepPlan"):
        assert members[cls] == _public(getattr(core, cls)), cls


def test_init_signature_matches_stub() -> None:
    tree = ast.parse(PYI.read_text())
    sched = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Scheduler")
    init = next(n for n in sched.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    stub_kw = [a.arg for a in init.args.kwonlyargs]
    sig = core.Scheduler.__text_signature__
    assert sig is not None
    runtime_kw = [
        p.split("=")[0].strip() for p in sig.strip("()").split(",") if p.strip() not in ("*", "$self", "")
    ]
    assert stub_kw == runtime_kw


def test_step_plan_fields_match_stub() -> None:
    """The stub's StepPlan properties (the declaration the runner, the KV pool ops, the step buffers and
    the batch picture are typed with) are exactly the binding's getters, and every one travels over the
    tensor-parallel step wire (the Rust side's round trip compares every struct field)."""
    runtime = {
        n for n in _public(core.StepPlan) if type(getattr(core.StepPlan, n)).__name__ == "getset_descriptor"
    }
    assert set(plan_fields()) == runtime
