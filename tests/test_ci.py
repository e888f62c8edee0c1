"""The README's test command as users run it: `.ci/wheel` inside a virtualenv, and no bench script or test
module that another library would import in place of its own package."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _names_libraries_import() -> set[str]:
    """Top-level modules of every installed distribution, and the optional packages transformers probes
    for (`is_kernels_available` found `bench/kernels.py` first, the script's folder leading `sys.path`)."""
    names = set(importlib.metadata.packages_distributions())
    import transformers.utils.import_utils as import_utils

    source = Path(import_utils.__file__).read_text(encoding="utf-8")
    names |= set(re.findall(r'is_package_available\(\s*"([A-Za-z0-9_]+)"', source))
    return names


def _shadowing_candidates() -> dict[str, Path]:
    """Importable top-level names a bench script or a test run puts on `sys.path`: the bench scripts (their
    folder leads `sys.path`), and the modules and regular packages of tests/ and of each tests/ folder
    (pytest's rootdir insertion). Folders without `__init__.py` are namespace portions, which lose to any
    installed package of the same name, so they are not candidates."""
    found = {p.stem: p for p in (ROOT / "bench").glob("*.py")}
    for folder in [ROOT / "tests", *(d for d in (ROOT / "tests").iterdir() if d.is_dir())]:
        found |= {p.stem: p for p in folder.glob("*.py") if p.stem != "__init__"}
        found |= {d.name: d for d in folder.iterdir() if d.is_dir() and (d / "__init__.py").is_file()}
    return found


def test_no_bench_or_test_module_shadows_a_library() -> None:
    libraries = _names_libraries_import()  # once: it reads every installed distribution's file list
    clashes = sorted(
        f"{path.relative_to(ROOT)} would be imported as {name!r}"
        for name, path in _shadowing_candidates().items()
        if name in libraries
    )
    assert not clashes, "rename these:\n" + "\n".join(clashes)


def test_the_shadow_check_sees_the_clash_it_was_written_for() -> None:
    assert "kernels" in _names_libraries_import()  # transformers probes Hugging Face's `kernels`
    assert "kernels" not in _shadowing_candidates()


@pytest.mark.skipif(not (shutil.which("cargo") and shutil.which("maturin")), reason="needs cargo and maturin")
def test_ci_wheel_inside_a_virtualenv(tmp_path: Path) -> None:
    """`.ci/wheel` run from an active virtualenv: its smoke-test virtualenv sees the active virtualenv's
    packages (a module only that virtualenv has is imported), not only the base interpreter's."""
    env_dir = tmp_path / "user-venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    site = Path(sysconfig.get_paths(vars={"base": str(env_dir), "platbase": str(env_dir)})["purelib"])
    (site / "only_in_user_venv.py").write_text("MARK = 1\n")
    env = os.environ | {
        "PATH": f"{env_dir / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "VIRTUAL_ENV": str(env_dir),
        "WHEEL_SMOKE_IMPORTS": "only_in_user_venv",
    }
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        ["bash", str(ROOT / ".ci" / "wheel")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"site directories of {env_dir}" in proc.stdout or f"site directory of {env_dir}" in proc.stdout
    assert "smoke test passed" in proc.stdout
    assert sys.prefix != str(env_dir)
