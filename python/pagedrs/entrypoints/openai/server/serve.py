"""Serves the OpenAI app under uvicorn: logging set up like vLLM's server, SIGTERM/SIGINT start the app's
drain, one process or several sharing listening sockets."""

from __future__ import annotations

import logging
import signal
import socket
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from pagedrs.entrypoints.cli_args import ServerArgs

if TYPE_CHECKING:
    from pagedrs.engine.async_engine import AsyncLLMEngine

__all__ = ["serve_app", "setup_logging"]

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


def serve_app(engine: AsyncLLMEngine, server: ServerArgs, sockets: list[socket.socket] | None = None) -> int:
    """Serves the OpenAI app around `engine` until SIGTERM/SIGINT (then drains); on `server.host/port`, or on
    the given listening sockets (shared by several API server processes)."""
    from pagedrs.entrypoints.openai.server.app import build_app

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
