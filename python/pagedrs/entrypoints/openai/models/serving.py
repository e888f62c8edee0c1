"""The model names the server answers to, as vLLM's OpenAIServingModels: the base model's served names and
the LoRA adapters (from --lora-modules at start, or /v1/load_lora_adapter at run time). A request whose
`model` is an adapter's name runs under that adapter; a base name (or none) runs the base model.

INVARIANT: this registry is the truth about names; the engine core only caches adapters (it may drop one
from the host and loads it again from its path when a request names it, also after a core restart).
With several API server processes each keeps its own registry: adapters loaded at run time through one
process are served by that process only (the --lora-modules ones by all).
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Sequence

from pagedrs.engine.async_engine import AsyncLLMEngine
from pagedrs.entrypoints.cli_args import LoRAModulePath
from pagedrs.entrypoints.openai.error_mapping import to_api_error
from pagedrs.entrypoints.openai.errors import APIError, bad_request, internal, not_found
from pagedrs.lora_request import LoRARequest

__all__ = ["ServingModels"]


def model_not_found(name: str) -> APIError:
    return not_found(f"The model `{name}` does not exist.", param="model", code="model_not_found")


class ServingModels:
    def __init__(self, engine: AsyncLLMEngine, base_model_names: Sequence[str]) -> None:
        self.engine = engine
        self.base_model_names = list(base_model_names)
        self._adapters: dict[str, LoRARequest] = {}  # served name -> request, in load order
        self._lock = asyncio.Lock()  # one load or unload at a time (the id and the name stay unique)

    @property
    def base_model_name(self) -> str:
        return self.base_model_names[0]

    def adapters(self) -> list[LoRARequest]:
        return list(self._adapters.values())

    def resolve(self, name: str | None) -> tuple[str, LoRARequest | None]:
        """(the name a response reports, the adapter to run or None for the base model); 404 in OpenAI's
        shape for a name the server does not serve."""
        if name is None or name in self.base_model_names:
            return self.base_model_name, None
        lora = self._adapters.get(name)
        if lora is None:
            raise model_not_found(name)
        return name, lora

    async def load_static(self, modules: Sequence[LoRAModulePath]) -> None:
        """The --lora-modules adapters, loaded (and checked) before the server takes requests."""
        for m in modules:
            await self.load(m.name, m.path, m.base_model_name)

    async def load(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Load an adapter into the engine and serve it as `name` (vLLM's /v1/load_lora_adapter); 400 for a
        taken name or an adapter the engine refuses (bad folder, rank above --max-lora-rank, LoRA off)."""
        async with self._lock:
            if name in self._adapters or name in self.base_model_names:
                raise bad_request(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
            lora = LoRARequest(name, self._new_id(name), path, base_model_name)
            try:
                await self.engine.call_utility("add_lora", lora.lora_name, lora.lora_int_id, lora.lora_path)
            except Exception as exc:
                raise _core_error(exc, "lora_path") from None
            self._adapters[name] = lora
            return lora

    async def unload(self, name: str) -> None:
        """Stop serving `name` and drop it from the engine (vLLM's /v1/unload_lora_adapter); 404 for an
        unknown name, 400 while requests still run under it."""
        async with self._lock:
            lora = self._adapters.get(name)
            if lora is None:
                raise not_found(f"The lora adapter '{name}' cannot be found.", param="lora_name")
            try:
                await self.engine.call_utility("remove_lora", lora.lora_int_id)
            except Exception as exc:
                raise _core_error(exc, "lora_name") from None
            del self._adapters[name]

    def _new_id(self, name: str) -> int:
        """An id derived from the name, so API server processes loading the same --lora-modules agree on
        it (and share its slot and prefix-cache blocks); moved past ids this registry already uses."""
        taken = {a.lora_int_id for a in self._adapters.values()}
        lora_id = zlib.crc32(name.encode()) % (2**31 - 1) + 1
        while lora_id in taken:
            lora_id = lora_id % (2**31 - 1) + 1
        return lora_id


def _core_error(exc: Exception, param: str) -> APIError:
    """A utility call's failure: the core's ValueError (reported as "ValueError: <message>") is the
    caller's, a 400; any other error of the core is a 500; a dead or draining engine as elsewhere."""
    if type(exc) is not ValueError:
        return to_api_error(exc)
    kind, _, message = str(exc).partition(": ")
    if kind == "ValueError":
        return bad_request(message, param=param)
    return internal(f"the engine failed: {exc}")
