"""Runs the API server: ``python -m pagedrs.entrypoints.openai.api_server [flags]``
(the same flags as ``pagedrs serve``)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from pagedrs.entrypoints.cli_args import ServerArgs, check_serve_args, make_serve_parser, parse_serve_args

if TYPE_CHECKING:
    from pagedrs.engine.arg_utils import EngineArgs
    from pagedrs.engine.async_engine import AsyncLLMEngine

logger = logging.getLogger("pagedrs.server")


def setup_logging(level: str, tag: str = "") -> None:
    """uvicorn's lines go through the root logger; pagedrs's own logger has its handler already. `tag`
    names the process when there are several API servers."""
    lvl = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(
        level=lvl,
        format=f"%(levelname)s %(asctime)s {tag}[%(name)s] %(message)s",
        datefmt="%m-%d %H:%M:%S",
        force=True,
    )
    logging.getLogger("pagedrs").setLevel(lvl)
    if tag:
        fmt = logging.Formatter(
            f"%(levelname)s %(asctime)s {tag}[%(filename)s:%(lineno)d] %(message)s", "%m-%d %H:%M:%S"
        )
        for handler in logging.getLogger("pagedrs").handlers:
            handler.setFormatter(fmt)


class _Server(uvicorn.Server):
    """uvicorn's server that starts the app's drain as soon as SIGTERM/SIGINT arrives."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        logger.info("received signal %d: shutting down", sig)
        self._on_exit()
        super().handle_exit(sig, frame)


def _ignore_signal(sig: int, frame: FrameType | None) -> None:
    # uvicorn re-raises the signal after its graceful shutdown; by then the work is done and the
    # process exits 0 on its own.
    return None


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
        from pagedrs.entrypoints.openai.multi_server import run_multi_server

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


def serve_app(engine: AsyncLLMEngine, server: ServerArgs, sockets: list[socket.socket] | None = None) -> int:
    """Serves the OpenAI app around `engine` until SIGTERM/SIGINT (then drains); on `server.host/port`, or on
    the given listening sockets (shared by several API server processes)."""
    from pagedrs.entrypoints.openai.app import build_app

    logging.getLogger("pagedrs.access").disabled = not server.access_log
    app = build_app(engine, server)
    config = uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        log_config=None,
        log_level=server.log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=max(1, int(server.shutdown_grace)),
        timeout_keep_alive=5,
    )
    uv_server = _Server(config, app.state.server.begin_drain)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _ignore_signal)
    uv_server.run(sockets=sockets)
    return 0 if uv_server.started else 1


def main(argv: list[str] | None = None) -> int:
    parser = make_serve_parser(
        argparse.ArgumentParser(
            prog="python -m pagedrs.entrypoints.openai.api_server",
            description="pagedrs OpenAI-compatible API server",
        )
    )
    args = parser.parse_args(argv)
    check_serve_args(parser, args)
    engine_args, server_args = parse_serve_args(args)
    return run_server(engine_args, server_args)


if __name__ == "__main__":
    sys.exit(main())
