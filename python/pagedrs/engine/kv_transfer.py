"""vLLM's ``--kv-transfer-config`` for its OffloadingConnector, mapped onto the host KV tier.

``{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config":
{"cpu_bytes_to_use": B}}`` (bytes of host memory over all ranks, as vLLM's CPUOffloadingSpec) becomes
``kv_offloading_size = B / 2**30``; ``{"num_cpu_blocks": N}`` (vLLM's older key) a tier of N blocks. What
has no counterpart here (another connector or role, a block size other than the engine's, another spec, a
key we do not know) is a ValueError, never silently dropped.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["offloading_from_transfer_config"]

_GiB = 1 << 30
_KNOWN = {"cpu_bytes_to_use", "num_cpu_blocks", "block_size", "spec_name"}


def _fail(what: str) -> ValueError:
    return ValueError(
        f"kv_transfer_config: {what}; pagedrs maps only vLLM's OffloadingConnector onto its host KV tier"
    )


def offloading_from_transfer_config(
    config: str | dict[str, Any], block_size: int
) -> tuple[float, int | None]:
    """(kv_offloading_size in GiB, the tier's blocks or None) that `config` asks for."""
    cfg = json.loads(config) if isinstance(config, str) else dict(config)
    if not isinstance(cfg, dict):
        raise _fail("must be a JSON object")
    if cfg.get("kv_connector") != "OffloadingConnector":
        raise _fail(f"kv_connector={cfg.get('kv_connector')!r} is not supported")
    if cfg.get("kv_role", "kv_both") != "kv_both":
        raise _fail(f"kv_role={cfg.get('kv_role')!r} is not supported (only 'kv_both')")
    extra = cfg.get("kv_connector_extra_config") or {}
    unknown = set(extra) - _KNOWN
    if unknown:
        raise _fail(f"kv_connector_extra_config keys {sorted(unknown)} are not supported")
    if extra.get("spec_name", "CPUOffloadingSpec") != "CPUOffloadingSpec":
        raise _fail(f"spec_name={extra['spec_name']!r} is not supported (only 'CPUOffloadingSpec')")
    if extra.get("block_size", block_size) != block_size:
        raise _fail(f"an offloaded block_size ({extra['block_size']}) other than the engine's ({block_size})")
    if ("cpu_bytes_to_use" in extra) == ("num_cpu_blocks" in extra):
        raise _fail("kv_connector_extra_config needs exactly one of cpu_bytes_to_use and num_cpu_blocks")
    if "cpu_bytes_to_use" in extra:
        b = extra["cpu_bytes_to_use"]
        if isinstance(b, bool) or not isinstance(b, int | float) or b <= 0:
            raise _fail(f"cpu_bytes_to_use={b!r} must be a number > 0")
        return b / _GiB, None
    n = extra["num_cpu_blocks"]
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise _fail(f"num_cpu_blocks={n!r} must be an int > 0")
    return 0.0, n
