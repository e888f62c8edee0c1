"""Models by name, fetched from a Hub served on loopback (HF_ENDPOINT points at it; nothing leaves the
machine): by name then generate, by revision, gated and missing repos, offline and unreachable with and
without a cache, GGUF repos of several files, only the needed files, and one download for two TP ranks
and for a server's engine core process."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagedrs import LLM, SamplingParams
from pagedrs.engine.arg_utils import EngineArgs
from pagedrs.entrypoints.cli_args import make_engine_args, make_serve_parser
from pagedrs.loader import LoadOptions, load_hf_config, load_model, resolve_model_path
from pagedrs.loader.hub import HubError, _is_network_error, _raise_repo_error, fetch, select_files
from tests.helpers import make_tiny_gguf, make_tiny_llama
from tests.loader.helpers_hub import TOKEN, LoopbackHub, point_hf_at, set_offline

META = [
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
]
ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, disable_log_stats=True, seed=0)


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LoopbackHub]:
    """A loopback Hub that HF_ENDPOINT points at, an empty HF cache and GGUF cache under tmp_path."""
    server = LoopbackHub()
    point_hf_at(monkeypatch, server.url, tmp_path / "hf-cache")
    monkeypatch.setenv("PAGEDRS_CACHE", str(tmp_path / "pagedrs-cache"))
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"))


def greedy_ids(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [40, 41]}], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_llm_by_name_generates_as_the_local_folder(hub: LoopbackHub, tiny: Path) -> None:
    hub.add("org/tiny", tiny)
    by_name = LLM("org/tiny", **ENGINE)
    got = greedy_ids(by_name)
    assert by_name.llm_engine.engine_core.model_name == "org/tiny"  # the name is what is served
    del by_name
    assert got == greedy_ids(LLM(str(tiny), **ENGINE))
    assert sorted(hub.downloads("org/tiny")) == sorted([*META, "model.safetensors"])


def test_bare_name_and_the_serve_positional(hub: LoopbackHub, tiny: Path) -> None:
    hub.add("gpt2", tiny)
    assert load_hf_config("gpt2").model_type == "llama"
    assert "config.json" in hub.downloads("gpt2")
    args = make_engine_args(make_serve_parser().parse_args(["org/name", "--gguf-file", "m.gguf"]))
    assert (args.model, args.gguf_file) == ("org/name", "m.gguf")
    with pytest.raises(SystemExit, match="named twice"):
        make_engine_args(make_serve_parser().parse_args(["org/name", "--model", "org/other"]))


def test_revision_branch_and_commit(hub: LoopbackHub, tmp_path: Path, tiny: Path) -> None:
    other = make_tiny_llama(tmp_path, seed=7, subdir="other")
    main_sha = hub.add("org/tiny", tiny)
    hub.add("org/tiny", other, revision="v2")
    weights = lambda p: (Path(p) / "model.safetensors").read_bytes()  # noqa: E731
    assert weights(fetch("org/tiny")) == weights(tiny)
    assert weights(fetch("org/tiny", revision="v2")) == weights(other)
    assert weights(fetch("org/tiny", revision=main_sha)) == weights(tiny)
    with pytest.raises(HubError, match=r"'org/tiny' has no revision 'v3'"):
        fetch("org/tiny", revision="v3")


def test_gated_repo_needs_the_token(hub: LoopbackHub, tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub.add("org/gated", tiny, gated=True)
    with pytest.raises(HubError, match=r"'org/gated' is gated") as err:
        load_model("org/gated")
    assert isinstance(err.value, ValueError) and err.value.repo_id == "org/gated"
    path = resolve_model_path("org/gated", opts=LoadOptions(token=TOKEN))  # hf_token= / --hf-token
    assert (Path(path) / "model.safetensors").is_file()
    shutil.rmtree(Path(path).parents[1])  # the cached copy gone: HF_TOKEN must do it again
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert (Path(fetch("org/gated")) / "model.safetensors").is_file()


def test_missing_repo(hub: LoopbackHub) -> None:
    with pytest.raises(HubError, match=r"'org/missing' is not a local path and not a model on the Hub"):
        LLM("org/missing", **ENGINE)
    with pytest.raises(ValueError, match="not found"):
        resolve_model_path("no/such/dir")  # a path, not a name: never sent to the Hub
    assert not any("no/such" in p for _, p in hub.requests)


def test_missing_file_and_local_errors_are_not_network_errors(hub: LoopbackHub, tiny: Path) -> None:
    """A file the repo lacks (a shard its index lists) is named as such, not as 'no such repo' nor as
    'the Hub cannot be reached'; a local permission error is not a network error either."""
    from huggingface_hub import hf_hub_download

    hub.add("org/tiny-files", tiny)
    with pytest.raises(Exception) as missing:
        hf_hub_download("org/tiny-files", "model-00009-of-00009.safetensors")
    assert not _is_network_error(missing.value)
    with pytest.raises(HubError, match=r"'org/tiny-files' lacks a file"):
        _raise_repo_error("org/tiny-files", None, missing.value)
    assert not _is_network_error(PermissionError(13, "denied", "/cache"))
    assert _is_network_error(ConnectionRefusedError(111, "refused"))


def test_offline_uses_the_cache_only(hub: LoopbackHub, tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub.add("org/tiny", tiny)
    set_offline(monkeypatch, True)
    with pytest.raises(HubError, match=r"'org/tiny'.*not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        fetch("org/tiny")
    assert not any("org/tiny" in p for _, p in hub.requests)
    set_offline(monkeypatch, False)
    online = fetch("org/tiny")
    set_offline(monkeypatch, True)
    seen = len(hub.requests)
    assert fetch("org/tiny") == online
    assert len(hub.requests) == seen  # no request at all
    shutil.rmtree(Path(online).parents[1] / "trees")  # a cache without the saved listing (older clients)
    assert fetch("org/tiny") == online


def test_unreachable_hub_falls_back_to_the_cache(
    hub: LoopbackHub, tiny: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    hub.add("org/tiny", tiny)
    hub.add("org/other", tiny)
    online = fetch("org/tiny")
    hub.close()  # the port now refuses connections
    with caplog.at_level(logging.WARNING, logger="pagedrs.loader"):
        assert fetch("org/tiny") == online
    assert "using the cached copy of org/tiny" in caplog.text
    with pytest.raises(HubError, match=r"'org/other'.*not in the Hugging Face cache.*cannot be reached"):
        fetch("org/other")


def test_gguf_repo_picks_one_file(hub: LoopbackHub, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    for qtype in ("Q8_0", "F16"):
        src = make_tiny_gguf(tmp_path / qtype, qtype=qtype)
        shutil.copy(src, repo / f"tiny-{qtype}.gguf")
    (repo / "README.md").write_text("tiny GGUF files")
    hub.add("org/tiny-GGUF", repo)

    path = resolve_model_path("org/tiny-GGUF:Q8_0")
    assert Path(path).name == "tiny-Q8_0.gguf"
    assert hub.downloads() == ["tiny-Q8_0.gguf"]
    path = resolve_model_path("org/tiny-GGUF", opts=LoadOptions(gguf_file="tiny-F16.gguf"))
    assert Path(path).name == "tiny-F16.gguf"
    assert hub.downloads() == ["tiny-Q8_0.gguf", "tiny-F16.gguf"]
    with pytest.raises(
        HubError, match=r"2 GGUF files \(tiny-F16.gguf, tiny-Q8_0.gguf\).*org/tiny-GGUF:QUANT"
    ):
        fetch("org/tiny-GGUF")
    with pytest.raises(HubError, match=r"no GGUF file for 'Q4_K_M'"):
        fetch("org/tiny-GGUF:Q4_K_M")

    # quantization="gguf" (vLLM's flag for GGUF models) takes the Hub name with its type too
    forced = LLM("org/tiny-GGUF:F16", quantization="gguf", **ENGINE)
    got = greedy_ids(forced)
    del forced
    assert got == greedy_ids(LLM(str(repo / "tiny-F16.gguf"), **ENGINE))
    with pytest.raises(
        ValueError, match=r"quantization='gguf' needs a GGUF model, got model='org/tiny-GGUF'"
    ):
        LLM("org/tiny-GGUF", quantization="gguf", **ENGINE)

    by_name = load_model("org/tiny-GGUF:F16", dtype="float32")
    local = load_model(str(repo / "tiny-F16.gguf"), dtype="float32")
    for a, b in zip(by_name.model.state_dict().values(), local.model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_only_the_needed_files(hub: LoopbackHub, tmp_path: Path, tiny: Path) -> None:
    both = tmp_path / "both"
    shutil.copytree(tiny, both)
    state = {k: v.clone() for k, v in load_model(str(tiny), with_tokenizer=False).model.state_dict().items()}
    torch.save(state, both / "pytorch_model.bin")
    (both / "README.md").write_text("a model")
    (both / "original").mkdir()
    (both / "original" / "consolidated.pth").write_bytes(b"x" * 64)
    hub.add("org/both", both)
    fetch("org/both")
    assert sorted(hub.downloads()) == sorted([*META, "model.safetensors"])
    fetch("org/both", load_format="pt", download_dir=str(tmp_path / "dl"))  # vLLM's --download-dir
    assert sorted(hub.downloads()[-6:]) == sorted([*META, "pytorch_model.bin"])
    assert (tmp_path / "dl" / "models--org--both").is_dir()

    sharded = make_tiny_llama(tmp_path, num_shards=2, subdir="sharded")
    shutil.copy(both / "pytorch_model.bin", sharded / "pytorch_model.bin")
    hub.add("org/sharded", sharded)
    fetch("org/sharded")
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) >= 2
    assert sorted(hub.downloads("org/sharded")) == sorted([*META, "model.safetensors.index.json", *shards])


def test_select_files_rules() -> None:
    files = ["config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json", "modeling_x.py"]
    assert select_files("o/r", files) == ["config.json", "tokenizer.json", "model.safetensors"]
    assert select_files("o/r", files, weights=False) == ["config.json", "tokenizer.json"]
    assert "modeling_x.py" in select_files("o/r", files, trust_remote_code=True)
    assert select_files("o/r", files, load_format="dummy") == ["config.json", "tokenizer.json"]
    ggufs = ["m-IQ4_K_M.gguf", "m-Q4_K_M.gguf", "m.q8_0.gguf"]
    assert select_files("o/r", ggufs, quant="Q4_K_M") == ["m-Q4_K_M.gguf"]  # a whole word, not IQ4_K_M
    assert select_files("o/r", ggufs, quant="Q8_0") == ["m.q8_0.gguf"]
    with pytest.raises(HubError, match="no safetensors, pytorch_model.bin or .gguf weights"):
        select_files("o/r", ["config.json", "README.md"])


def test_tp2_downloads_once(hub: LoopbackHub, tiny: Path, tmp_path: Path) -> None:
    """The first process fetches; the second rank gets the local path and never asks the Hub."""
    hub.add("org/tiny", tiny)
    fetch("org/tiny", download_dir=str(tmp_path / "one-fetch"))
    one_fetch = len(hub.repo_requests("org/tiny"))
    hub.requests.clear()
    llm = LLM("org/tiny", tensor_parallel_size=2, **ENGINE)
    try:
        assert len(greedy_ids(llm)[0]) == 8
    finally:
        llm.llm_engine.shutdown()
    assert sorted(hub.downloads()) == sorted([*META, "model.safetensors"])  # each file once
    assert len(hub.repo_requests("org/tiny")) == one_fetch


def test_engine_args_carry_the_local_path(hub: LoopbackHub, tiny: Path) -> None:
    hub.add("org/tiny", tiny)
    args = EngineArgs(model="org/tiny", revision="main", hf_token="secret").with_local_model()
    assert Path(args.model, "config.json").is_file()
    assert (args.served_model_name, args.revision, args.hf_token) == ("org/tiny", None, None)
    assert EngineArgs(model=None).with_local_model().model is None


def test_engine_core_process_gets_the_local_path(hub: LoopbackHub, tiny: Path, tmp_path: Path) -> None:
    """The server's path: the frontend fetches (and loads the tokenizer); the core process never asks the Hub."""
    from pagedrs.engine.async_engine import AsyncLLMEngine

    hub.add("org/tiny", tiny)
    fetch("org/tiny", download_dir=str(tmp_path / "one-fetch"))
    one_fetch = len(hub.repo_requests("org/tiny"))
    hub.requests.clear()
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model="org/tiny", **ENGINE))
    try:
        assert engine.model_name == "org/tiny"
        assert engine.tokenizer.decode(engine.tokenizer("hub")["input_ids"]) == "hub"
    finally:
        engine.shutdown()
    assert sorted(hub.downloads()) == sorted([*META, "model.safetensors"])
    assert len(hub.repo_requests("org/tiny")) == one_fetch
