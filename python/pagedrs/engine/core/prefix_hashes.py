"""The prefix cache's block hashes of a prompt, computed exactly as the engine core's scheduler does, so a
router can tell which of a prompt's blocks a core holds (from the hashes in its `KVCacheEvents`).

A block's hash chains over the prefix: `block_hash(parent, block_tokens)`, the first block's parent being
`root_hash(extra_key)`. The extra key is the hash of the request's cache salt: 0 for a base-model request
without a salt; a LoRA request's blocks hash under its adapter (id and folder), so two adapters, or an
adapter and the base model, never share blocks. Only full blocks are hashed (a partial block is never
cached). Hashes are unsigned 64-bit ints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedrs import _core

if TYPE_CHECKING:
    from pagedrs.engine.core.messages import EngineCoreRequest
    from pagedrs.lora_request import LoRARequest

__all__ = [
    "core_request_block_hashes",
    "extra_key",
    "request_block_hashes",
    "scheduler_cache_salt",
]


def scheduler_cache_salt(
    cache_salt: str | None = None, lora_int_id: int = 0, lora_path: str = ""
) -> str | None:
    """The salt the core hands the scheduler for a request (None: no extra key): the adapter's key
    (`LoRARequest.cache_salt`) for a LoRA request, followed by the request's own salt if it has one."""
    if lora_int_id:
        lora_salt = f"lora:{lora_int_id}:{lora_path}"
        return lora_salt if cache_salt is None else f"{lora_salt}|salt:{cache_salt}"
    return cache_salt


def lora_salt_of(lora: LoRARequest | None) -> str | None:
    """`scheduler_cache_salt` of a request that runs with `lora` (None: the base model) and no own salt."""
    if lora is None:
        return None
    return scheduler_cache_salt(None, lora.lora_int_id, lora.lora_path)


def extra_key(cache_salt: str | None = None, lora_int_id: int = 0, lora_path: str = "") -> int:
    """The extra key the scheduler hashes into a request's first block (0: none)."""
    return _core.prefix_extra_key(scheduler_cache_salt(cache_salt, lora_int_id, lora_path))


def request_block_hashes(
    prompt_token_ids: Sequence[int],
    block_size: int,
    *,
    cache_salt: str | None = None,
    lora_int_id: int = 0,
    lora_path: str = "",
) -> list[int]:
    """The hashes of the prompt's full blocks, in order, as the scheduler caches them for a request with
    this salt and adapter (`lora_int_id` 0: the base model). ValueError for a bad block size or token id."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if lora_int_id < 0:
        raise ValueError(f"lora_int_id must be >= 0, got {lora_int_id}")
    key = extra_key(cache_salt, lora_int_id, lora_path)
    return _core.prefix_block_hashes(list(prompt_token_ids), block_size, key)


def core_request_block_hashes(req: EngineCoreRequest, block_size: int) -> list[int]:
    """`request_block_hashes` of a request as the core receives it (its prompt and adapter)."""
    lora = req.lora_request
    if lora is None:
        return request_block_hashes(req.prompt_token_ids, block_size)
    return request_block_hashes(
        req.prompt_token_ids, block_size, lora_int_id=lora.lora_int_id, lora_path=lora.lora_path
    )
