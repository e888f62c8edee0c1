"""bench/kquant_gguf.py: the per-tensor types of llama.cpp's Q4_K_M recipe, and a written file's blocks
(types, finite weights of the intended size, the padded tokenizer); bench/_cpu_roofline.py's bytes per
token of that file; bench/cpu_peer.py's prefill rows."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import pytest

from pagedrs.loader.gguf_reader import field_value, open_gguf

BENCH = Path(__file__).resolve().parents[1] / "bench"
Q = gguf.GGMLQuantizationType


def _load(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def kq(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return _load("kquant_gguf", monkeypatch)


def test_q4_k_m_recipe(kq: ModuleType) -> None:
    n = 24  # Qwen2.5-0.5B: more bits on layers 0-2, 21-23 and 5, 8, ..., 20
    more = [i for i in range(n) if kq.use_more_bits(i, n)]
    assert more == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]
    t = kq.q4_k_m_type
    # rows of 896 are no multiple of 256: Q4_K falls back to Q5_0, Q6_K to Q8_0
    assert t("token_embd.weight", 896, 0, n, tied=True) == Q.Q8_0
    assert t("token_embd.weight", 896, 0, n, tied=False) == Q.Q5_0
    assert t("blk.3.attn_q.weight", 896, 3, n, tied=True) == Q.Q5_0
    assert t("blk.0.attn_v.weight", 896, 0, n, tied=True) == Q.Q8_0
    assert t("blk.3.attn_v.weight", 896, 3, n, tied=True) == Q.Q5_0
    assert t("blk.5.ffn_down.weight", 4864, 5, n, tied=True) == Q.Q6_K
    assert t("blk.4.ffn_down.weight", 4864, 4, n, tied=True) == Q.Q4_K
    assert t("blk.4.ffn_up.weight", 1024, 4, n, tied=True) == Q.Q4_K
    assert t("output.weight", 1024, 0, n, tied=False) == Q.Q6_K


def test_written_file(kq: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    tiny = kq.Family("gemma3", 2, 320, 512, 2, 1, 64, 50000, 1e6, 1e-6, sliding_window=64)
    monkeypatch.setitem(kq.FAMILIES, "tiny", tiny)
    path = kq.write_family("tiny", tmp_path)
    r = open_gguf(path)
    types = {t.name: Q(int(t.tensor_type)) for t in r.tensors}
    assert types["token_embd.weight"] == Q.Q8_0
    assert types["blk.0.attn_q.weight"] == Q.Q5_0
    assert types["blk.0.ffn_down.weight"] == Q.Q4_K  # 512 is a K row
    assert types["blk.1.ffn_down.weight"] == Q.Q6_K  # the last eighth of the layers gets more bits
    assert types["blk.0.attn_q_norm.weight"] == Q.F32
    assert len(field_value(r, "tokenizer.ggml.tokens")) == 50000
    assert field_value(r, "gemma3.attention.sliding_window") == 64
    matrices = [t for t in r.tensors if len(t.shape) == 2]
    roofline = _load("_cpu_roofline", monkeypatch)
    # tied: the head reads the whole embedding table, so every matrix counts once
    assert roofline.weight_bytes_per_token(str(path)) == sum(int(t.n_bytes) for t in matrices)
    for t in r.tensors:
        if len(t.shape) == 2:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
            rms = float(np.sqrt(np.mean(np.square(w, dtype=np.float64))))
            assert np.isfinite(w).all() and 0.005 < rms < 0.05, (t.name, rms)


def test_prefill_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    peer = _load("cpu_peer", monkeypatch)
    prompt = peer.make_long_prompt(512, 3)
    assert len(prompt.split()) == 512 and prompt == peer.make_long_prompt(512, 3)
    assert prompt != peer.make_long_prompt(512, 4)
    ours = [{"prompt_words": 512, "prompt_tokens": [512, 512], "ttft_p50_ms": 300.0}]
    theirs = [{"prompt_words": 512, "prompt_tokens": [513], "ttft_p50_ms": 200.0}]
    (line,) = peer.prefill_lines(ours, theirs)
    assert line == "prompt 512 tokens: TTFT p50 300 ms (pagedrs) vs 200 ms (llama.cpp, 513 tokens) = 1.50x"
    assert peer.prefill_lines(ours, [])[0].endswith("llama.cpp not run")


def test_help_from_outside_the_repo(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "kquant_gguf.py"), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--family" in proc.stdout
