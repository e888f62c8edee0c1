"""Shared test helpers: tiny random HF model folders (config.json + weights + a byte-level tokenizer).

Stable API (other test packages import it as `from tests.helpers import ...`):

    make_tiny_llama(tmp_path, arch="llama", **config_overrides) -> Path
    make_tiny_model(tmp_path, config, *, seed=0, weights_format="safetensors", num_shards=1) -> Path
    make_tokenizer() -> PreTrainedTokenizerFast;  save_tokenizer(path) -> None
    load_hf_model(path) -> transformers model (float32, eval)
    make_step_metadata(...) -> AttentionMetadata for a hand-made batch (no scheduler needed)
    child_pids(pid), cmdline(pid), process_gone(pid) -> processes, read from /proc (Linux)

arch: "llama" (Llama 2 style), "llama3" (Llama 3.1 rope scaling), "qwen2" (q/k/v bias), "mistral"
(sliding window; pass sliding_window=...), "smollm2" (tied embeddings). weights_format: "safetensors"
or "bin" (pytorch_model.bin); num_shards > 1 writes a sharded checkpoint with its index json.
The tokenizer maps each byte of UTF-8 text to one token (ids 0..255); <s>=256, </s>=257, <pad>=258;
vocab_size of the tiny models is 320, so any text round-trips.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from pagedrs.sampling_params import SamplingParams

VOCAB_SIZE = 320
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)

_BASE: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
    tie_word_embeddings=False,
)

_ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama3": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "qwen2": ("Qwen2Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": 4096}),
    "smollm2": ("LlamaConfig", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
}


def make_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level tokenizer: no merges, one token per UTF-8 byte, plus <s>, </s>, <pad>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", "<pad>"])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(path: str | Path) -> None:
    make_tokenizer().save_pretrained(str(path))


def make_config(arch: str = "llama", **overrides: Any) -> transformers.PretrainedConfig:
    if arch not in _ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {sorted(_ARCHS)}")
    cls_name, extra = _ARCHS[arch]
    kwargs = {**_BASE, **extra, **overrides}
    return getattr(transformers, cls_name)(**kwargs)


def make_tiny_model(
    path: str | Path,
    config: transformers.PretrainedConfig,
    *,
    seed: int = 0,
    weights_format: str = "safetensors",
    num_shards: int = 1,
    tokenizer: bool = True,
) -> Path:
    """Random HF model for `config` saved in `path` (created), with the byte-level tokenizer."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF initialises with std 0.02; larger weights give more varied logits
        for p in model.parameters():
            p.normal_(0.0, 0.2 if p.dim() > 1 else 0.1)
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.add_(1.0)
    model.eval()
    if weights_format == "safetensors":
        shard = _shard_bytes(model, num_shards)
        model.save_pretrained(str(path), max_shard_size=shard if num_shards > 1 else "50GB")
    elif weights_format == "bin":
        model.config.save_pretrained(str(path))
        _save_bin(model.state_dict(), path, num_shards)
    else:
        raise ValueError(f"unknown weights_format {weights_format!r}")
    if tokenizer:
        save_tokenizer(path)
    return path


def make_tiny_llama(tmp_path: str | Path, arch: str = "llama", **overrides: Any) -> Path:
    """A tiny random Llama-family model folder under tmp_path (hidden 64, 2 layers, vocab 320).

    Keyword arguments that are not config fields: seed, weights_format, num_shards, tokenizer, subdir."""
    opts = {
        k: overrides.pop(k) for k in ("seed", "weights_format", "num_shards", "tokenizer") if k in overrides
    }
    subdir = overrides.pop("subdir", f"tiny-{arch}")
    config = make_config(arch, **overrides)
    return make_tiny_model(Path(tmp_path) / subdir, config, **opts)


def load_hf_model(path: str | Path, **kwargs: Any) -> transformers.PreTrainedModel:
    """The HF transformers model for a folder, float32, eval mode (the reference in equivalence tests)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kwargs)
    return model.eval()


def hf_greedy_q8_0_rounded(
    src: str | Path, prompt: list[int], n: int, rounded: Callable[[str, torch.Tensor], bool]
) -> list[int]:
    """HF transformers' greedy ids (float32) on the model at `src` with every parameter `rounded(name, p)`
    picks quantized to Q8_0 and dequantized: the weights a Q8_0 run of pagedrs multiplies."""
    import gguf

    model = load_hf_model(src)
    qt = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if rounded(name, p):
                a = p.detach().numpy()
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(a, qt), qt)))
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, eos_token_id=[]
        )
    return out[0, len(prompt) :].tolist()


def _shard_bytes(model: torch.nn.Module, num_shards: int) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return max(1, math.ceil(total / num_shards))


def _save_bin(state: dict[str, torch.Tensor], path: Path, num_shards: int) -> None:
    state = {k: v.detach().clone().contiguous() for k, v in state.items()}
    if num_shards <= 1:
        torch.save(state, path / "pytorch_model.bin")
        return
    names = list(state)
    per = math.ceil(len(names) / num_shards)
    weight_map: dict[str, str] = {}
    for i in range(num_shards):
        chunk = names[i * per : (i + 1) * per]
        fname = f"pytorch_model-{i + 1:05d}-of-{num_shards:05d}.bin"
        torch.save({k: state[k] for k in chunk}, path / fname)
        weight_map.update(dict.fromkeys(chunk, fname))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())}}
    index["weight_map"] = weight_map  # type: ignore[assignment]
    (path / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2))


def make_step_metadata(
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    *,
    block_size: int,
    num_blocks: int,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> tuple[Any, torch.Tensor]:
    """AttentionMetadata for requests with context `seq_lens` whose last `query_lens` tokens are new this
    step, each on randomly chosen distinct blocks. Returns (metadata, positions [T])."""
    from pagedrs.layers.attention import AttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    if sum(need) > num_blocks:
        raise ValueError(f"need {sum(need)} blocks, pool has {num_blocks}")
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(need) if need else 1
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slots: list[int] = []
    positions: list[int] = []
    qsl = [0]
    start = 0
    for b, (s, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
        blocks = perm[start : start + need[b]]
        start += need[b]
        tables[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for pos in range(s - q, s):
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        qsl.append(qsl[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens),
        max_query_len=max(query_lens) if query_lens else 0,
        max_seq_len=max(seq_lens) if seq_lens else 0,
        block_size=block_size,
        num_decode_tokens=sum(1 for q in query_lens if q == 1),
    )
    return meta, torch.tensor(positions, dtype=torch.int64, device=device)


_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def make_tiny_gguf(
    tmp_path: str | Path, arch: str = "llama", *, qtype: str = "Q8_0", **overrides: Any
) -> Path:
    """A tiny random model written as a GGUF file the way llama.cpp's converter writes it (Q/K rows
    permuted for Llama, matrices quantized to `qtype` ("Q8_0", "F16" or "F32"), byte-level tokenizer).
    Returns the .gguf path; its source HF folder is the sibling `<stem>-src`.
    arch: "llama" or "qwen2"."""
    import gguf
    import numpy as np

    tmp_path = Path(tmp_path)
    src = make_tiny_llama(tmp_path, arch, subdir=f"tiny-{arch}-gguf-src", **overrides)
    hf = load_hf_model(src)
    cfg = hf.config
    state = hf.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out = tmp_path / f"tiny-{arch}.gguf"
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    tok = make_tokenizer()
    tokens = [f"<extra_{i}>" for i in range(cfg.vocab_size)]
    for t, i in tok.get_vocab().items():
        tokens[i] = t
    tokens[259] = "ab"  # transformers' GGUF reader wants at least one merge
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * (cfg.vocab_size - 256))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_pad_token_id(PAD_ID)
    w.add_chat_template(CHAT_TEMPLATE)
    heads = {"self_attn.q_proj": cfg.num_attention_heads, "self_attn.k_proj": cfg.num_key_value_heads}
    for name, tensor in state.items():
        a = tensor.numpy()
        if name in _GGUF_GLOBAL:
            gname = _GGUF_GLOBAL[name]
        else:
            parts = name.split(".")
            module = ".".join(parts[3:-1])
            gname = f"blk.{parts[2]}.{_GGUF_BLOCK[module]}.{parts[-1]}"
            if arch == "llama" and module in heads:  # llama.cpp's permute
                n = heads[module]
                a = a.reshape(n, 2, a.shape[0] // n // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        if a.ndim == 2 and qtype != "F32":
            qt = getattr(gguf.GGMLQuantizationType, qtype)
            q = gguf.quants.quantize(np.ascontiguousarray(a), qt)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=qt)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# ---- processes (Linux /proc): what a test needs to check that no process is left behind ----------------
def child_pids(pid: int) -> list[int]:
    """The direct children of `pid`."""
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(x) for x in (task / "children").read_text().split()]
    return kids


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def process_gone(pid: int) -> bool:
    """No such process, or a zombie (gone for our purposes: its parent or init reaps it)."""
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


# The continuous-batching notebook's server command line (the flags after the module name), as the notebook runs it.
SEED_003_SERVER_FLAGS = [
    "--enable-chunked-prefill",
    "--disable-sliding-window",
    "--max-num-batched-tokens=12",
    "--max-num-seqs=12",
    "--dtype=half",
    "--enable-log-batch-visualization",
]


@dataclass
class SamplerRow:
    """One sequence as the sampler reads it (layers/sampler.SamplingRow), built from SamplingParams."""

    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    is_simple_greedy: bool = False

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def __post_init__(self) -> None:
        p = self.params
        if p.seed is not None and p.temperature > 0:
            self.generator = torch.Generator().manual_seed(p.seed)
        self.is_simple_greedy = (
            p.temperature == 0
            and not p.needs_penalties
            and p.logprobs is None
            and not p.min_tokens
            and not p.logit_bias
        )


def plan_fields() -> list[str]:
    """The properties `_core.pyi` declares on `StepPlan` (the one Python declaration of the plan)."""
    import ast

    import pagedrs

    stub = Path(pagedrs.__file__).with_name("_core.pyi")
    tree = ast.parse(stub.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StepPlan")
    return [
        f.name
        for f in cls.body
        if isinstance(f, ast.FunctionDef) and any(ast.unparse(d) == "property" for d in f.decorator_list)
    ]


# Greedy runs over an fp8 KV cache, compared across batch shapes, rank counts or machines (in nats of a
# sampled token's logprob). e4m3 keeps 3 mantissa bits: a K/V element that lands near a rounding boundary
# moves by one ulp (2^-3 of its value) when float32 matmuls over a different batch shape (chunked prefill,
# preemption, prefix hits, tensor-parallel all-reduces, another CPU or thread count) change its last bits.
# Two ulps of that relative precision bound the same token's logprob in the two runs (measured on the
# default model: at most 0.063 on the CI-class machine with 1 and 2 threads).
FP8_SAME_CACHE_TOL = 2 * 2**-3
# The same token against a float32 cache: every element rounded (half an ulp, 2^-4) across 30 layers;
# measured at most 0.32 on the default model. Bound: 1 nat.
FP8_VS_F32_TOL = 1.0
# Where two greedy runs first pick different tokens, the run that picked first must have seen a near tie.
NEAR_TIE = 2 * FP8_SAME_CACHE_TOL


def greedy_agreement(a: tuple[list[int], list[Any]], b: tuple[list[int], list[Any]], tol: float) -> int:
    """Greedy ids and top-k logprobs (`CompletionOutput.logprobs`) of two runs of one prompt: equal up to
    their first difference with the same tokens' logprobs within `tol`; at the first difference each
    run's token is in the other's top k within NEAR_TIE + tol of its pick. Returns the length of the
    common prefix."""
    (ids_a, lps_a), (ids_b, lps_b) = a, b
    for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=True)):
        if x == y:
            assert abs(lps_a[i][x].logprob - lps_b[i][y].logprob) <= tol, (i, lps_a[i][x], lps_b[i][y])
            continue
        assert y in lps_a[i] and x in lps_b[i], f"token {i}: {y} not in {lps_a[i]} or {x} not in {lps_b[i]}"
        assert lps_a[i][x].logprob - lps_a[i][y].logprob <= NEAR_TIE + tol, (i, lps_a[i])
        assert lps_b[i][y].logprob - lps_b[i][x].logprob <= NEAR_TIE + tol, (i, lps_b[i])
        return i
    return len(ids_a)


def logits_of(loaded: Any, ids: list[int]) -> torch.Tensor:
    """A loaded model's logits over one prompt run as a single prefill (no KV cache)."""
    from pagedrs.layers.attention import ForwardContext

    m = loaded.model
    with torch.no_grad():
        return m.compute_logits(m(torch.tensor(ids), torch.arange(len(ids)), ForwardContext(None, [], None)))


def greedy_by_logits(loaded: Any, ids: list[int], steps: int = 6) -> list[int]:
    """`steps` greedy tokens after `ids`, each from a full recompute (`logits_of`)."""
    ids = list(ids)
    for _ in range(steps):
        ids.append(int(logits_of(loaded, ids)[-1].argmax()))
    return ids[-steps:]
