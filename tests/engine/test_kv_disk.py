"""The disk KV tier (`kv_offloading_disk_path`): blocks the host tier stores outlive the engine, a restarted
engine on the same folder serves the stored prefix from them with ids equal to HF transformers' (a cold
run's); corrupt or truncated files, other models' and other dtypes' blocks are misses; the folder stays
within its size, least recently used files going first."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagedrs import LLMEngine
from pagedrs.runner import kv_disk
from pagedrs.runner.kv_disk import DiskKVTier, DiskTierLink, model_key
from tests.engine.conftest import HFReference, greedy, make_engine, random_prompts, run_all

_BS = 16  # tokens per block


def disk_engine(model: Path, folder: Path, **kw: object) -> LLMEngine:
    args: dict[str, object] = {"num_kv_blocks": 12, "max_num_batched_tokens": 32, "kv_offloading_size": 0.002}
    args.update(kw)
    return make_engine(model, kv_offloading_disk_path=str(folder), kv_offloading_disk_size=0.01, **args)


def link_of(engine: LLMEngine) -> DiskTierLink:
    link = engine.engine_core._disk
    assert link is not None
    return link


def serve(engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int) -> object:
    engine.add_request(rid, prompt, greedy(max_tokens))
    return run_all(engine)[rid]


def test_disk_blocks_survive_a_restart_and_bad_files_are_misses(
    tiny_models: dict[str, Path], hf_refs: dict[str, HFReference], tmp_path: Path
) -> None:
    first = random_prompts([100], seed=11)[0]
    engine = disk_engine(tiny_models["llama"], tmp_path)
    out = serve(engine, "a", first, 8)
    assert out.outputs[0].token_ids == hf_refs["llama"](first, 8)
    folder = link_of(engine).disk.folder
    engine.engine_core.shutdown()  # writes the queued files
    # The prompt's 6 full blocks (96 tokens), each written once as it entered the host tier.
    assert len(list(folder.glob("*.kv"))) == 6

    back = first + list(out.outputs[0].token_ids) + random_prompts([20], seed=12)[0]
    engine = disk_engine(tiny_models["llama"], tmp_path)
    assert len(link_of(engine).disk) == 6  # the index, rebuilt from the file names
    out = serve(engine, "b", back, 8)
    assert out.num_cached_tokens == 6 * _BS
    assert link_of(engine).disk.blocks_read == 6
    assert engine.engine_core.scheduler.stats().tier_loaded_blocks == 6
    assert out.outputs[0].token_ids == hf_refs["llama"](back, 8)
    engine.engine_core.shutdown()

    # Block 3's bytes corrupted (a flipped byte): the chain ends there.
    disk = DiskKVTier(tmp_path, folder.name, 1 << 30)
    paths = [disk.path_of(h) for h in chain_hashes(back, 6)]
    disk.close()
    data = bytearray(paths[3].read_bytes())
    data[-1] ^= 0xFF
    paths[3].write_bytes(bytes(data))
    engine = disk_engine(tiny_models["llama"], tmp_path)
    out = serve(engine, "c", back, 8)
    assert out.num_cached_tokens == 3 * _BS
    assert link_of(engine).disk.blocks_rejected == 1
    assert out.outputs[0].token_ids == hf_refs["llama"](back, 8)
    engine.engine_core.shutdown()
    assert paths[3].read_bytes() != bytes(data)  # deleted, then written again once recomputed

    # Another model on the same folder: its own key, none of these blocks. (Its host tier sized as vLLM's
    # OffloadingConnector config asks: 64 blocks.)
    transfer = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"num_cpu_blocks": 64}}
    engine = disk_engine(tiny_models["qwen2"], tmp_path, kv_offloading_size=None, kv_transfer_config=transfer)
    assert engine.engine_core.scheduler.stats().num_tier_blocks == 64
    assert len(link_of(engine).disk) == 0
    out = serve(engine, "d", back, 4)
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == hf_refs["qwen2"](back, 4)
    engine.engine_core.shutdown()


def chain_hashes(prompt: list[int], n: int) -> list[int]:
    """The first `n` chained block hashes of `prompt`, as the scheduler computes them."""
    from pagedrs import _core

    s = _core.Scheduler(num_blocks=64, block_size=_BS, num_tier_blocks=8)
    s.add_request([0], np.asarray(prompt, dtype=np.int64), max_tokens=1)
    return [h for h, _, _ in s.tier_missing_chain(0)[:n]]


def test_model_key_separates_models_dtypes_and_shapes(tiny_models: dict[str, Path]) -> None:
    args = (str(tiny_models["llama"]), torch.float32, torch.float32, 16, [(2, 16)])
    key = model_key(*args)
    assert model_key(*args) == key
    assert model_key(str(tiny_models["qwen2"]), *args[1:]) != key
    assert model_key(args[0], torch.bfloat16, *args[2:]) != key
    assert model_key(*args[:2], torch.float8_e4m3fn, *args[3:]) != key
    assert model_key(*args[:3], 32, args[4]) != key
    assert model_key(*args[:4], [(1, 16)]) != key
    assert model_key(*args, tp_rank=1, tp_size=2) != key


def test_disk_tier_checks_records_and_evicts_least_recently_used(tmp_path: Path) -> None:
    key = "ab" * 32
    payload = np.arange(40, dtype=np.uint8)
    size = kv_disk._HEAD.size + 4 * 4 + 40  # header, tokens, bytes
    disk = DiskKVTier(tmp_path, key, 3 * size)
    for h in (1, 2, 3):
        disk.put(h, h - 1, [h] * 4, payload)
    disk.flush()
    np.testing.assert_array_equal(disk.get(1, 0, [1] * 4, 40), payload)  # 1 is the most recently used
    disk.put(4, 3, [4] * 4, payload)
    disk.flush()
    assert disk.hashes() == [3, 1, 4] and disk.used_bytes == 3 * size and disk.blocks_evicted == 1
    assert not disk.path_of(2).exists()
    assert disk.get(3, 1, [3] * 4, 40) is None  # another parent: never a hit, and the file goes
    assert disk.get(1, 0, [1, 1, 1, 9], 40) is None  # other tokens
    disk.path_of(4).write_bytes(disk.path_of(4).read_bytes()[:-1])  # truncated
    assert disk.get(4, 3, [4] * 4, 40) is None
    assert disk.hashes() == [] and disk.used_bytes == 0 and disk.blocks_rejected == 3
    for h in (5, 6, 7):
        disk.put(h, h - 1, [h] * 4, payload)
    disk.close()
    assert sorted(DiskKVTier(tmp_path, key, 3 * size).hashes()) == [5, 6, 7]  # rebuilt from the names
    small = DiskKVTier(tmp_path, key, 2 * size)  # a smaller bound at start-up drops files until it fits
    assert len(small) == 2 and len(list(small.folder.glob("*.kv"))) == 2
    small.close()


def test_disk_path_needs_a_host_tier() -> None:
    from pagedrs.config import CacheConfig

    with pytest.raises(ValueError, match="kv_offloading_disk_path"):
        CacheConfig(kv_offloading_disk_path="/tmp/x", kv_offloading_disk_size=1.0)
    with pytest.raises(ValueError, match="kv_offloading_disk_size"):
        CacheConfig(kv_offloading_disk_size=-1.0)


def test_disk_tier_is_refused_under_tensor_parallelism() -> None:
    from pagedrs.engine.arg_utils import EngineArgs

    args = EngineArgs(model=None, tensor_parallel_size=2, kv_offloading_size=0.01)
    args.kv_offloading_disk_path, args.kv_offloading_disk_size = "/tmp/never-made", 0.1
    with pytest.raises(ValueError, match=r"kv_offloading_disk_path: .*tensor_parallel_size=1 only \(got 2\)"):
        args.create_engine_config(1024)


def test_vllm_offloading_connector_config_maps_onto_the_host_tier() -> None:
    import json

    from pagedrs.engine.arg_utils import EngineArgs

    def cfg(**extra: object) -> str:
        return json.dumps(
            {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
        )

    cache = EngineArgs(kv_transfer_config=cfg(cpu_bytes_to_use=3 << 29, block_size=16)).early_configs()[1]
    assert (cache.kv_offloading_size, cache.kv_offloading_blocks) == (1.5, None)
    cache = EngineArgs(kv_transfer_config=cfg(num_cpu_blocks=40)).early_configs()[1]
    assert (cache.kv_offloading_size, cache.kv_offloading_blocks) == (0.0, 40)
    bad = [
        ("not supported", json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})),
        ("kv_role", json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_producer"})),
        ("block_size", cfg(num_cpu_blocks=4, block_size=64)),
        ("spec_name", cfg(num_cpu_blocks=4, spec_name="TieringOffloadingSpec")),
        ("exactly one", cfg()),
        ("keys", cfg(num_cpu_blocks=4, eviction="arc")),
        ("num_cpu_blocks", cfg(num_cpu_blocks=0)),
    ]
    for match, text in bad:
        with pytest.raises(ValueError, match=match):
            EngineArgs(kv_transfer_config=text).early_configs()
    with pytest.raises(ValueError, match="not both"):
        EngineArgs(kv_offloading_size=1.0, kv_transfer_config=cfg(num_cpu_blocks=4)).early_configs()
