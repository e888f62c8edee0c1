"""Speculative decoding and prefix-cache (KV) events configs."""

from __future__ import annotations

from dataclasses import dataclass

from pagedrs.config.checks import _is_int, _require, json_object

SPEC_METHODS = ("ngram", "self_draft", "draft_model")
_DEFAULT_LOOKUP = (2, 4)  # prompt_lookup_min, prompt_lookup_max


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` names where vLLM has them).

    `method`: "ngram" (prompt lookup over the request's own tokens, proposed by the Rust scheduler:
    the tokens that followed the latest earlier occurrence of the last n tokens, for the largest n in
    [`prompt_lookup_min`, `prompt_lookup_max`]) or "self_draft" (early exit: the target's first
    `draft_layers` layers, its final norm and its LM head propose, writing the KV of those layers in
    place; default a quarter of the layers) or "draft_model" (`model`: a smaller model folder, GGUF
    file or Hub name sharing the target's tokenizer, with its own KV pool over the target's block ids;
    vLLM infers this method from `model` alone). `num_speculative_tokens` drafts are verified per decoding
    sequence and step (at most: with `adaptive`, a sequence proposes one more draft than it had accepted
    last time, and after a proposal with none accepted it pauses 1, 2, 4, .. 32 decode steps; engine-wide,
    speculating steps measured slower per emitted token than steps without drafts at the same batch size
    pause all proposals for 64 steps, doubling up to 4096 while they keep losing). Speculation pauses for
    a step while more than `disable_by_batch_size` sequences run (None: the method's default).
    Requests whose sampling keeps per-token state the verifier does not model (penalties, logit_bias,
    min_tokens, LoRA adapters) decode without drafts; logprobs come from each token's verification row; a grammar
    (structured outputs) masks each verified row, so a draft it rejects is cut there.
    `draft_tensor_parallel_size` (vLLM's name): only 1, where a draft model runs (whole, on rank 0)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = _DEFAULT_LOOKUP[0]
    prompt_lookup_max: int = _DEFAULT_LOOKUP[1]
    draft_layers: int | None = None
    disable_by_batch_size: int | None = None
    adaptive: bool = True
    model: str | None = None
    draft_tensor_parallel_size: int | None = None

    def __post_init__(self) -> None:
        _require(
            self.method in SPEC_METHODS,
            "speculative_config method",
            self.method,
            f"must be one of {SPEC_METHODS}",
        )
        k = self.num_speculative_tokens
        _require(_is_int(k) and 1 <= k <= 32, "num_speculative_tokens", k, "must be an int in [1, 32]")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        _require(_is_int(hi) and hi >= 1, "prompt_lookup_max", hi, "must be an int >= 1")
        _require(
            _is_int(lo) and 1 <= lo <= hi,
            "prompt_lookup_min",
            lo,
            f"must be an int in [1, prompt_lookup_max={hi}]",
        )
        d = self.draft_layers
        _require(d is None or (_is_int(d) and d >= 1), "draft_layers", d, "must be an int >= 1")
        b = self.disable_by_batch_size
        _require(b is None or (_is_int(b) and b >= 1), "disable_by_batch_size", b, "must be an int >= 1")
        _require(isinstance(self.adaptive, bool), "adaptive", self.adaptive, "must be a bool")
        _require(
            self.draft_tensor_parallel_size in (None, 1),
            "draft_tensor_parallel_size",
            self.draft_tensor_parallel_size,
            "must be 1: a draft model runs whole on rank 0 and broadcasts its drafts",
        )
        if self.method == "draft_model":
            _require(
                isinstance(self.model, str) and bool(self.model),
                "speculative_config model",
                self.model,
                "must name the draft model (a folder, a .gguf file or a Hub name) for method 'draft_model'",
            )
        else:
            _require(
                self.model is None, "speculative_config model", self.model, "is only for method 'draft_model'"
            )

    @classmethod
    def from_dict(cls, spec: dict | str | None) -> SpeculativeConfig | None:
        """From `speculative_config` (a dict or its JSON text, as `--speculative-config` takes);
        ValueError naming an unknown key or a method pagedrs does not implement. vLLM's spellings are
        taken: a `model` alone is a draft model, `"[ngram]"` as the method or the model is n-gram, and
        where only one of `prompt_lookup_min` / `prompt_lookup_max` is given the other follows it where
        the default would leave an empty range (vLLM sets the missing one equal to the given one)."""
        spec = json_object(spec, "speculative_config")
        if spec is None:
            return None
        spec = dict(spec)
        if spec.get("method") in ("eagle", "eagle3", "medusa", "mtp"):
            raise ValueError(
                f"speculative_config {spec!r}: method {spec['method']!r} is not implemented; use 'ngram' "
                "(prompt lookup), 'self_draft' (the model's own first layers) or 'draft_model'"
            )
        if spec.get("model") == "[ngram]" and spec.get("method") in (None, "ngram", "[ngram]"):
            del spec["model"]  # vLLM 0.6's speculative_model="[ngram]"
            spec["method"] = "ngram"
        if "method" not in spec and spec.get("model") is not None:  # vLLM: a model alone is a draft model
            spec["method"] = "draft_model"
        if spec.get("method") == "[ngram]":
            spec["method"] = "ngram"
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        if isinstance(lo, int) and hi is None:
            spec["prompt_lookup_max"] = max(lo, _DEFAULT_LOOKUP[1])
        elif isinstance(hi, int) and lo is None:
            spec["prompt_lookup_min"] = min(hi, _DEFAULT_LOOKUP[0])
        names = set(cls.__dataclass_fields__)
        unknown = sorted(set(spec) - names)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(names)}")
        if "method" not in spec or "num_speculative_tokens" not in spec:
            raise ValueError(f"speculative_config needs 'method' and 'num_speculative_tokens', got {spec!r}")
        return cls(**spec)


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """Prefix-cache (KV) events of one engine core. The first fields are vLLM's `KVEventsConfig`
    (`--kv-events-config`): with `enable_kv_cache_events` and the "zmq" publisher, each step's
    BlockStored / BlockRemoved / AllBlocksCleared events go out as vLLM's KVEventBatch on a ZeroMQ PUB
    socket at `endpoint` (its port offset by the data-parallel rank, as vLLM does), the last
    `buffer_steps` batches replayable from `replay_endpoint`. `step_events`: each step message carries
    the step's net change (`EngineCoreOutputs.kv_events`, for the data-parallel router);
    `data_parallel_rank`: this core's replica, stamped on every batch."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: "zmq" when enabled, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    step_events: bool = False
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        p = self.publisher
        _require(p in (None, "zmq", "null"), "kv_events_config.publisher", p, "must be 'zmq' or 'null'")
        for name in ("endpoint", "replay_endpoint"):
            e = getattr(self, name)
            ok = e is None and name == "replay_endpoint" or isinstance(e, str) and "://" in e
            _require(ok, f"kv_events_config.{name}", e, "must be a ZeroMQ address such as tcp://*:5557")
        for name, low in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1), ("data_parallel_rank", 0)):
            v = getattr(self, name)
            _require(_is_int(v) and v >= low, f"kv_events_config.{name}", v, f"must be an int >= {low}")
        _require(isinstance(self.topic, str), "kv_events_config.topic", self.topic, "must be a string")

    @property
    def publishes(self) -> bool:
        """Events go out on ZeroMQ (enabled, and the publisher is not "null")."""
        return self.enable_kv_cache_events and self.publisher in (None, "zmq")

    @property
    def records(self) -> bool:
        """The scheduler records its prefix-cache events (someone consumes them)."""
        return self.enable_kv_cache_events or self.step_events

    @classmethod
    def from_spec(
        cls,
        spec: KVEventsConfig | dict | str | None,
        *,
        step_events: bool = False,
        data_parallel_rank: int = 0,
    ) -> KVEventsConfig:
        """From vLLM's `--kv-events-config` JSON (or its dict); ValueError naming a bad value or key."""
        if isinstance(spec, cls):
            spec = {f: getattr(spec, f) for f in cls.__dataclass_fields__}
        spec = json_object(spec, "kv_events_config") or {}
        unknown = sorted(set(spec) - set(cls.__dataclass_fields__))
        if unknown:
            known = sorted(cls.__dataclass_fields__)
            raise ValueError(f"kv_events_config: unknown keys {unknown} in {spec!r}; known: {known}")
        kw = {"step_events": step_events, "data_parallel_rank": data_parallel_rank, **spec}
        kw["step_events"] = bool(kw["step_events"]) or step_events
        return cls(**kw)
