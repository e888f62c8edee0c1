"""`pagedrs serve|generate|chat|bench` argument handling (no model is loaded)."""

from __future__ import annotations

import dataclasses
import importlib
import subprocess
import sys

import msgspec
import pytest

from pagedrs import EngineArgs
from pagedrs.config import CacheConfig, ObservabilityConfig, SchedulerConfig
from pagedrs.entrypoints.cli import make_parser
from pagedrs.entrypoints.cli_args import (
    LoRAModulePath,
    ServerArgs,
    check_serve_args,
    engine_kwargs,
    make_engine_args,
    make_serve_parser,
    parse_serve_args,
    serve_args_error,
)
from pagedrs.entrypoints.openai.api_server import resolve_server_args


def test_serve_flags_map_to_engine_args() -> None:
    args = make_parser().parse_args(
        [
            "serve",
            "--port",
            "9000",
            "--api-key",
            "k",
            "--served-model-name",
            "a",
            "b",
            "--max-model-len",
            "256",
            "--num-kv-blocks",
            "64",
            "--disable-prefix-caching",
            "--no-enable-chunked-prefill",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--max-num-seqs",
            "8",
            "--seed",
            "3",
            "--log-stats-interval",
            "0",
        ]
    )
    assert (args.host, args.port, args.api_key, args.served_model_name) == (
        "127.0.0.1",
        9000,
        "k",
        ["a", "b"],
    )
    kw = engine_kwargs(args)
    assert kw["model"] is None and kw["max_model_len"] == 256 and kw["num_kv_blocks"] == 64
    assert kw["enable_prefix_caching"] is False and kw["enable_chunked_prefill"] is False
    assert kw["disable_log_stats"] is True and kw["seed"] == 3
    ea = make_engine_args(args)
    assert ea.max_num_seqs == 8 and ea.device == "cpu" and ea.enable_prefix_caching is False


def test_api_server_module_has_the_same_flags() -> None:
    from pagedrs.entrypoints.cli_args import make_serve_parser

    serve = {a.dest for a in make_serve_parser()._actions}
    sub = make_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    assert serve == {a.dest for a in sub._actions}


def test_bench_unknown_is_rejected() -> None:
    with pytest.raises(SystemExit):
        make_parser().parse_args(["bench", "nope"])


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
@pytest.mark.parametrize("flag", ["-tp", "--tensor-parallel-size"])
def test_tensor_parallel_flags_on_every_subcommand(command: str, flag: str) -> None:
    args = make_parser().parse_args([command, flag, "2", "--distributed-executor-backend", "ray"])
    ea = make_engine_args(args)
    assert ea.tensor_parallel_size == 2 and ea.distributed_executor_backend == "ray"
    default = make_engine_args(make_parser().parse_args([command]))
    assert default.tensor_parallel_size == 1 and default.distributed_executor_backend is None


def test_liquid_flags() -> None:
    args = make_parser().parse_args(
        ["serve", "--liquid-gpu-range", "0", "1", "2", "3", "--liquid-total-num-shards", "4", "--liquid-auto"]
    )
    ea = make_engine_args(args)
    assert ea.liquid_gpu_range == [0, 1, 2, 3] and ea.liquid_total_num_shards == 4 and ea.liquid_auto
    assert ea.parallel_config().liquid_gpu_range == (0, 1, 2, 3)


def test_embedding_flags() -> None:
    ea = make_engine_args(
        make_parser().parse_args(["serve", "--task", "embed", "--pooling-type", "mean", "--no-normalize"])
    )
    assert ea.task == "embed" and ea.pooling_type == "mean" and ea.normalize is False
    assert make_engine_args(make_parser().parse_args(["serve"])).normalize is True


def test_auto_tool_choice_without_parser_is_a_usage_error() -> None:
    """As vLLM: --enable-auto-tool-choice needs --tool-call-parser; argparse's exit (status 2, one error
    line naming both flags), before any model loads, not a traceback from the server's start."""
    r = subprocess.run(
        [sys.executable, "-m", "pagedrs.entrypoints.cli", "serve", "--enable-auto-tool-choice"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "pagedrs: error: --enable-auto-tool-choice requires --tool-call-parser to be set"
    )


@pytest.mark.parametrize(
    "module",
    [
        "pagedrs.entrypoints.openai.api_server",
        "pagedrs.entrypoints.openai.server.api_server",
        "pagedrs.launch_server",
    ],
)
def test_auto_tool_choice_without_parser_other_entrypoints(
    module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exc:
        main(["--enable-auto-tool-choice"])
    assert exc.value.code == 2
    assert "error: --enable-auto-tool-choice requires --tool-call-parser" in capsys.readouterr().err


def test_auto_tool_choice_with_parser_passes_the_check() -> None:
    parser = make_parser()
    args = parser.parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    check_serve_args(parser, args)  # no exit
    assert serve_args_error(args) is None


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_every_engine_flag_has_its_fields_default(command: str) -> None:
    """The engine flags are made from the EngineArgs fields: an empty command line gives every field
    that has a flag the field's own default, and the EngineArgs it makes is the default one."""
    args = make_parser().parse_args([command])
    flags = EngineArgs.cli_field_names()
    assert len(flags) >= 50 and set(flags) <= set(EngineArgs.field_names())
    for f in dataclasses.fields(EngineArgs):
        if hasattr(args, f.name):
            assert getattr(args, f.name) == f.default, f.name
        else:
            assert f.name not in flags, f"{f.name} has help but no flag"
    assert make_engine_args(args) == EngineArgs()


def test_engine_defaults_come_from_the_configs() -> None:
    """A setting that a config also has is declared there once: EngineArgs (and so its flag) takes it."""
    ea = EngineArgs()
    assert (ea.block_size, ea.gpu_memory_utilization) == (
        CacheConfig().block_size,
        CacheConfig().gpu_memory_utilization,
    )
    assert ea.max_num_seqs == SchedulerConfig(max_model_len=2).max_num_seqs
    assert ea.stats_log_interval == ObservabilityConfig().stats_log_interval
    serve = make_parser().parse_args(["serve"])
    assert serve.log_stats_interval == ea.stats_log_interval  # the server's name for the same setting
    flag = next(a for a in make_serve_parser()._actions if "--block-size" in a.option_strings)
    assert (
        flag.help
        == next(f for f in dataclasses.fields(EngineArgs) if f.name == "block_size").metadata["help"]
    )


def test_server_flags_have_the_server_args_defaults() -> None:
    assert ServerArgs.from_namespace(make_parser().parse_args(["serve"])) == ServerArgs()
    engine, server = parse_serve_args(
        make_parser().parse_args(
            ["serve", "org/m", "--port", "9", "--served-model-name", "a", "--block-size", "32"]
        )
    )
    assert (engine.model, engine.block_size, server.port, server.served_model_name) == (
        "org/m",
        32,
        9,
        ("a",),
    )


def test_resolve_server_args_returns_new_typed_args(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDRS_API_KEY", "env-key")
    monkeypatch.setenv("XDG_DATA_HOME", "/data")
    given = ServerArgs()
    server = resolve_server_args(given, EngineArgs())
    assert (server.api_key, server.data_dir) == ("env-key", "/data/pagedrs")
    assert given.api_key is None  # the given args are not changed
    with pytest.raises(ValueError, match="--api-server-count must be at least 1, got 0"):
        resolve_server_args(ServerArgs(api_server_count=0), EngineArgs())
    with pytest.raises(ValueError, match="--lora-modules requires --enable-lora"):
        resolve_server_args(ServerArgs(lora_modules=(LoRAModulePath("x", "/p"),)), EngineArgs())


def test_what_crosses_to_api_server_processes_round_trips() -> None:
    """Several API servers: each gets the engine's and the server's arguments as JSON (msgspec)."""
    engine = EngineArgs(model="/m", liquid_gpu_range=[0, 1], speculative_config={"method": "ngram"})
    server = ServerArgs(served_model_name=("a", "b"), lora_modules=(LoRAModulePath("x", "/p", "a"),))
    assert msgspec.json.decode(msgspec.json.encode(engine), type=EngineArgs) == engine
    assert msgspec.json.decode(msgspec.json.encode(server), type=ServerArgs) == server


def test_server_flags_are_declared_by_the_server_args_fields() -> None:
    """One declaration per server flag: each ServerArgs field with help is a flag of the "server" group
    with the field's default and help, and each flag sets its field."""
    parser = make_serve_parser()
    group = next(g for g in parser._action_groups if g.title == "server")
    by_dest = {a.dest: a for a in group._group_actions}
    with_help = [f for f in dataclasses.fields(ServerArgs) if f.metadata.get("help") is not None]
    assert [f.name for f in with_help] == list(by_dest)  # the fields' order is the flags' order
    for f in with_help:
        assert (by_dest[f.name].default, by_dest[f.name].help) == (f.default, f.metadata["help"]), f.name
    assert {"api_server_index", "model", "tokenizer"}.isdisjoint(by_dest)  # set by the server, not flags
    argv = ["--no-access-log", "-asc", "2", "--lora-modules", "a=/p", "--served-model-name", "x", "y"]
    argv += ["--log-level", "debug", "--allow-runtime-lora-updating", "--log-stats-interval", "0"]
    server = ServerArgs.from_namespace(parser.parse_args(argv))
    assert (server.access_log, server.api_server_count, server.log_level) == (False, 2, "debug")
    assert server.lora_modules == (LoRAModulePath("a", "/p"),) and server.served_model_name == ("x", "y")
    assert server.allow_runtime_lora_updating and server.log_stats_interval == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["--log-level", "loud"])
