"""`pagedrs serve|generate|chat|bench` argument handling (no model is loaded)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from pagedrs.entrypoints.cli import make_parser
from pagedrs.entrypoints.cli_args import (
    check_serve_args,
    engine_kwargs,
    make_engine_args,
    serve_args_error,
)


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


@pytest.mark.parametrize("module", ["pagedrs.entrypoints.openai.api_server", "pagedrs.launch_server"])
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
