"""`pagedrs serve --api-server-count N` (N > 1): several API server processes share one engine core, so
HTTP, tokenization, detokenization and SSE encoding are not bound to one process's CPU (vLLM's
`--api-server-count`).

The main process is the supervisor: it reserves the port, starts the engine core with N client sockets
(`CoreSupervisor`; with `-dp M`, M cores, each with N client sockets: `DPCoreSupervisor`, every API
server routing its requests over all M, as vLLM's DP with several API servers), then N API server processes (`python -m pagedrs.entrypoints.openai.server.multi_server`), each
with its client index. Each listens on the port with SO_REUSEPORT, so the kernel spreads connections over
them evenly (one shared listening socket would let whichever process wakes first accept them all).
Each serves every endpoint: files and batch jobs live in the shared SQLite store (API server 0 runs the
jobs, polling the store for jobs and cancellations made through the others); Prometheus metrics are
aggregated over the processes (prometheus_client's multiprocess mode). A dead core is restarted by the
supervisor, and every API server fails its in-flight requests on it and reconnects. A dead API server
ends the whole server (non-zero exit). SIGTERM drains every API server, then stops the cores.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from types import FrameType

import msgspec

from pagedrs.engine.arg_utils import EngineArgs
from pagedrs.entrypoints.cli_args import ServerArgs

__all__ = ["child_main", "run_multi_server"]

logger = logging.getLogger("pagedrs.server")

_POLL_S = 0.2


def reuseport_socket(host: str, port: int, listen: bool) -> socket.socket:
    """A TCP socket bound to host:port with SO_REUSEPORT (and listening, if asked). The supervisor holds
    one that does not listen: it reserves the port (a taken port fails before anything starts) and
    fixes it when `--port 0` asks for any; only listening sockets get connections."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(addr)
        if listen:
            sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


class _Stop:
    def __init__(self) -> None:
        self.requested = False

    def __call__(self, sig: int, frame: FrameType | None) -> None:
        if not self.requested:
            logger.info("received signal %d: draining %s", sig, "every API server")
        self.requested = True


def run_multi_server(engine_args: EngineArgs, server: ServerArgs) -> int:
    """`--api-server-count N`: the supervisor's loop. Long because start-up, the supervision loop and the
    shutdown share the child handles and their cleanup in one try/finally (no process left behind)."""
    from pagedrs.engine.client.core_handles import EngineStartupError
    from pagedrs.engine.dp.frontends import DPCoreSupervisor
    from pagedrs.engine.factory import core_configs

    count = server.api_server_count
    try:
        # Checked (bad arguments fail here, before any process starts), then a Hub name is fetched here,
        # once: the core and the API servers (which load the tokenizer from these arguments) get the
        # local paths.
        engine_args = engine_args.with_local_model()
        server = dataclasses.replace(server, model=engine_args.model, tokenizer=engine_args.tokenizer)
        config = engine_args.launch_config()
    except ValueError as exc:
        logger.error("%s", exc)
        print(f"pagedrs: {exc}", file=sys.stderr)
        return 1
    try:
        reserved = reuseport_socket(server.host, server.port, listen=False)
    except OSError as exc:
        print(f"pagedrs: cannot listen on {server.host}:{server.port}: {exc}", file=sys.stderr)
        return 1
    server = dataclasses.replace(server, port=reserved.getsockname()[1])
    ipc_dir = tempfile.mkdtemp(prefix="pagedrs-ipc-")  # mode 0700: the channel's sockets and state
    prom_dir = os.path.join(ipc_dir, "prometheus")
    os.mkdir(prom_dir)
    stop = _Stop()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    children: list[subprocess.Popen[bytes]] = []
    supervisor = DPCoreSupervisor(core_configs(config), ipc_dir, count, server.max_engine_restarts)
    failed: list[str] = []

    def should_stop() -> bool:
        for i, child in enumerate(children):
            rc = child.poll()
            if rc is not None and not failed:
                how = f"killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
                failed.append(f"API server {i} (pid {child.pid}) {how}")
        return stop.requested or bool(failed)

    rc = 0
    try:
        try:
            supervisor.start(should_stop)
        except EngineStartupError as exc:
            if stop.requested:
                return 0
            logger.error("%s", exc)
            print(f"pagedrs: {exc}", file=sys.stderr)
            return 1
        config_json = config.to_json()
        server_json = msgspec.json.encode(server).decode()
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=prom_dir)
        for i in range(count):
            cmd = [
                sys.executable,
                "-m",
                "pagedrs.entrypoints.openai.server.multi_server",
                "--client-index",
                str(i),
            ]
            cmd += ["--ipc-dir", ipc_dir, "--parent-pid", str(os.getpid())]
            cmd += ["--config-json", config_json, "--server-args-json", server_json]
            # Their own session: a terminal's Ctrl-C reaches the supervisor, which drains them with SIGTERM.
            children.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True))
        logger.info(
            "%d API servers (pids %s) on http://%s:%d sharing engine core pid(s) %s",
            count,
            ", ".join(str(c.pid) for c in children),
            server.host,
            server.port,
            ", ".join(str(p) for p in supervisor.pids),
        )
        while not should_stop():
            supervisor.check(should_stop)
            time.sleep(_POLL_S)
        if failed:
            logger.error("%s: stopping the server", failed[0])
            rc = 1
    finally:
        _stop_children(children, grace=server.shutdown_grace + 15.0)
        supervisor.stop(10.0)
        reserved.close()
        shutil.rmtree(ipc_dir, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return rc


def _stop_children(children: list[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM (each drains its in-flight requests), then SIGKILL for any still there after `grace`."""
    for child in children:
        if child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for child in children:
        try:
            child.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("API server pid %d did not stop in %.0fs: killed", child.pid, grace)
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            child.wait(10)


# ---- one API server process -----------------------------------------------------------------------------
def child_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedrs.entrypoints.openai.server.multi_server")
    p.add_argument("--client-index", type=int, required=True)
    p.add_argument("--ipc-dir", required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--config-json", required=True, help="the engine's resolved config (LaunchConfig)")
    p.add_argument("--server-args-json", required=True, help="the server's (ServerArgs)")
    a = p.parse_args(argv)

    from pagedrs.utils import die_with_parent

    die_with_parent(a.parent_pid)
    from pagedrs.engine.async_engine import AsyncLLMEngine, EngineStartupError
    from pagedrs.entrypoints.openai.server.serve import serve_app, setup_logging
    from pagedrs.launch_config import LaunchConfig

    config = LaunchConfig.from_json(a.config_json)
    server = msgspec.json.decode(a.server_args_json.encode(), type=ServerArgs)
    server = dataclasses.replace(server, api_server_index=a.client_index)
    setup_logging(server.log_level, tag=f"[api-server {a.client_index}] ")
    try:
        engine = AsyncLLMEngine.from_supervised_core(
            config, a.ipc_dir, a.client_index, max_restarts=server.max_engine_restarts
        )
    except (EngineStartupError, ValueError) as exc:
        logger.error("%s", exc)
        return 1
    try:
        listener = reuseport_socket(server.host, server.port, listen=True)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", server.host, server.port, exc)
        engine.shutdown()
        return 1
    return serve_app(engine, server, sockets=[listener])


if __name__ == "__main__":
    sys.exit(child_main())
