"""Test modules share helpers through helper modules (tests/helpers.py, tests/<pkg>/helpers_*.py, ...),
never by importing another test module: a `test_*.py` is collected by pytest under its own name, so
importing it again as `tests.<pkg>.test_x` runs its module code twice and ties one test file to the
insides of another."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _is_test_module(dotted: str) -> bool:
    return dotted.rsplit(".", 1)[-1].startswith("test_")


def _imported_modules(source: str, package: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, dotted module) for every module imported by `source` (a file of `package`, e.g. ("tests",
    "models")), at any depth (inside functions too); relative imports resolved against the package,
    `from pkg import name` also counted as importing pkg.name when that is a module file."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.append((node.lineno, module))
            for alias in node.names:
                if module and ROOT.joinpath(*module.split("."), f"{alias.name}.py").is_file():
                    found.append((node.lineno, f"{module}.{alias.name}"))
    return found


def test_no_test_module_imports_another_test_module() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: imports {module}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, module in _imported_modules(
            path.read_text(encoding="utf-8"), path.relative_to(ROOT).parent.parts
        )
        if _is_test_module(module)
    ]
    assert not offenders, "move the shared code into a helper module:\n" + "\n".join(offenders)


def test_the_check_sees_every_import_form() -> None:
    """Absolute, relative, nested and `from pkg import test_x` imports are flagged; helper modules not."""
    source = (
        "import tests.models.test_gpt2\n"
        "from tests.models.test_opt import x\n"
        "from .test_phi3 import y\n"
        "from tests.models import test_llama\n"
        "def f():\n"
        "    from tests.models.test_gpt2 import z\n"
        "from tests.models.helpers_hf import assert_matches_hf\n"
        "from . import helpers_configs\n"
        "from tests.helpers import make_tiny_model\n"
    )
    found = _imported_modules(source, ("tests", "models"))
    assert sorted((line, m) for line, m in found if _is_test_module(m)) == [
        (1, "tests.models.test_gpt2"),
        (2, "tests.models.test_opt"),
        (3, "tests.models.test_phi3"),
        (4, "tests.models.test_llama"),
        (6, "tests.models.test_gpt2"),
    ]
    assert (8, "tests.models.helpers_configs") in found
