"""What crosses between the frontend (API server, `LLMEngine`'s output side) and the engine core: msgspec
structs, encoded as MessagePack on the ZeroMQ channel (never pickle).

In: `EngineCoreRequest` (add), `AbortRequests`, `UtilityCall`, `Shutdown`.
Out: `Ready` or `StartupFailed` once, then one `EngineCoreOutputs` per engine step (every request's new
tokens, logprobs and finish reasons, plus the step's `EngineStats`), and `UtilityResult`s.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from pagedrs.lora_request import LoRARequest
from pagedrs.metrics import EngineStats
from pagedrs.multimodal import MultiModalItem
from pagedrs.pooling_params import PoolingParams
from pagedrs.sampling_params import SamplingParams

__all__ = [
    "AbortRequests",
    "ClientLoad",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "FinishReason",
    "InputMessage",
    "OutputMessage",
    "PromptLogprobsMsg",
    "Ready",
    "SampleLogprobsMsg",
    "Shutdown",
    "StartupFailed",
    "UtilityCall",
    "UtilityResult",
    "input_decoder",
    "output_decoder",
]


class FinishReason(str, enum.Enum):
    """Why a sequence stopped (the strings are vLLM's and OpenAI's)."""

    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"


class EngineCoreRequest(msgspec.Struct, tag="add", array_like=True):
    """A validated, tokenized request; `max_tokens` is already resolved against max_model_len."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float
    priority: int = 0
    client_index: int = 0
    pooling: PoolingParams | None = None  # an embedding request: pool the prompt's hidden states
    lora_request: LoRARequest | None = None  # the adapter this request runs with (None: the base model)
    mm_items: list[MultiModalItem] = []  # the request's images, in prompt order (`pagedrs.multimodal`)
    # M-RoPE models: the prompt's [3, L] positions (row-major, flattened) and the decode offset
    mrope_positions: list[int] | None = None
    mrope_delta: int = 0


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    """Abort whole requests, or single sequences `(request_id, index)` of an n > 1 request (a stop string
    found by the frontend ends one sample, not its siblings)."""

    request_ids: list[str]
    seqs: list[tuple[str, int]] = []


class UtilityCall(msgspec.Struct, tag="call", array_like=True):
    """Call one of the core's utility methods (`EngineCore.UTILITY_METHODS`); answered by a
    `UtilityResult` with the same call_id."""

    call_id: int
    method: str
    args: list[Any] = []
    client_index: int = 0


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Finish nothing more: abort what is left and exit."""


InputMessage = EngineCoreRequest | AbortRequests | UtilityCall | Shutdown


class SampleLogprobsMsg(msgspec.Struct, array_like=True):
    """Logprobs of the new tokens of one sequence: per token, [sampled, top-k...] ids and logprobs, and the
    sampled token's rank."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class PromptLogprobsMsg(msgspec.Struct, array_like=True):
    """Prompt logprobs computed this step: positions start..start+n-1 of the prompt."""

    start: int
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence's news from one step."""

    request_id: str
    index: int  # which of the request's n samples
    new_token_ids: list[int] = []
    new_token_logprobs: list[float] = []  # each new token's raw logprob (summed into cumulative_logprob)
    new_logprobs: SampleLogprobsMsg | None = None
    prompt_logprobs: PromptLogprobsMsg | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that ended it
    num_cached_tokens: int | None = None  # set on the step the request was first scheduled
    first_scheduled_time: float | None = None
    error: str | None = None  # the core rejected or failed this request (finish_reason is ABORT)
    embedding: list[float] | None = None  # an embedding request's pooled vector, on its last prompt step


class KVCacheEvents(msgspec.Struct, array_like=True, omit_defaults=True):
    """One step's net change to the core's prefix cache, as block hashes (the scheduler's chained
    hashes, see `pagedrs.engine.core.prefix_hashes`). Applied in this order, `cleared` (empty the set),
    then `removed`, then `stored`, to the set after the previous step, it gives the set of cached
    block hashes after this step. `tier_stored` / `tier_removed`: the same net change of the KV tiers behind
    the device pool, per medium (`CPU` the host tier, `DISK` the disk tier); a tier is not cleared by
    `cleared` (the host tier logs its own clear as removals)."""

    stored: list[int] = []
    removed: list[int] = []
    cleared: bool = False
    tier_stored: dict[str, list[int]] = {}
    tier_removed: dict[str, list[int]] = {}


class ClientLoad(msgspec.Struct, array_like=True):
    """One client's requests in flight on a core, in the data-parallel router's load measure."""

    requests: int  # running or waiting
    prefill_tokens: int  # their prompt tokens still to prefill (past the cached prefix, until prefilled)


class EngineCoreOutputs(msgspec.Struct, tag="outputs", array_like=True):
    """Everything one engine step produced: one message per step, for every request."""

    outputs: list[EngineCoreOutput]
    stats: EngineStats
    timestamp: float
    kv_events: KVCacheEvents | None = None  # set when the frontend routes by cache (data parallelism)
    # With several clients (API server processes): per client, its requests in flight on this core, so
    # that each client's router sees the load the others bring.
    client_load: list[ClientLoad] | None = None


class UtilityResult(msgspec.Struct, tag="result", array_like=True):
    call_id: int
    result: Any = None
    error: str | None = None


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """The core loaded its model and is stepping; what the frontend needs to validate requests."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    max_logprobs: int
    num_blocks: int
    block_size: int
    pid: int
    embedding_size: int = 0  # width of the final hidden state (the largest `dimensions` allowed)
    task: str = "auto"  # auto | generate | embed


class StartupFailed(msgspec.Struct, tag="startup_failed", array_like=True):
    message: str


OutputMessage = EngineCoreOutputs | UtilityResult | Ready | StartupFailed


def input_decoder() -> msgspec.msgpack.Decoder[Any]:
    return msgspec.msgpack.Decoder(InputMessage)


def output_decoder() -> msgspec.msgpack.Decoder[Any]:
    return msgspec.msgpack.Decoder(OutputMessage)
