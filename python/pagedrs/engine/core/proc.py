"""The engine core's busy loop behind a ZeroMQ channel: `python -m pagedrs.engine.core.proc` (its own
process, behind the server) or `EngineCoreProc.run()` in a thread (an in-process core).

Sockets (bound here, `ipc://` paths in a private 0700 directory): one PULL for requests from every
frontend, one PUSH per frontend for its outputs, and optionally one PUSH on which a supervisor (several
API server processes, `--api-server-count`) hears Ready / StartupFailed. MessagePack (msgspec) only; a malformed message is
logged and dropped. Two helper threads do the socket work: one receives and decodes, one encodes and
sends, so the loop never waits on a frontend: it keeps stepping while the previous step's message is
being sent.
"""

from __future__ import annotations

import argparse
import logging
import queue
import signal
import sys
import threading
import time
from typing import Any, Protocol

import msgspec
import zmq

from pagedrs.engine.core.client_load import ClientLoadTracker
from pagedrs.engine.core.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    Ready,
    Shutdown,
    StartupFailed,
    UtilityCall,
    UtilityResult,
    input_decoder,
)
from pagedrs.executor.executor import ExecutorDeadError
from pagedrs.metrics import EngineStats
from pagedrs.utils import die_with_parent

__all__ = ["CoreLike", "EngineCoreProc", "main", "serve_core"]

logger = logging.getLogger("pagedrs.engine_core")

_IDLE_POLL_S = 0.5  # how often an idle loop wakes to check for shutdown


class CoreLike(Protocol):
    """What the loop drives: `EngineCore`, or a stand-in with the same methods."""

    def ready_info(self) -> Ready: ...
    def add_request(self, req: EngineCoreRequest) -> None: ...
    def reject(self, request_id: str, error: str) -> None: ...
    def abort(self, request_ids: Any, seqs: Any = ()) -> None: ...
    def has_unfinished_requests(self) -> bool: ...
    def has_request(self, request_id: str) -> bool: ...
    def take_pending(self) -> list[EngineCoreOutput]: ...
    def step(self) -> EngineCoreOutputs: ...
    def check_health(self) -> None: ...
    def get_stats(self) -> EngineStats: ...
    def call_utility(self, method: str, args: Any) -> Any: ...
    def idle_tick(self) -> None: ...


class EngineCoreProc:
    """Runs a core behind `input_addr` (PULL) and `output_addrs` (PUSH, one per frontend client); Ready
    and StartupFailed also go to `status_addr` when given (first, so a supervisor hears them before any
    frontend has connected)."""

    def __init__(
        self,
        input_addr: str,
        output_addrs: list[str],
        ctx: zmq.Context | None = None,
        status_addr: str | None = None,
    ) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.input_addr = input_addr
        self.output_addrs = list(output_addrs)
        self.status_addr = status_addr
        self._status_sock: zmq.Socket | None = None
        self._inputs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._outputs: queue.SimpleQueue[tuple[int, Any] | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._requests = ClientLoadTracker(len(self.output_addrs))  # request id -> client, and its load
        self._send_time = 0.0  # encode + send of the latest step message (output thread)
        self.num_malformed = 0
        self._out_socks: list[zmq.Socket] = []
        self._in_sock: zmq.Socket | None = None
        self._threads: list[threading.Thread] = []

    # ---- sockets ------------------------------------------------------------------------------------
    def bind(self) -> None:
        self._in_sock = self.ctx.socket(zmq.PULL)
        self._in_sock.bind(self.input_addr)
        for addr in self.output_addrs:
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 2000)
            s.bind(addr)
            self._out_socks.append(s)
        if self.status_addr is not None:
            self._status_sock = self.ctx.socket(zmq.PUSH)
            self._status_sock.setsockopt(zmq.LINGER, 2000)
            self._status_sock.bind(self.status_addr)
        self._threads = [
            threading.Thread(target=self._recv_loop, name="core-recv", daemon=True),
            threading.Thread(target=self._send_loop, name="core-send", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def send_all(self, msg: Any) -> None:
        if self._status_sock is not None:
            self._outputs.put((-1, msg))
        for i in range(len(self._out_socks)):
            self._outputs.put((i, msg))

    def _recv_loop(self) -> None:
        decoder = input_decoder()
        sock = self._in_sock
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                continue
            raw = sock.recv(copy=False)
            try:
                msg = decoder.decode(raw.buffer)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
                self.num_malformed += 1
                logger.warning("dropped a malformed message (%d bytes): %s", len(raw.buffer), exc)
                continue
            self._inputs.put(msg)

    def _send_loop(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            item = self._outputs.get()
            if item is None:
                return
            start = time.perf_counter()
            client, msg = item
            sock = self._status_sock if client < 0 else self._out_socks[client]
            assert sock is not None
            sock.send(encoder.encode(msg), copy=False)
            self._send_time = time.perf_counter() - start

    def close(self) -> None:
        self._stop.set()
        self._outputs.put(None)
        for t in self._threads:
            t.join(5)
        for s in [*self._out_socks, self._status_sock, self._in_sock]:
            if s is not None:
                s.close(linger=2000)

    # ---- the loop ------------------------------------------------------------------------------------
    def run(self, core: CoreLike) -> int:
        """Announce `Ready`, then step until a `Shutdown` arrives (or `stop()`): 0. A dead executor (a
        tensor-parallel rank failed) ends the loop with 1 once the failed step's errors are sent: the
        process exits and the server restarts it."""
        self.send_all(core.ready_info())
        code = 0
        while not self._stop.is_set():
            changed = self._handle_inputs(core, block=not core.has_unfinished_requests())
            if changed is None:
                break
            try:
                core.check_health()
            except ExecutorDeadError:
                logger.exception("the engine cannot run steps any more")
                code = 1
                break
            if core.has_unfinished_requests():
                try:
                    out = core.step()
                except ExecutorDeadError:
                    logger.exception("engine step failed; the executor is dead")
                    self._publish(core, EngineCoreOutputs(core.take_pending(), core.get_stats(), time.time()))
                    code = 1
                    break
                except Exception:  # the step's requests are aborted; keep serving
                    logger.exception("engine step failed")
                    out = EngineCoreOutputs(core.take_pending(), core.get_stats(), time.time())
                out.stats.send_time_s = self._send_time
                self._publish(core, out)
            else:
                core.idle_tick()  # an idle server still feeds the liquid policy (usage 0)
                if changed:  # now idle: rejections, and the stats after the last aborts
                    self._publish(core, EngineCoreOutputs(core.take_pending(), core.get_stats(), time.time()))
        # Whatever is left is aborted: the frontends already failed or are gone.
        core.abort(self._requests.request_ids())
        return code

    def stop(self) -> None:
        self._stop.set()

    def _handle_inputs(self, core: CoreLike, block: bool) -> bool | None:
        """Apply every queued message: True if there were any, None on Shutdown."""
        try:
            msg = self._inputs.get(timeout=_IDLE_POLL_S) if block else self._inputs.get_nowait()
        except queue.Empty:
            return False
        while True:
            if isinstance(msg, EngineCoreRequest):
                self._add(core, msg)
            elif isinstance(msg, AbortRequests):
                core.abort(msg.request_ids, msg.seqs)
                for rid in msg.request_ids:
                    self._requests.forget(rid)
            elif isinstance(msg, UtilityCall):
                self._call(core, msg)
            elif isinstance(msg, Shutdown):
                return None
            try:
                msg = self._inputs.get_nowait()
            except queue.Empty:
                return True

    def _add(self, core: CoreLike, req: EngineCoreRequest) -> None:
        if not 0 <= req.client_index < len(self._out_socks):
            logger.warning("request %s names client %d: dropped", req.request_id, req.client_index)
            return
        self._requests.add(req.request_id, req.client_index, len(req.prompt_token_ids))
        try:
            core.add_request(req)
        except ValueError as exc:
            core.reject(req.request_id, str(exc))
        except Exception as exc:  # this request only
            logger.exception("add_request %s failed", req.request_id)
            core.reject(req.request_id, f"{type(exc).__name__}: {exc}")

    def _call(self, core: CoreLike, call: UtilityCall) -> None:
        try:
            result = UtilityResult(call.call_id, core.call_utility(call.method, call.args))
        except Exception as exc:  # reported to the caller
            result = UtilityResult(call.call_id, error=f"{type(exc).__name__}: {exc}")
        if 0 <= call.client_index < len(self._out_socks):
            self._outputs.put((call.client_index, result))

    def _publish(self, core: CoreLike, out: EngineCoreOutputs) -> None:
        """One message per step to each frontend: its requests' outputs, the step's stats and prefix-cache
        changes, and (with several frontends, each routing over every core) every client's load here."""
        per: list[list[EngineCoreOutput]] = [[] for _ in self._out_socks]
        several = len(self._out_socks) > 1
        if several:
            for o in out.outputs:
                per[self._requests.client_of(o.request_id) or 0].append(o)
        for o in out.outputs:
            if o.finish_reason is not None and not core.has_request(o.request_id):
                self._requests.forget(o.request_id)
            elif several:  # the load only the other frontends' routers read
                self._requests.observe(o)
        if not several:
            self._outputs.put((0, out))
            return
        load = self._requests.loads()  # after this step's finished requests left
        for i, outs in enumerate(per):
            self._outputs.put((i, EngineCoreOutputs(outs, out.stats, out.timestamp, out.kv_events, load)))


# ---- process entry point ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedrs.engine.core.proc", description="pagedrs engine core")
    p.add_argument("--input", required=True, help="ipc:// address to bind for requests")
    p.add_argument("--output", action="append", required=True, help="ipc:// address per frontend client")
    p.add_argument("--status", default=None, help="ipc:// address where a supervisor hears Ready")
    p.add_argument("--config", required=True, help="the core's LaunchConfig as JSON")
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    die_with_parent(args.parent_pid)
    lvl = getattr(logging, args.log_level.upper(), logging.INFO)
    logging.basicConfig(
        level=lvl, format="%(levelname)s %(asctime)s [core] %(message)s", datefmt="%m-%d %H:%M:%S", force=True
    )
    logging.getLogger("pagedrs").setLevel(lvl)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when the core stops
    proc = EngineCoreProc(args.input, args.output, status_addr=args.status)
    proc.bind()
    signal.signal(signal.SIGTERM, lambda *_: proc.stop())
    return serve_core(proc, args.config)


def serve_core(proc: EngineCoreProc, config_json: str) -> int:
    """Load the core from its config (`LaunchConfig` as JSON) behind bound sockets and run it until
    Shutdown: its exit code. A load failure is announced as StartupFailed (code 1). Shared by this
    process's main and the Ray actor that runs a core (`client.ray_core`)."""
    try:
        from pagedrs.engine.core.engine_core import EngineCore
        from pagedrs.launch_config import LaunchConfig

        core, _ = EngineCore.from_config(LaunchConfig.from_json(config_json))
    except Exception as exc:  # reported to the server, which exits with it
        logger.exception("engine core failed to start")
        proc.send_all(StartupFailed(f"{type(exc).__name__}: {exc}"))
        proc.close()
        return 1
    try:
        code = proc.run(core)
    finally:
        proc.close()
        shutdown = getattr(core, "shutdown", None)
        if shutdown is not None:
            shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
