"""LLMEngine: the offline engine, in one process. An input processor (validate, tokenize), the engine core
(schedule -> execute -> update) called in-process, and an output processor (detokenize, stop strings,
outputs): the same three parts the server runs with the core in its own process."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from pagedrs import _core
from pagedrs.config import EngineConfig
from pagedrs.engine.arg_utils import EngineArgs
from pagedrs.engine.core.engine_core import EngineCore
from pagedrs.engine.core.messages import EngineCoreOutputs
from pagedrs.engine.frontend.image_inputs import mm_processor_for
from pagedrs.engine.frontend.input_processor import InputProcessor, PromptType, chat_template_ids
from pagedrs.engine.frontend.output_processor import OutputProcessor
from pagedrs.executor import UniProcExecutor
from pagedrs.executor.build import build_executor
from pagedrs.launch_config import LaunchConfig
from pagedrs.loader import LoadedModel
from pagedrs.lora_request import LoRARequest
from pagedrs.metrics import EngineStats
from pagedrs.models.interface import CausalLM
from pagedrs.outputs import EmbeddingRequestOutput, RequestOutput
from pagedrs.pooling_params import PoolingParams
from pagedrs.runner.model_runner import ModelRunner
from pagedrs.sampling_params import SamplingParams

__all__ = ["EngineArgs", "LLMEngine"]

logger = logging.getLogger("pagedrs.engine")


class LLMEngine:
    """The synchronous engine: `add_request`, then `step()` until `has_unfinished_requests()` is False."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, *, max_logprobs: int = 20) -> None:
        self.engine_core = EngineCore(
            config, loaded, build_executor(config, loaded), max_logprobs=max_logprobs
        )
        self._init_frontend(loaded)

    def _init_frontend(self, loaded: LoadedModel) -> None:
        core = self.engine_core
        self.config = core.config
        self.model: CausalLM | None = loaded.model
        self.hf_config = loaded.hf_config
        self.tokenizer = loaded.tokenizer
        self.model_path = loaded.model_path
        self.model_name = core.model_name
        self.max_model_len = core.max_model_len
        self.vocab_size = core.vocab_size
        self.device = core.device
        self.eos_token_ids = core.eos_token_ids
        model_cfg = core.config.model
        self.input_processor = InputProcessor(
            self.tokenizer,
            max_model_len=core.max_model_len,
            vocab_size=core.vocab_size,
            max_logprobs=core.max_logprobs,
            embedding_size=core.embedding_size,
            task=model_cfg.task,
            mm_processor=mm_processor_for(loaded),
            limit_mm_per_prompt=model_cfg.limit_mm_per_prompt,
            allowed_local_media_path=model_cfg.allowed_local_media_path,
            max_num_encoder_input_tokens=core.config.scheduler.max_num_encoder_input_tokens,
        )
        self.output_processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls.from_config(args.with_local_model().launch_config())

    @classmethod
    def from_config(cls, launch: LaunchConfig) -> LLMEngine:
        """The engine of a resolved config (`EngineArgs.launch_config`), its core in this process."""
        core, loaded = EngineCore.from_config(launch)
        self = cls.__new__(cls)
        self.engine_core = core
        self._init_frontend(loaded)
        return self

    # The core's parts, for tests and tools that look inside.
    @property
    def scheduler(self) -> _core.Scheduler:
        return self.engine_core.scheduler

    @property
    def runner(self) -> ModelRunner:
        """Rank 0's model runner, owned by the executor."""
        return self.engine_core.executor.runner

    @property
    def model_executor(self) -> UniProcExecutor:
        """vLLM's name for the executor (`engine.model_executor.driver_worker` is the model runner)."""
        return self.engine_core.executor

    def do_liquid(self, request: Any) -> list[dict[str, Any]]:
        """Scale a liquid engine (`LiquidRequest(LiquidType.LIQUID_1_2)` or `LiquidRequest(target=N)`)
        between steps; returns one record (latencies, bytes, pool size) per event."""
        return self.engine_core.liquid(request.resolve(self.engine_core.liquid_degree()))

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and free the model and KV cache now (workers also stop at
        exit); the engine takes no more requests after."""
        self.engine_core.shutdown()
        self.model = None

    # ---- requests ----------------------------------------------------------------------------------
    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        return chat_template_ids(self.tokenizer, self.model_name, messages, add_generation_prompt, **kwargs)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate and queue a request (with `lora_request`: under that adapter); ValueError on bad input
        (the engine state is left unchanged)."""
        request_id = str(request_id)
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        # Frontend state first: a failure building it leaves the core untouched; a core rejection undoes it.
        if isinstance(params, PoolingParams):
            if lora_request is not None:
                raise ValueError("lora_request is for generation; embedding requests run the base model")
            text, req = self.input_processor.process_pooling(
                request_id, prompt, params, arrival_time=arrival_time, priority=priority
            )
            self.output_processor.add_pooling_request(request_id, text, req.prompt_token_ids)
        else:
            text, req = self.input_processor.process(
                request_id,
                prompt,
                params,
                arrival_time=arrival_time,
                priority=priority,
                lora_request=lora_request,
            )
            self.output_processor.add_request(
                request_id, text, req.prompt_token_ids, params, req.arrival_time
            )
        try:
            self.engine_core.add_request(req)
        except BaseException:
            self.output_processor.discard(request_id)
            raise

    def abort_request(self, request_id: str | Iterable[str]) -> list[RequestOutput]:
        """Abort requests in any state and free their blocks; returns their final outputs ("abort")."""
        ids = [str(request_id)] if isinstance(request_id, str) else [str(r) for r in request_id]
        self.engine_core.abort(ids)
        return self.output_processor.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.num_unfinished()

    # ---- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        """Schedule, run and sample one step; the outputs of the requests that produced a token or finished
        in it, each as its `SamplingParams.output_kind` asks (cumulative by default)."""
        if not self.output_processor.has_unfinished_requests():
            return []
        try:
            msg = self.engine_core.step()
        except Exception:
            # The core aborted the failed step's requests; finish them here too, then report.
            failed = self.engine_core.take_pending()
            self.output_processor.abort_requests([o.request_id for o in failed])
            raise
        return self._process(msg)

    def _process(self, msg: EngineCoreOutputs) -> list[RequestOutput | EmbeddingRequestOutput]:
        processed = self.output_processor.process_outputs(msg)
        if processed.abort_seqs:  # stop strings found here: the core stops those samples
            self.engine_core.abort((), processed.abort_seqs)
        return processed.outputs

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's `reset_prefix_cache`); False when blocks in use by
        running requests kept it from being reset."""
        return self.engine_core.reset_prefix_cache()

    # ---- stats -------------------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        return self.engine_core.get_stats()
