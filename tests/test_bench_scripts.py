"""bench/ scripts on CPU: run from outside the repository with the installed package only (no python/ on
PYTHONPATH), record the commit they are given, and the roofline arithmetic they report by hand-computed
cases."""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.helpers import make_tiny_llama
from tests.multimodal.helpers_vision import make_gemma3_vision

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))


def _env(**extra: str) -> dict[str, str]:
    """A bench script's environment: no PYTHONPATH (the installed pagedrs only), no commit unless given."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PAGEDRS_COMMIT")}
    return env | {"OMP_NUM_THREADS": "1"} | extra


def _run(script: str, *args: str, cwd: Path, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=cwd,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc


def _load(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A bench module imported the way its scripts see it (their folder first on the path)."""
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# ---- every script imports the installed package ----------------------------------------------------


def _touches_sys_path(tree: ast.AST) -> list[int]:
    """Lines that change sys.path (sys.path.insert / append / extend / assignment) or add a site dir."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("insert", "append", "extend", "addsitedir"):
            base = node.value
            if node.attr == "addsitedir" or (
                isinstance(base, ast.Attribute)
                and base.attr == "path"
                and getattr(base.value, "id", "") == "sys"
            ):
                lines.append(node.lineno)
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr == "path" and getattr(t.value, "id", "") == "sys":
                    lines.append(node.lineno)
    return lines


def test_sys_path_check_catches_the_old_hack() -> None:
    old = (
        "import sys\nfrom pathlib import Path\n"
        + 'sys.path.insert(0, str(Path(__file__).parents[1] / "python"))\n'
    )
    assert _touches_sys_path(ast.parse(old)) == [3]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_no_script_changes_sys_path(script: Path) -> None:
    assert _touches_sys_path(ast.parse(script.read_text())) == [], f"{script.name} changes sys.path"


@pytest.mark.parametrize(
    "script", ["liquid.py", "memory.py", "serving.py", "gpu_summary.py", "qwen35_cpu_decode.py"]
)
def test_scripts_import_from_outside_the_repo(script: str, tmp_path: Path) -> None:
    proc = _run(script, "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "--commit" in proc.stdout


def test_kernels_needs_a_gpu(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tests/gpu covers the kernels")
    proc = _run("gpu_kernels.py", "--out", str(tmp_path / "k.json"), cwd=tmp_path)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr
    assert not (tmp_path / "k.json").exists()


# ---- the roofline arithmetic, by hand -------------------------------------------------------------


def test_device_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    r = _load("_roofline", monkeypatch)
    h100 = r.device_spec("NVIDIA H100 80GB HBM3")
    assert (h100.hbm_tbps, h100.peak_tflops, h100.complete) == (3.35, 989.0, True)
    assert (r.device_spec("NVIDIA H200").hbm_tbps, r.device_spec("NVIDIA H200").peak_tflops) == (4.8, 989.0)
    assert r.device_spec("NVIDIA H100 PCIe").hbm_tbps == 2.0  # not the SXM figure
    assert r.device_spec("NVIDIA H100 80GB HBM3", hbm_tbps=3.0).hbm_tbps == 3.0
    cpu = r.device_spec("cpu")
    assert (cpu.hbm_tbps, cpu.peak_tflops, cpu.complete) == (None, None, False)
    assert r.device_spec("cpu", 0.1, 1.0).complete


def _hand_shape(r: ModuleType) -> Any:
    # 2 layers, 4 query heads of 8, K/V: 2 layers x (K, V) x 2 KV heads x 8 x 2 bytes = 128 bytes per token
    return r.ModelShape(
        body_params=1000,
        lm_head_params=100,
        weight_bytes=2200,
        num_layers=2,
        num_heads=4,
        head_dim=8,
        kv_bytes_per_token=128,
    )


def test_step_bytes_flops_and_roofline(monkeypatch: pytest.MonkeyPatch) -> None:
    r = _load("_roofline", monkeypatch)
    shape = _hand_shape(r)
    # a decode (10 tokens cached, 1 new) and a prompt of 4 (none cached), both sampled
    load = r.step_load([10, 0], [1, 4], 2, num_prefill_tokens=4, num_decode_tokens=1)
    assert load == r.StepLoad(kind="mixed", num_tokens=5, num_sampled=2, kv_read_tokens=10, attn_pairs=21)
    # pairs: decode 1 x 10 + 1 = 11; prompt 0 + 4 x 5 / 2 = 10
    assert r.step_bytes(shape, load) == 2200 + 128 * 10 + 128 * 5
    flops = 2 * 1000 * 5 + 2 * 100 * 2 + 4 * 2 * 4 * 8 * 21
    assert flops == 15776 and r.step_flops(shape, load) == flops
    spec = r.DeviceSpec("test", hbm_tbps=1.0, peak_tflops=1.0)
    memory, compute, roof = r.roofline_seconds(shape, load, spec)
    assert math.isclose(memory, 4120e-12) and math.isclose(compute, 15776e-12)
    assert roof == compute
    assert r.step_load([7], [1], 1, 0, 1).kind == "decode"
    assert r.step_load([0], [3], 0, 3, 0).kind == "prefill"  # a chunk that does not finish its prompt


def test_summarize_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    r = _load("_roofline", monkeypatch)
    shape = _hand_shape(r)
    spec = r.DeviceSpec("test", hbm_tbps=1e-6, peak_tflops=1e-6)  # 1 MB/s, 1 MFLOP/s
    decode = r.step_load([10], [1], 1, 0, 1)  # 2200 + 128 * 11 bytes, 2000 + 200 + 256 * 11 FLOPs
    prefill = r.step_load([0], [4], 1, 4, 0)  # 2200 + 128 * 4 bytes, 8000 + 200 + 256 * 10 FLOPs
    out = r.summarize_steps([(decode, 0.01), (decode, 0.03), (prefill, 0.5)], shape, spec)
    assert list(out) == ["prefill", "decode"]
    d = out["decode"]
    assert (d["steps"], d["tokens"], d["bytes"]) == (2, 2, 2 * 3608)
    assert math.isclose(d["mean_ms"], 20.0)
    assert math.isclose(d["memory_seconds"], 2 * 3608e-6) and math.isclose(d["compute_seconds"], 2 * 5016e-6)
    assert math.isclose(d["roofline_seconds"], 2 * 5016e-6)  # each step: the larger of the two
    assert math.isclose(d["vs_roofline"], 0.04 / (2 * 5016e-6))
    assert math.isclose(out["prefill"]["roofline_seconds"], 10760e-6)
    cpu = r.summarize_steps([(decode, 0.01)], shape, r.device_spec("cpu"))["decode"]
    assert cpu["bytes"] == 3608 and cpu["roofline_seconds"] is None and cpu["vs_roofline"] is None


def test_model_shape_counts_tied_weights_once(monkeypatch: pytest.MonkeyPatch) -> None:
    r = _load("_roofline", monkeypatch)

    class Net(torch.nn.Module):
        def __init__(self, tied: bool) -> None:
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(10, 4)
            self.layer = torch.nn.Linear(4, 4, bias=False)
            self.lm_head = torch.nn.Linear(4, 10, bias=False)
            if tied:
                self.lm_head.weight = self.embed_tokens.weight

    class Config:
        num_attention_heads, hidden_size, num_hidden_layers = 2, 4, 1

    for tied in (False, True):
        shape = r.model_shape(Net(tied), Config(), kv_bytes_per_token=16)
        assert (shape.body_params, shape.lm_head_params, shape.weight_bytes) == (16, 40, 56 * 4)
        assert (shape.num_heads, shape.head_dim) == (2, 2)


def test_kernels_headline_is_against_hbm(monkeypatch: pytest.MonkeyPatch) -> None:
    k = _load("gpu_kernels", monkeypatch)
    decode = [
        {"batch": 64, "context": 2048, "TBps": 3.0},  # short context: not the headline
        {"batch": 64, "context": 4096, "TBps": 2.5},
        {"batch": 256, "context": 8192, "TBps": 2.68},
    ]
    prefill = [{"time_vs_sdpa": x} for x in (5.0, 4.0, 4.6)]
    head = k.headline(decode, prefill, 3.35)
    assert head["decode_tbps"] == 2.68 and math.isclose(head["decode_bw_fraction"], 2.68 / 3.35)
    assert head["decode_best"] == {"batch": 256, "context": 8192}
    assert head["prefill_time_vs_sdpa"] == 4.6
    assert k.headline(decode, prefill, None)["decode_bw_fraction"] is None


# ---- the scripts, end to end on CPU ---------------------------------------------------------------


@pytest.fixture(scope="module")
def throughput_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """bench/throughput.py on a tiny random Llama: two passes, transformers in its own process, the
    roofline with made-up device figures (a CPU has none)."""
    tmp = tmp_path_factory.mktemp("throughput")
    model = make_tiny_llama(tmp)
    out = tmp / "out" / "throughput.json"
    proc = _run(
        "throughput.py",
        *("--model", str(model), "--num-prompts", "3", "--input-len", "8", "16", "--output-len", "3", "6"),
        *("--passes", "2", "--hf-sequential-limit", "1", "--threads", "1", "--cpu-kv-cache-gb", "0.02"),
        *("--hbm-tbps", "0.05", "--peak-tflops", "0.5", "--commit", "deadbeef", "--json", str(out)),
        cwd=tmp,
        PAGEDRS_COMMIT="not-this-one",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {
        "json": json.loads(out.read_text()),
        "path": out,
        "stdout": proc.stdout,
        "model": model,
        "tmp": tmp,
    }


def test_throughput_figures(throughput_run: dict[str, Any]) -> None:
    d = throughput_run["json"]
    assert d["commit"] == "deadbeef" and d["git"]["commit"] == "deadbeef"  # --commit over $PAGEDRS_COMMIT
    assert d["hf_static_tok_s"] > 0 and d["hf_sequential_requests"] == 1  # the transformers process ran
    assert d["step_timing_synchronized"] is False
    assert "device not synchronised" in throughput_run["stdout"]
    steps = d["steps"]
    assert steps["decode"]["steps"] > 0 and steps["prefill"]["steps"] > 0
    # every prompt token and every sampled token but each request's last one goes through a step
    if d["num_preemptions"] == 0:
        tokens = sum(row["tokens"] for row in steps.values())
        assert tokens == d["input_tokens"] + d["output_tokens"] - d["num_prompts"]
    roof = sum(row["roofline_seconds"] for row in steps.values())
    assert math.isclose(d["e2e_roofline_seconds"], roof)
    assert math.isclose(d["e2e_vs_roofline"], d["e2e_seconds"] / roof)
    assert d["decode_step_vs_roofline"] == steps["decode"]["vs_roofline"]
    first, second = d["passes"]
    assert first["tokens"] == second["tokens"] == d["output_tokens"]
    assert math.isclose(d["first_pass_vs_steady"], first["seconds"] / second["seconds"])


def test_throughput_without_device_figures_and_with_a_slow_baseline(tmp_path: Path) -> None:
    """On a CPU with no --hbm-tbps / --peak-tflops the roofline fields are null; a transformers process
    that runs past --hf-timeout is stopped, its failure recorded, the pagedrs figures still written."""
    model = make_tiny_llama(tmp_path)
    out = tmp_path / "t.json"
    proc = _run(
        "throughput.py",
        *("--model", str(model), "--num-prompts", "2", "--input-len", "4", "8", "--output-len", "2", "3"),
        *("--hf-timeout", "0.5", "--threads", "1", "--cpu-kv-cache-gb", "0.02", "--json", str(out)),
        cwd=tmp_path,
        PAGEDRS_COMMIT="cafe0123",
    )
    assert proc.returncode == 1 and "--hf-timeout" in proc.stderr, proc.stdout + proc.stderr
    d = json.loads(out.read_text())
    assert d["commit"] == "cafe0123" and d["pagedrs_tok_s"] > 0
    assert "--hf-timeout" in d["hf_error"] and "hf_static_tok_s" not in d
    assert d["hbm_tbps"] is None and d["e2e_vs_roofline"] is None and d["first_pass_vs_steady"] is None
    assert d["steps"]["decode"]["vs_roofline"] is None and d["steps"]["decode"]["bytes"] > 0
    assert "roofline fields are null" in proc.stdout


def test_gpu_summary(throughput_run: dict[str, Any]) -> None:
    tmp: Path = throughput_run["tmp"]
    kernels = tmp / "kernels.json"
    kernels.write_text(
        json.dumps(
            {
                "device": "NVIDIA H100 80GB HBM3",
                "commit": "deadbeef",
                "decode_tbps": 2.68,
                "decode_bw_fraction": 0.8,
                "prefill_time_vs_sdpa": 4.6,
            }
        )
    )
    t = throughput_run["json"]
    out = tmp / "summary" / "gpu-summary.json"
    src = ("--kernels", str(kernels), "--throughput-8b", str(throughput_run["path"]))
    proc = _run(
        "gpu_summary.py", *src, "--throughput-1b", str(throughput_run["path"]), "--out", str(out), cwd=tmp
    )
    assert proc.returncode == 0, proc.stderr
    s = json.loads(out.read_text())
    assert s["commit"] == "deadbeef"  # the inputs' commit (here no git repository is asked)
    assert s["device"] == "NVIDIA H100 80GB HBM3"
    assert (s["decode_bw_fraction"], s["decode_tbps"], s["prefill_time_vs_sdpa"]) == (0.8, 2.68, 4.6)
    assert s["e2e_vs_roofline_8b"] == s["e2e_vs_roofline_1b"] == t["e2e_vs_roofline"]
    assert s["decode_step_vs_roofline"] == t["decode_step_vs_roofline"]
    assert s["first_pass_vs_steady"] == t["first_pass_vs_steady"]
    assert s["throughput_vs_hf_cb"] is None  # the run had no --hf-cb
    # an explicit commit wins, and a missing input leaves its figures null
    proc = _run(
        "gpu_summary.py", "--kernels", str(kernels), "--out", str(out), cwd=tmp, PAGEDRS_COMMIT="f00d"
    )
    assert proc.returncode == 0, proc.stderr
    s = json.loads(out.read_text())
    assert s["commit"] == "f00d" and s["e2e_vs_roofline_8b"] is None and s["decode_bw_fraction"] == 0.8
    for key in ("device", "commit", "decode_bw_fraction", "prefill_time_vs_sdpa", "throughput_vs_hf_cb"):
        assert key in s
    for key in ("decode_step_vs_roofline", "decode_tbps", "e2e_vs_roofline_8b", "e2e_vs_roofline_1b"):
        assert key in s
    assert "first_pass_vs_steady" in s


def test_scheduler_records_the_commit(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    args = ("--rounds", "20", "--cases", "64", "--json", str(out))
    proc = _run("scheduler.py", *args, cwd=tmp_path, PAGEDRS_COMMIT="abc1")
    assert proc.returncode == 0, proc.stderr
    d = json.loads(out.read_text())
    assert d["commit"] == "abc1" and d["command"].startswith("python ")
    assert [(c["case"], c["running"]) for c in d["cases"]] == [("decode-64", 64)]


def test_cpu_gemm_compares_both_matmuls_per_shape(tmp_path: Path) -> None:
    from pagedrs.layers.onednn import available

    if not available():
        pytest.skip("torch without oneDNN")
    out = tmp_path / "g.json"
    proc = _run(
        "cpu_gemm.py", "--rows", "2", "--iters", "3", "--json", str(out), cwd=tmp_path, PAGEDRS_COMMIT="c1"
    )
    assert proc.returncode == 0, proc.stderr
    d = json.loads(out.read_text())
    assert d["commit"] == "c1" and d["threads"] == 2
    names = [r["matmul"] for r in d["results"]]
    assert names == ["qkv", "o_proj", "gate_up", "down", "head", "step"]
    for r in d["results"]:
        assert r["f_linear"] > 0 and r["packed"] > 0
        assert r["speedup"] == pytest.approx(r["f_linear"] / r["packed"])
    step = d["results"][-1]
    per = {r["matmul"]: r for r in d["results"][:-1]}
    want = sum(per[n]["packed"] * (1 if n == "head" else 30) for n in per)
    assert step["packed"] == pytest.approx(want)
    assert "per step: F.linear" in proc.stdout


def test_moe_compares_fused_experts_with_the_loop_and_dense(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    proc = _run(
        "moe.py",
        *("--rows", "1", "5", "--experts", "8", "--top-k", "2", "--hidden", "64", "--inter", "32"),
        *("--iters", "2", "--quant", "Q8_0", "--json", str(out)),
        *("--engine", "--engine-batch", "2", "--engine-tokens", "3"),
        cwd=tmp_path,
        PAGEDRS_COMMIT="m1",
    )
    assert proc.returncode == 0, proc.stderr
    d = json.loads(out.read_text())
    assert d["commit"] == "m1" and set(d["rows"]) == {"1", "5"}
    for r in d["rows"].values():
        assert (
            r["fused_ms"] > 0
            and r["loop_ms"] > 0
            and r["dense_same_active_ms"] > 0
            and r["fused_Q8_0_ms"] > 0
        )
    assert set(d["batch1_active_vs_total_ms"]) == {"1_of_8", "2_of_8", "4_of_8", "2_of_2"}
    assert proc.stdout.count("(loop over experts)") == 2
    assert set(d["engine_decode_tok_s"]) == {"moe", "dense"} and min(d["engine_decode_tok_s"].values()) > 0
    assert "decode throughput:" in proc.stdout


def test_attention_cpu_compares_the_kernel_with_torch(tmp_path: Path) -> None:
    out = tmp_path / "a.json"
    proc = _run(
        "attention_cpu.py",
        *("--context", "40", "--queries", "1", "3", "--iters", "3", "--json", str(out)),
        cwd=tmp_path,
        PAGEDRS_COMMIT="c2",
    )
    assert proc.returncode == 0, proc.stderr
    d = json.loads(out.read_text())
    assert d["commit"] == "c2" and d["threads"] == 2
    assert [(r["context"], r["queries"]) for r in d["results"]] == [(40, 1), (40, 3)]
    for r in d["results"]:
        assert r["kernel_us"] > 0 and r["torch_us"] > 0
        assert r["speedup"] == pytest.approx(r["torch_us"] / r["kernel_us"])
        assert r["max_abs_diff"] < 1e-4  # the same attention as torch's


def test_spec_decode_takes_turns_and_reports_every_configuration(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "m")
    out = tmp_path / "s.json"
    args = ("--model", str(model), "--methods", "ngram", "self_draft", "--batch-sizes", "1", "2")
    args += ("--max-tokens", "12", "--num-prompts", "2", "--repeats", "2", "--k", "2", "--json", str(out))
    proc = _run("spec_decode.py", *args, cwd=tmp_path, timeout=300, PAGEDRS_COMMIT="c3")
    assert proc.returncode == 0, proc.stderr
    d = json.loads(out.read_text())
    assert d["git"]["commit"] == "c3" and set(d["results"]) == {"none", "ngram", "self_draft"}
    for name, res in d["results"].items():
        assert set(res) == {"1", "2"}
        for b, r in res.items():
            assert r["greedy_identical"] and r["output_tokens"] > 0 and r["governor_pauses"] >= 0
            assert r["speedup"] == pytest.approx(r["output_tok_s"] / d["results"]["none"][b]["output_tok_s"])
            # the ceiling: steps without speculation over steps with it (1.0 for no speculation)
            assert r["steps"] > 0
            assert r["free_verification_speedup"] == pytest.approx(
                d["results"]["none"][b]["steps"] / r["steps"]
            )
            if name == "none":
                assert r["draft_tokens"] == 0
    assert "same ids" in proc.stdout and "ceiling" in proc.stdout


def test_dp_routing_rounds_report_medians(monkeypatch: pytest.MonkeyPatch) -> None:
    d = _load("dp_routing", monkeypatch)

    def run(config: str, r: int, tok_s: float, p90: float, hit: float | None) -> dict[str, Any]:
        return {
            "config": config,
            "workload": "multi_tenant",
            "round": r,
            "output_token_throughput": tok_s,
            "ttft_p50_ms": p90 / 2,
            "ttft_p90_ms": p90,
            "hit_rate": hit,
            "completed": 8,
            "sent": 8,
            "ttft_ms_by_request": [1.0],
        }

    runs = [run("cache", 0, 100, 800, 0.8), run("round_robin", 0, 50, 1400, 0.25)]
    runs += [run("cache", 1, 190, 340, 0.88), run("round_robin", 1, 60, 1500, None)]
    runs += [run("cache", 2, 160, 500, 0.86), run("round_robin", 2, 55, 1300, 0.27)]
    rows = d.merge_rounds(runs)
    cache, rr = d._row(rows, "cache", "multi_tenant"), d._row(rows, "round_robin", "multi_tenant")
    assert (cache["output_token_throughput"], cache["ttft_p90_ms"], cache["hit_rate"]) == (160, 500, 0.86)
    assert cache["ttft_p90_ms_rounds"] == [800, 340, 500] and "ttft_ms_by_request" not in cache
    assert (rr["hit_rate"], rr["hit_rate_rounds"]) == (0.27, [0.25, None, 0.27])  # a missing figure skipped
    assert (cache["completed"], cache["sent"], "round" in cache) == (24, 24, False)
    g = d.goals(rows)
    assert g["multi_tenant_ttft_p90_cache_over_rr"] == pytest.approx(500 / 1400)
    one = d.merge_rounds(runs[:2])  # one round: the runs as they are
    assert one[0]["ttft_ms_by_request"] == [1.0] and "ttft_p90_ms_rounds" not in one[0]


def test_agentic_quick(tmp_path: Path) -> None:
    """bench/agentic.py --quick on a tiny random Llama: sessions come back after others evicted their
    blocks; with the host tier their prefixes are loaded, not recomputed."""
    model = make_tiny_llama(tmp_path / "m")
    out = tmp_path / "agentic.json"
    proc = _run(
        "agentic.py",
        *("--model", str(model), "--quick", "--vocab", "200", "--threads", "1", "--json", str(out)),
        *("--commit", "deadbeef", "--disk-gib", "0.01"),
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    d = json.loads(out.read_text())
    assert (
        d["commit"] == "deadbeef" and json.loads(proc.stdout.strip().splitlines()[-1])["bench"] == "agentic"
    )
    tier, none = d["runs"]["host_tier"], d["runs"]["no_tier"]
    assert tier["returning_turns"] == none["returning_turns"] == 3
    assert tier["tier_hit_tokens"] > 0 and none["tier_hit_tokens"] == 0
    assert tier["cached_fraction"] > none["cached_fraction"]
    assert d["no_hit_throughput_ratio"] > 0
    # the engines held side by side, one throughput each per round
    assert {k: len(v) for k, v in d["no_hit_tok_s"].items()} == {"no_tier": 2, "host_tier": 2, "disk_tier": 2}
    disk = d["runs"]["disk_tier"]  # the disk tier behind the host tier: the same hits, files written too
    assert disk["tier_hit_tokens"] == tier["tier_hit_tokens"] and d["no_hit_disk_throughput_ratio"] > 0


def test_hybrid_prefix_quick(tmp_path: Path) -> None:
    """bench/hybrid_prefix.py --quick on its tiny random Qwen3.5: the second turn of each session is served
    from the first turn's KV blocks and state snapshot up to the last block boundary the first turn computed,
    and the snapshot costs the state of the three linear-attention layers."""
    out = tmp_path / "hybrid.json"
    proc = _run(
        "hybrid_prefix.py",
        *("--quick", "--threads", "1", "--json", str(out), "--commit", "deadbeef"),
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    d = json.loads(out.read_text())
    assert d["commit"] == "deadbeef"
    assert json.loads(proc.stdout.strip().splitlines()[-1])["bench"] == "hybrid_prefix"
    turn = d["config"]["turn_len"]
    assert sorted(int(n) for n in d["sessions"]) == [48, 80]
    for n, s in d["sessions"].items():
        # the first turn computed its prompt and all but its last output token
        assert s["prompt_tokens"] == int(n) and s["cached_tokens"] == (int(n) - turn - 1) // 16 * 16, s
        assert s["ttft_cached_s"] > 0 and s["ttft_cold_s"] > 0 and s["ttft_ratio"] > 0
        assert 0 < s["decode_linear_layers_ms"] < s["decode_step_ms"]
    mem = d["memory"]
    # 3 linear layers x (conv 192 channels x 3 + state 1 head x 64 x 64) float32, one per 16-token block
    assert mem["snapshot_bytes"] == 3 * (192 * 3 + 64 * 64) * 4
    assert mem["snapshot_bytes_per_1k_tokens"] == mem["snapshot_bytes"] * 1000 / 16
    assert mem["full_attention_kv_bytes_per_1k_tokens"] == 2 * 64 * 4 * 1000


def test_vision_quick(tmp_path: Path) -> None:
    """bench/vision.py --quick on a tiny random Gemma 3 with images: the repeated batch runs no encoder (its
    images are in cached prefix blocks or the encoder cache) and its prompts hit the prefix cache. The
    script runs the installed pagedrs."""
    model = make_gemma3_vision(tmp_path / "m")
    out = tmp_path / "vision.json"
    proc = _run(
        "vision.py",
        *("--model", str(model), "--quick", "--sizes", "40x30,20x50", "--dtype", "float32"),
        *("--json", str(out), "--commit", "deadbeef"),
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    d = json.loads(out.read_text())
    assert d["commit"] == "deadbeef" and json.loads(proc.stdout.strip().splitlines()[-1])["bench"] == "vision"
    for row in d["rows"]:
        cold, repeat = row["cold"], row["repeat"]
        assert cold["encoder_runs"] == 2 * row["images_per_request"] and repeat["encoder_runs"] == 0
        assert repeat["cached_prompt_tokens"] > cold["cached_prompt_tokens"]


def test_cpu_large_vocab_times_both_top_p_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """The head and sampler figures of one small table at 1 and 16 rows; `sorting` forces the sorted top-p
    path while it is open (and only then)."""
    from pagedrs.layers import sampler

    bench = _load("cpu_large_vocab", monkeypatch)
    w = bench.QuantizedWeight([bench.random_table(8, 512, 64, 32, 34, 0)])
    for b in (1, 16):
        got = bench.batch_figures(w, w.dequantized(), b, 2)
        for name in ("head", "float32_head", "greedy_sampler", "top_k_top_p_window", "top_k_top_p_sorted"):
            assert got[f"{name}_ms_b{b}"] > 0
        assert 0 < got[f"max_abs_diff_b{b}"] < 0.05 * got[f"max_abs_logit_b{b}"]
    real = sampler._top_k_then_top_p
    with bench.sorting(True):
        assert sampler._top_k_then_top_p is not real
    assert sampler._top_k_then_top_p is real
