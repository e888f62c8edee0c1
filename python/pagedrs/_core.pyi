"""Type stubs for pagedrs._core (the Rust scheduler and block pool, built with PyO3)."""

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

class PagedrsError(Exception):
    """Base class of every pagedrs core error."""

class InvalidRequestError(PagedrsError, ValueError):
    """A bad value from the caller (too long, duplicate id, bad argument...)."""

class OutOfBlocksError(PagedrsError):
    """The pool cannot hold what is asked."""

class ResizeError(PagedrsError, ValueError):
    """The pool cannot be resized as asked."""

class UnknownRequestError(PagedrsError, KeyError):
    """No such seq id."""

class SchedulerPoisonedError(PagedrsError):
    """A panic inside an earlier call left the scheduler unusable: restart the engine."""

def kernel_source(name: str) -> str: ...
def kernel_names() -> list[str]: ...
def paged_decode_attention(
    q: npt.NDArray[np.float32],
    kv_cache: npt.NDArray[np.float32],
    block_tables: npt.NDArray[np.int32],
    seq_lens: npt.NDArray[np.int32],
    out: npt.NDArray[np.float32],
    scale: float,
    sliding_window: int | None = None,
    num_threads: int = 1,
    logits_soft_cap: float | None = None,
    isa: str | None = None,
    sinks: npt.NDArray[np.float32] | None = None,
) -> None:
    """Paged decode attention on CPU (one query token per sequence), written into ``out``; GIL released.

    q/out float32 [B, H, D]; kv_cache float32 [2, num_blocks, block_size, KVH, D]; block_tables int32 [B, M];
    seq_lens int32 [B] (context including the query token). All C-contiguous; ValueError otherwise.
    Scores are ``scale * q.k``, then ``logits_soft_cap * tanh(s / logits_soft_cap)`` when it is given (HF's
    Gemma 2 attention soft-capping; a positive number). Any head size (64, 128 and 256 compiled for).
    ``isa``: the kernels (a ``quant_isa()`` name, capped to what this CPU runs; default the chosen ones).
    ``sinks`` float32 [H]: a logit per query head that joins every softmax (its max and denominator) and
    adds no value, as gpt-oss's attention sinks."""

def moe_experts(
    x: npt.NDArray[np.float32],
    gate_up: npt.NDArray[np.float32] | npt.NDArray[np.uint8],
    down: npt.NDArray[np.float32] | npt.NDArray[np.uint8],
    topk_ids: npt.NDArray[np.int64],
    topk_weights: npt.NDArray[np.float32],
    out: npt.NDArray[np.float32],
    gate_up_type: int | None = None,
    down_type: int | None = None,
    num_threads: int = 1,
    isa: str | None = None,
    gate_up_bias: npt.NDArray[np.float32] | None = None,
    down_bias: npt.NDArray[np.float32] | None = None,
    swiglu: tuple[float, float] | None = None,
    gate_up_packed: bool = False,
    down_packed: bool = False,
) -> None:
    """The fused experts step of a mixture-of-experts layer, written into `out`; GIL released:
    out[t] = sum over s of topk_weights[t, s] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = topk_ids[t, s],
    slots summed in order; the (token, slot) pairs sorted by expert once, each active expert's weights read
    once for all its rows.

    x float32 [T, H]; gate_up [E, 2I, H] (each expert's gate rows then its up rows) and down [E, H, I],
    float32, or uint8 [E, rows, row_bytes] GGUF rows where ``gate_up_type`` / ``down_type`` name their GGML
    type; topk_ids int64 [T, k] (each in 0..E); topk_weights float32 [T, k]; out float32 [T, H].
    gate_up_bias float32 [E, 2I] / down_bias [E, H]: the experts' biases (added after each projection);
    swiglu (alpha, limit): gpt-oss's clamped SwiGLU, (up + 1) * g * sigmoid(alpha * g) with g = min(gate,
    limit) and up clamped to +-limit, instead of silu(gate) * up. gate_up_packed / down_packed: that GGUF
    weight in the 8-row interleaved layout (``quant_pack_x8`` of it as [E * rows, row_bytes]; a type it
    takes, rows a multiple of 8), on the dense packed kernels.
    ValueError naming the array or the id on a bad argument."""

def quant_matmul(
    x: npt.NDArray[np.float32],
    weight: npt.NDArray[np.uint8],
    ggml_type: int,
    out: npt.NDArray[np.float32],
    col0: int = 0,
    num_threads: int = 1,
    packed: bool = False,
    isa: str | None = None,
) -> None:
    """out[:, col0:col0 + N] = x @ W^T with W kept in a GGUF block layout; GIL released. `isa`: the
    kernels (a `quant_isa()` name; default the chosen ones; ones this CPU lacks give way to the nearest
    ones below that it runs; ValueError for a name of no kernel set of this architecture).

    x float32 [M, K]; weight uint8 [N, row_bytes] (each row its GGUF blocks of type ``ggml_type``, a
    ``gguf.GGMLQuantizationType`` value; with ``packed``, the layout of ``quant_pack_x8``); out float32
    [M, ldo]. ValueError on a bad shape or type."""

def quant_pack_x8(weight: npt.NDArray[np.uint8], ggml_type: int) -> npt.NDArray[np.uint8]:
    """W (uint8 [N, row_bytes] of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K blocks, N a multiple of 8)
    repacked 8 rows at a time for ``quant_matmul(..., packed=True)``: a new array of the same shape.
    ValueError otherwise."""

def quant_get_rows(
    weight: npt.NDArray[np.uint8],
    ggml_type: int,
    ids: npt.NDArray[np.int64],
    out: npt.NDArray[np.float32],
    packed: bool = False,
) -> None:
    """out[i] = dequantized row ids[i] of the GGUF-quantized weight (an embedding lookup); ``packed``: the
    weight is in the layout of ``quant_pack_x8``."""

def quant_type_ids() -> list[int]:
    """GGML type ids the quantized kernels take (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4)."""

def quant_isa() -> str:
    """The kernels quant_matmul runs on this CPU: "avx512-vnni" (the AVX2 kernels with AVX-512 VNNI in
    the x8 ones), "avx2", "neon-dotprod", "neon" or "portable"; `PAGEDRS_CPU_ISA` may name a lower
    supported one (read once per process)."""

def cpu_pool_workers() -> int:
    """Worker threads of the CPU kernels' pool (the calling thread is one more)."""

def cpu_rms_norm(
    x: npt.NDArray[np.float32], weight: npt.NDArray[np.float32], eps: float, out: npt.NDArray[np.float32]
) -> None:
    """out = rms_norm(x) * weight per row; x/out float32 [T, H], weight [H]."""

def cpu_fused_add_rms_norm(
    x: npt.NDArray[np.float32],
    residual: npt.NDArray[np.float32],
    weight: npt.NDArray[np.float32],
    eps: float,
) -> None:
    """In place per row: residual += x, then x = rms_norm(residual) * weight."""

def cpu_silu_and_mul(x: npt.NDArray[np.float32], out: npt.NDArray[np.float32]) -> None:
    """out = silu(x[:, :d]) * x[:, d:]; x float32 [T, 2d], out [T, d]."""

def cpu_argmax_logsumexp(
    x: npt.NDArray[np.float32],
    ids: npt.NDArray[np.int64],
    lse: npt.NDArray[np.float32],
    num_threads: int = 1,
) -> None:
    """Per row of x float32 [R, V]: ids[r] = the first index of its max (of its first NaN), lse[r] = its
    logsumexp (NaN with a NaN)."""

def cpu_lora_add(
    x: npt.NDArray[np.float32],
    a: npt.NDArray[np.float32],
    bt: npt.NDArray[np.float32],
    slots: npt.NDArray[np.int64],
    out: npt.NDArray[np.float32],
    col0: int = 0,
    num_threads: int = 1,
    cols: npt.NDArray[np.int64] | None = None,
) -> None:
    """LoRA deltas of a batch mixing adapters: for each row i with slots[i] >= 0, out[i, col0:col0 + W] +=
    (a[s] @ x[i]) @ bt[s]. x float32 [T, K]; a [S, R, K]; bt [S, R, W] (B transposed, scaling folded in);
    slots int64 [T] (-1: no delta); out float32 [T, ldo]; cols int64 [R, 2]: each rank row's output
    columns [start, end) within 0..W (default: all)."""

def cpu_rope_neox(
    positions: npt.NDArray[np.int64],
    q: npt.NDArray[np.float32],
    k: npt.NDArray[np.float32],
    cos_sin: npt.NDArray[np.float32],
    head_size: int,
    rotary_dim: int,
) -> None:
    """Rotary embedding (neox) in place on q [T, Hq*D] and k [T, Hk*D] (rows may be spaced, last dim
    contiguous); cos_sin float32 [P, rotary_dim] (cos | sin)."""

def cpu_gated_delta_decode(
    qkv: npt.NDArray[np.float32],
    a: npt.NDArray[np.float32],
    b: npt.NDArray[np.float32],
    slots: npt.NDArray[np.int64],
    conv_weight: npt.NDArray[np.float32],
    a_log: npt.NDArray[np.float32],
    dt_bias: npt.NDArray[np.float32],
    conv_state: npt.NDArray[np.float32],
    ssm_state: npt.NDArray[np.float32],
    out: npt.NDArray[np.float32],
    num_k_heads: int,
    isa: str | None = None,
) -> None:
    """One token per row through a Gated DeltaNet layer's causal conv1d (SiLU) and gated delta rule, in place
    on the state pools: qkv [B, conv_dim], a/b [B, value heads], slots int64 [B], conv_weight [conv_dim,
    kernel], a_log/dt_bias [value heads], conv_state [slots, conv_dim, kernel - 1], ssm_state [slots, value
    heads, head_k, head_v], out [B, value heads * head_v]; float32, C-contiguous."""

class FinishReason:
    """Why the scheduler finished a sequence. `value` is OpenAI's name: "stop" or "length"."""

    STOP: FinishReason
    LENGTH: FinishReason
    @property
    def value(self) -> str: ...

class SchedulerStats:
    """A snapshot of the scheduler's queues, pool and counters."""

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_swapped(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def kv_usage(self) -> float:
        """The fullest pool's usage (0..1): the full-attention pool's, or a KV-cache group's when one is
        fuller (the pool that limits admission)."""
    @property
    def group_kv_usage(self) -> list[float]:
        """Each KV-cache group's pool usage (0..1), in group order."""
    @property
    def num_swap_blocks(self) -> int: ...
    @property
    def num_free_swap_blocks(self) -> int: ...
    @property
    def prefix_cache_queries(self) -> int: ...
    @property
    def prefix_cache_hits(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def spec_num_drafts(self) -> int:
        """Speculative decoding: verification rows so far (a sequence that speculated in a step)."""
    @property
    def spec_num_draft_tokens(self) -> int: ...
    @property
    def spec_num_accepted_tokens(self) -> int: ...
    @property
    def spec_num_pauses(self) -> int:
        """Engine-wide pauses of speculation measured slower than plain decoding (`spec_adaptive`)."""
    @property
    def num_tier_blocks(self) -> int:
        """The host KV tier's blocks (0: no tier), and those holding a block."""
    @property
    def num_used_tier_blocks(self) -> int: ...
    @property
    def tier_queried_blocks(self) -> int:
        """Blocks looked up in the tier after the pool's prefix hit ended, and those found."""
    @property
    def tier_hit_blocks(self) -> int: ...
    @property
    def tier_stored_blocks(self) -> int:
        """Blocks copied into the tier, out of it (into the pool), and dropped to make room."""
    @property
    def tier_loaded_blocks(self) -> int: ...
    @property
    def tier_evicted_blocks(self) -> int: ...

class StepPlan:
    """One scheduler step. Every array is a numpy array owned by the plan.

    Runner order of block ops: grow the pool if num_blocks > current; tier_store; block_moves;
    swap_out; swap_in; tier_load; copies; forward; shrink the pool if num_blocks < current.
    """

    @property
    def step_id(self) -> int: ...
    @property
    def req_ids(self) -> npt.NDArray[np.int64]: ...
    @property
    def num_scheduled_tokens(self) -> npt.NDArray[np.int32]: ...
    @property
    def num_computed_tokens(self) -> npt.NDArray[np.int32]: ...
    @property
    def num_prompt_tokens(self) -> npt.NDArray[np.int32]: ...
    @property
    def seq_lens(self) -> npt.NDArray[np.int32]: ...
    @property
    def query_start_loc(self) -> npt.NDArray[np.int32]: ...
    @property
    def input_ids(self) -> npt.NDArray[np.int64]: ...
    @property
    def positions(self) -> npt.NDArray[np.int64]: ...
    @property
    def slot_mapping(self) -> npt.NDArray[np.int64]: ...
    @property
    def block_tables(self) -> npt.NDArray[np.int32]:
        """int32 [B, max_blocks], padded with 0: `block_table_view()[block_table_rows, :max_blocks]`.

        Built on first read (a copy of B rows: read block_table_rows instead where you can). Raises
        PagedrsError if first read after the next schedule(), which may have rewritten those rows.
        """
    @property
    def block_table_rows(self) -> npt.NDArray[np.int32]:
        """int32 [B]: the row of Scheduler.block_table_view() holding each batch entry's blocks."""
    @property
    def changed_rows(self) -> npt.NDArray[np.int32]:
        """int32 [k], distinct: rows of Scheduler.block_table_view() that this plan's schedule()
        rewrote. A device copy of the table that applies them (`dev[rows] = view[rows]`) before
        every forward stays equal to the view."""
    @property
    def logits_indices(self) -> npt.NDArray[np.int64]:
        """int64: hidden rows whose logits are wanted, one per sampled sequence, or 1 + d consecutive
        rows for a sequence speculating with d drafts (row j predicts the token after draft j)."""
    @property
    def sampled_seq_ids(self) -> npt.NDArray[np.int64]: ...
    @property
    def num_draft_tokens(self) -> npt.NDArray[np.int32]:
        """int32 [S]: draft tokens of each sampled sequence in this step (0: not speculating)."""
    @property
    def draft_token_ids(self) -> npt.NDArray[np.int64]:
        """int64: the drafts, flattened in sampled order (the sequence's last token as a placeholder
        when the runner's drafter proposes; the runner writes the real drafts into its inputs)."""
    @property
    def has_drafts(self) -> bool: ...
    @property
    def num_groups(self) -> int:
        """KV-cache groups beside the full-attention pool whose tables this plan carries."""
    @property
    def group_slot_mapping(self) -> npt.NDArray[np.int64]:
        """int64 [G, T]: each KV-cache group's slot of every token."""
    @property
    def group_block_tables(self) -> npt.NDArray[np.int32]:
        """int32 [G, B, max_blocks]: each KV-cache group's block tables, padded with 0 (as are entries a
        group no longer holds: the kernels mask them by the window)."""
    @property
    def group_copies(self) -> npt.NDArray[np.int64]:
        """int64 [k, 2]: copy-on-write pairs (src, dst) to apply to each group's blocks before the forward,
        in group order (`group_num_copies` per group)."""
    @property
    def group_num_copies(self) -> npt.NDArray[np.int32]:
        """int32 [G]: the pairs of each group in `group_copies`."""
    @property
    def group_swap_out(self) -> npt.NDArray[np.int64]:
        """int64 [k, 3]: (group, device block, swap block) of every group's blocks to swap out (after
        `swap_out`)."""
    @property
    def group_swap_in(self) -> npt.NDArray[np.int64]:
        """int64 [k, 3]: (group, swap block, device block) of every group's blocks to swap in (after
        `swap_in`)."""
    @property
    def group_block_moves(self) -> npt.NDArray[np.int64]:
        """int64 [k, 3]: (group, src, dst) moves of every group's blocks by a pool resize (with
        `block_moves`, before the other block ops)."""
    @property
    def group_num_blocks(self) -> npt.NDArray[np.int64]:
        """int64 [G]: each group's pool size after this plan (0 for a group without a pool)."""
    @property
    def swap_out(self) -> npt.NDArray[np.int64]: ...
    @property
    def swap_in(self) -> npt.NDArray[np.int64]: ...
    @property
    def copies(self) -> npt.NDArray[np.int64]: ...
    @property
    def block_moves(self) -> npt.NDArray[np.int64]: ...
    @property
    def preempted(self) -> npt.NDArray[np.int64]: ...
    @property
    def tier_store(self) -> npt.NDArray[np.int64]:
        """int64 [k, 2]: (device block, tier slot) pairs to copy into the host KV tier first."""
    @property
    def tier_load(self) -> npt.NDArray[np.int64]:
        """int64 [k, 2]: (tier slot, device block) pairs to copy from the host KV tier."""
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_prefill_tokens(self) -> int: ...
    @property
    def num_decode_tokens(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    def to_wire(
        self, extra_logits_indices: npt.NDArray[np.int64] | None = None
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """(header, payload): the plan, its dense block tables and the extra logits rows as two int64
        arrays for the tensor-parallel step broadcast (the header is STEP_WIRE_HEADER_LEN long)."""
    @staticmethod
    def from_wire(
        header: npt.NDArray[np.int64], payload: npt.NDArray[np.int64]
    ) -> tuple[StepPlan, npt.NDArray[np.int64]]:
        """(plan, extra_logits_indices) of a `to_wire` message; ValueError if it does not add up. The
        plan's block_tables came with it (there is no scheduler on the receiving side)."""

def prefix_extra_key(cache_salt: str | None = None) -> int:
    """The extra key the scheduler hashes into the first block of a request with this cache salt (0: none)."""

def prefix_root_hash(extra_key: int) -> int:
    """The parent hash of a request's first block (its blocks chain from it) under `extra_key`."""

def prefix_block_hashes(tokens: Sequence[int], block_size: int, extra_key: int = 0) -> list[int]:
    """The chained hashes (u64) of the full blocks of `tokens`, as the scheduler caches them."""

class KVEvents:
    """Prefix-cache events drained from the scheduler, in the order they happened."""

    def __len__(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def kinds(self) -> npt.NDArray[np.uint8]:
        """Per event: 0 a block became cached, 1 a cached block was evicted or dropped, 2 all cleared."""
    @property
    def hashes(self) -> npt.NDArray[np.uint64]:
        """Per event: the block's hash (0 for a clear)."""
    @property
    def parents(self) -> npt.NDArray[np.uint64]:
        """Per event: a stored block's parent hash (0 otherwise)."""
    @property
    def extra_keys(self) -> npt.NDArray[np.uint64]:
        """Per event: a stored block's extra key (`prefix_extra_key` of its salt; 0 otherwise)."""
    @property
    def tokens(self) -> npt.NDArray[np.uint32]:
        """The stored blocks' tokens, one row per stored event: [num_stored, block_size]."""
    def net(self) -> tuple[list[int], list[int], bool]:
        """(stored, removed, cleared): the net change; applied to the set before these events as clear,
        then remove, then store, it gives the set after them."""

STEP_WIRE_HEADER_LEN: int

class Scheduler:
    """Continuous-batching scheduler over a paged KV-cache block pool."""

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int = 16,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        max_model_len: int = 2048,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        num_swap_blocks: int = 0,
        watermark: float = 0.01,
        vocab_size: int | None = None,
        num_speculative_tokens: int = 0,
        spec_method: str | None = None,
        prompt_lookup_min: int = 1,
        prompt_lookup_max: int = 3,
        spec_disable_batch_size: int | None = None,
        spec_adaptive: bool = True,
        num_tier_blocks: int = 0,
    ) -> None:
        """`num_tier_blocks`: the host KV tier's blocks (its index; the runner holds the bytes).
        `num_speculative_tokens` > 0 turns on speculative decoding for requests added with
        `speculate=True`: `spec_method="ngram"` proposes drafts here by prompt lookup
        (`prompt_lookup_min/max`), `"runner"` (or None) reserves lookahead slots for the runner's
        drafter. Speculation pauses while more than `spec_disable_batch_size` sequences run;
        `spec_adaptive` shortens and pauses a sequence's proposals after rejections, and pauses all of them
        while the step times given to `observe_step_time` say speculation is slower."""
    def add_request(
        self,
        seq_ids: Sequence[int],
        prompt_token_ids: Sequence[int] | npt.NDArray[np.integer],
        *,
        max_tokens: int,
        min_tokens: int = 0,
        eos_token_ids: Sequence[int] = (),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        priority: int = 0,
        cache_salt: str | None = None,
        skip_prefix_cache: bool = False,
        speculate: bool = False,
    ) -> None: ...
    def set_atomic_spans(self, seq_id: int, spans: Sequence[tuple[int, int]]) -> None:
        """Prompt ranges (start, end) of `seq_id` a prefill chunk takes whole (never ends inside one)."""
    def set_encoder_budget(self, max_num_encoder_input_tokens: int) -> None:
        """The encoder rows (image tokens) one step may reach first (`max_num_encoder_input_tokens`)."""
    def set_encoder_spans(self, seq_id: int, spans: Sequence[tuple[int, int, str]]) -> None:
        """Image spans (start, end, image hash) of `seq_id`, charged to the step whose chunk reaches
        each first, unless its output is cached or the step charged its hash already."""
    def update_encoder_cache(self, added: Sequence[str], removed: Sequence[str]) -> None:
        """The runner's encoder cache changed: `added` image hashes are held now, `removed` ones not."""
    def encoder_rows_charged(self) -> int:
        """Encoder rows the last scheduled step charged to its budget."""
    def schedule(self) -> StepPlan: ...
    def block_table_view(self) -> npt.NDArray[np.int32]:
        """Zero-copy, read-only view of the persistent block table: int32 [max_num_seqs, width],
        width = ceil(max_model_len / block_size). Row r holds the device blocks of the running
        sequence that owns it, then zeros. The memory is allocated once and lives as long as the
        view does (the view keeps the scheduler alive); only schedule() writes it, in place (so
        not while another thread is inside schedule()). A plan's rows hold its batch's blocks
        until the next schedule(); plan.changed_rows names the rows that schedule() rewrote.
        """
    def update(
        self, plan: StepPlan, sampled_token_ids: npt.NDArray[np.int64] | Sequence[int]
    ) -> list[tuple[int, FinishReason, int | None]]: ...
    def update_spec(
        self, plan: StepPlan, token_ids: npt.NDArray[np.int64], counts: npt.NDArray[np.int32]
    ) -> tuple[list[tuple[int, FinishReason, int | None]], npt.NDArray[np.int32]]:
        """`update` for a plan with drafts: sampled sequence i emitted counts[i] tokens (accepted drafts,
        then one more), flattened in token_ids. Returns (finished, kept): kept[i] of sequence i's tokens
        count (fewer when a stop condition ended it early, 0 when it was aborted since schedule())."""
    def observe_step_time(self, secs: float) -> None:
        """The wall time of the step last updated, for the governor that pauses speculation measured
        slower per token than steps without drafts at the same batch size (with `spec_adaptive`): after 8
        losing speculating steps no sequence proposes for 64 steps, doubling up to 4096 while it keeps
        losing. Ignored without speculation, or when no step was updated since the last call."""
    @property
    def spec_pause_left(self) -> int:
        """Steps left in the governor's current pause of speculation (0: not paused)."""
    def abort(self, seq_ids: Sequence[int]) -> None: ...
    def resize(self, num_blocks: int) -> None: ...
    def add_window_group(self, window: int, num_blocks: int) -> int:
        """Adds the KV-cache group of the layers attending to the last `window` tokens, with its own pool of
        `num_blocks` blocks and a swap pool as large as the full-attention pool's (before any request); returns
        its index in the plan's group arrays."""
    def add_recurrent_group(self, num_slots: int, num_snapshots: int = 0) -> int:
        """Adds the recurrent-state group of the linear-attention layers with `num_slots` live state
        slots (at least max_num_seqs) and `num_snapshots` snapshot slots for prefix caching (0:
        none), before any request, without swap space (a preempted sequence recomputes its state);
        returns its index in the plan's group arrays."""
    def kv_group_pools(self) -> list[tuple[str, int | None, int, int]]:
        """Per KV-cache group beside the full-attention pool, in group order: (name, window or None,
        num_blocks, num_free_blocks)."""
    def group_blocks_of(self, group: int, seq_id: int) -> list[int]:
        """Group `group`'s block ids for a live seq id (-1 where it holds nothing any more)."""
    def tier_missing_chain(self, seq_id: int) -> list[tuple[int, int, int]]:
        """(hash, parent hash, block index) of a live seq id's full blocks from the first one neither the
        prefix cache nor the host KV tier holds (for a disk tier behind the host tier)."""
    def tier_insert(self, hash: int, parent: int, tokens: list[int]) -> int | None:
        """The host KV tier slot for a block read from outside the device pool (None: held, or no slot)."""
    def tier_record(self, slot: int) -> tuple[int, int, list[int]] | None:
        """The (hash, parent hash, tokens) a host KV tier slot holds (None: a free slot)."""
    def reset_prefix_cache(self) -> bool: ...
    def has_unfinished(self) -> bool: ...
    def num_unfinished(self) -> int: ...
    def stats(self) -> SchedulerStats: ...
    def num_cached_tokens(self, seq_id: int) -> int: ...
    def output_token_ids(self, seq_id: int) -> list[int]:
        """Output token ids of a live seq id, the newest included; PagedrsError for an unknown id."""
    def num_output_tokens(self, seq_id: int) -> int: ...
    def set_kv_events(self, on: bool) -> None:
        """Start (with an empty log) or stop recording prefix-cache events; off by default."""
    @property
    def kv_events_enabled(self) -> bool: ...
    def take_kv_events(self) -> KVEvents:
        """The prefix-cache events since the last call, in order (empty when recording is off)."""
    def take_tier_kv_events(self) -> KVEvents:
        """The host KV tier's events since the last call: blocks stored into it and evicted from it
        (published with medium "CPU"); empty without a tier or when recording is off."""
    def take_group_kv_events(self) -> list[KVEvents]:
        """Each KV-cache group's prefix-cache events since the last call, in group order."""
    def cached_block_hashes(self) -> list[int]:
        """The hashes of the blocks in the prefix cache now, sorted (u64)."""
    def check_invariants(self) -> None: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
