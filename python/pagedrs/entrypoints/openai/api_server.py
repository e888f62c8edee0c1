"""Runs the API server: ``python -m pagedrs.entrypoints.openai.api_server [flags]``, the module vLLM
documents (the same flags as ``pagedrs serve``; ``python -m pagedrs.entrypoints.openai.server.api_server``
runs it too)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from typing import TYPE_CHECKING

from pagedrs.entrypoints.cli_args import ServerArgs, check_serve_args, make_serve_parser, parse_serve_args
from pagedrs.entrypoints.openai.server.serve import serve_app, setup_logging

if TYPE_CHECKING:
    from pagedrs.engine.arg_utils import EngineArgs

logger = logging.getLogger("pagedrs.server")


def resolve_server_args(server: ServerArgs, engine_args: EngineArgs) -> ServerArgs:
    """The server flags with the defaults that come from the environment (API key, data dir); ValueError
    for a bad combination."""
    if server.api_key is None:
        server = dataclasses.replace(server, api_key=os.environ.get("PAGEDRS_API_KEY") or None)
    if server.data_dir is None:
        base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
        server = dataclasses.replace(server, data_dir=os.path.join(base, "pagedrs"))
    if server.api_server_count < 1:
        raise ValueError(f"--api-server-count must be at least 1, got {server.api_server_count}")
    if server.api_server_count > 1 and engine_args.data_parallel_backend != "mp":
        raise ValueError(
            f"--api-server-count {server.api_server_count} with --data-parallel-backend "
            f"{engine_args.data_parallel_backend!r} is not supported: several API server processes share "
            "engine cores that the server's main process runs (--data-parallel-backend mp); use "
            "--api-server-count 1"
        )
    error = server.error(enable_lora=engine_args.enable_lora)
    if error is not None:
        raise ValueError(error)
    return server


def run_server(engine_args: EngineArgs, server: ServerArgs) -> int:
    setup_logging(server.log_level)
    try:
        server = resolve_server_args(server, engine_args)
    except ValueError as exc:
        print(f"pagedrs: {exc}", file=sys.stderr)
        return 2
    if server.api_server_count > 1:
        from pagedrs.entrypoints.openai.server.multi_server import run_multi_server

        return run_multi_server(engine_args, server)

    from pagedrs.engine.async_engine import AsyncLLMEngine, EngineStartupError

    # The engine core process loads the model before the port opens, so /health answers 200 as soon
    # as it answers; a load failure ends the server with its message and a non-zero exit.
    try:
        engine = AsyncLLMEngine.from_engine_args(engine_args, max_restarts=server.max_engine_restarts)
    except (EngineStartupError, ValueError) as exc:
        logger.error("%s", exc)
        print(f"pagedrs: {exc}", file=sys.stderr)
        return 1
    return serve_app(engine, server)


PROG = "python -m pagedrs.entrypoints.openai.api_server"


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    parser = make_serve_parser(
        argparse.ArgumentParser(prog=prog, description="pagedrs OpenAI-compatible API server")
    )
    args = parser.parse_args(argv)
    check_serve_args(parser, args)
    engine_args, server_args = parse_serve_args(args)
    return run_server(engine_args, server_args)


if __name__ == "__main__":
    sys.exit(main())
