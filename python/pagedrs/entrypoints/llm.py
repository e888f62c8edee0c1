"""`LLM`: offline generation and embeddings over an in-process `LLMEngine` (vLLM's `LLM`)."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard, cast

from pagedrs.lora_request import LoRARequest
from pagedrs.multimodal.inputs import chat_prompt, has_images
from pagedrs.outputs import EmbeddingRequestOutput, RequestOutput
from pagedrs.pooling_params import PoolingParams
from pagedrs.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pagedrs.beam_search import BeamSearchOutput
    from pagedrs.executor.liquid.shards import LiquidRequest

__all__ = ["LLM", "PromptInput"]

PromptInput = str | list[int] | dict


def _is_token_list(x: object) -> TypeGuard[list[int]]:
    return (
        isinstance(x, list) and len(x) > 0 and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
    )


def _prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    """One prompt (text, token ids or a dict) or a sequence of them, as a list of prompts."""
    if isinstance(prompts, (str, dict)) or _is_token_list(prompts):
        return [prompts]
    if isinstance(prompts, Iterable):
        # a token list returned above: what is left is a sequence of prompts
        return list(cast("Sequence[PromptInput]", prompts))
    raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")


def _lora_list(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if not isinstance(lora_request, (list, tuple)):
        raise ValueError(
            f"lora_request must be a LoRARequest or a list of them, got {type(lora_request).__name__}"
        )
    if len(lora_request) != num_prompts:
        raise ValueError(f"lora_request has {len(lora_request)} entries but there are {num_prompts} prompts")
    return list(lora_request)


class LLM:
    """Offline generation over an `LLMEngine` (vLLM's `LLM`); keyword arguments are `EngineArgs` fields.
    With `data_parallel_size=N` the engine runs N core processes, each a replica of the model, and a
    `generate` call is spread over them (outputs still in prompt order)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        from pagedrs.engine.factory import EngineKind, engine_kind
        from pagedrs.engine.llm_engine import EngineArgs, LLMEngine

        unknown = sorted(set(kwargs) - set(EngineArgs.field_names()))
        if unknown:
            raise ValueError(f"unknown LLM argument(s): {', '.join(unknown)}")
        config = EngineArgs(model=model, **kwargs).with_local_model().launch_config()
        if engine_kind(config, in_process=True) is EngineKind.DATA_PARALLEL:  # each request routed to a core
            from pagedrs.engine.dp_llm_engine import DPLLMEngine

            self.llm_engine: Any = DPLLMEngine(config)
        else:
            self.llm_engine = LLMEngine.from_config(config)
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block, as vLLM's `LLM.reset_prefix_cache` (a benchmark's second pass
        over the same prompts then computes them again); False if running requests kept it."""
        return self.llm_engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, token ids or {"prompt"/"prompt_token_ids": ...}); outputs in
        prompt order. `lora_request`: one adapter for every prompt, or one (or None: the base model) per
        prompt, as vLLM's `LLM.generate`."""
        prompt_list = _prompt_list(prompts)
        loras = _lora_list(lora_request, len(prompt_list))
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            # A dict or str would otherwise be iterated into its keys or characters.
            if not isinstance(sampling_params, (list, tuple)):
                raise ValueError(
                    "sampling_params must be a SamplingParams or a list of them, "
                    f"got {type(sampling_params).__name__}"
                )
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries but there are {len(prompt_list)} prompts"
                )
            for i, sp in enumerate(params_list):
                if not isinstance(sp, SamplingParams):
                    raise ValueError(
                        f"sampling_params[{i}] must be a SamplingParams, got {type(sp).__name__}"
                    )
        return self._run(prompt_list, params_list, use_tqdm, loras)

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """The embedding of each prompt (text, token ids or {"prompt"/"prompt_token_ids": ...}): the model's
        final hidden states pooled (`last` token by default, `mean`, `cls`/`first`) and L2-normalized
        unless asked otherwise; outputs in prompt order (`out.outputs.embedding`)."""
        prompt_list = _prompt_list(prompts)
        params = pooling_params if pooling_params is not None else PoolingParams()
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
        return self._run(prompt_list, [params] * len(prompt_list), use_tqdm)

    def beam_search(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """The `params.beam_width` most likely continuations of each prompt (text, token ids or
        {"prompt"/"prompt_token_ids": ...}), best first, as vLLM's `LLM.beam_search`: each round submits
        every live beam as a one-token request; the prefix cache shares the beams' common blocks."""
        from pagedrs.beam_search import BeamSearch

        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        engine = self.llm_engine
        proc = engine.input_processor
        ids_list = [proc.tokenize(p)[1] for p in _prompt_list(prompts)]
        # Offline, as generate: a beam stops at max_model_len rather than the request failing.
        limits = [
            min(proc.resolve_max_tokens(len(ids), params.max_tokens), engine.max_model_len - len(ids))
            for ids in ids_list
        ]
        search = BeamSearch(
            ids_list, params, engine.eos_token_ids, max_tokens=limits, max_logprobs=proc.max_logprobs
        )
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=max(limits, default=0), desc="Beam search", unit="token", dynamic_ncols=True)
        try:
            while beams := search.next_prompts():
                step: list[PromptInput] = [{"prompt_token_ids": ids} for ids in beams]
                search.update(self._run(step, [search.step_params] * len(step), use_tqdm=False))
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        tokenizer = engine.get_tokenizer()
        if tokenizer is None:
            return search.outputs()
        return search.outputs(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))

    def do_liquid(self, request: LiquidRequest) -> list[dict]:
        """Scale the model out or in across `liquid_gpu_range` (vLLM 0.5's liquid fork): e.g.
        `llm.do_liquid(LiquidRequest(LiquidType.LIQUID_1_2))`. One record per event."""
        return self.llm_engine.do_liquid(request)

    def shutdown(self) -> None:
        """Stop the engine's worker processes now (they also stop at exit)."""
        self.llm_engine.shutdown()

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"}) or a list of them, through
        the tokenizer's chat template."""
        if not isinstance(messages, list):
            raise ValueError(
                f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}"
            )
        if not messages:
            raise ValueError("messages is empty")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts: list[PromptInput] = []
        for conv in conversations:
            if has_images(conv):  # rendered by the processor's template; images processed with the prompt
                mm = self.llm_engine.input_processor.mm_processor
                kw = chat_template_kwargs or {}
                local = self.llm_engine.config.model.allowed_local_media_path
                prompts.append(
                    chat_prompt(
                        mm,
                        conv,
                        add_generation_prompt=add_generation_prompt,
                        allowed_local_media_path=local,
                        **kw,
                    )
                )
                continue
            ids = self.llm_engine.apply_chat_template(
                conv,
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(
        self,
        prompts: list[PromptInput],
        params: Sequence[SamplingParams | PoolingParams],
        use_tqdm: bool,
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[Any]:
        engine = self.llm_engine
        ids: list[str] = []
        pairs: Any = zip(prompts, params, loras or [None] * len(prompts), strict=True)
        if use_tqdm:  # vLLM's "Adding requests" bar, then its "Processed prompts" bar
            from tqdm.auto import tqdm

            pairs = tqdm(pairs, total=len(prompts), desc="Adding requests", dynamic_ncols=True)
        try:
            for prompt, sp, lora in pairs:
                rid = str(next(self._counter))
                if isinstance(sp, SamplingParams) and sp.output_kind != RequestOutputKind.FINAL_ONLY:
                    sp = copy.copy(sp)
                    sp.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, at its end
                engine.add_request(rid, prompt, sp, lora_request=lora)
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)
            raise
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[Any] = [None] * len(ids)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        in_toks = out_toks = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id not in order:
                        continue
                    results[order[out.request_id]] = out
                    if bar is not None:
                        in_toks += len(out.prompt_token_ids)
                        if isinstance(out, RequestOutput):
                            out_toks += sum(len(c.token_ids) for c in out.outputs)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(
                            f"est. speed input: {in_toks / elapsed:.2f} toks/s, output: {out_toks / elapsed:.2f} toks/s",
                            refresh=False,
                        )
                        bar.update(1)
        except BaseException:
            engine.abort_request([rid for rid in ids if results[order[rid]] is None])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [r for r in results if r is not None]
