"""Entry point of the process of one tensor-parallel rank >= 1 under the `mp` backend: `python -m pagedrs.executor.rank_main`.

(Its own module, imported by nothing else, so that `-m` runs it fresh.)
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from pagedrs.executor.rank import run_rank
from pagedrs.utils import die_with_parent

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pagedrs.executor.rank_main", description="pagedrs tensor-parallel rank"
    )
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--launch-config", required=True, help="the engine's LaunchConfig as JSON")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--log-level", default="info")
    a = p.parse_args(argv)
    die_with_parent(a.parent_pid)
    lvl = getattr(logging, a.log_level.upper(), logging.INFO)
    logging.basicConfig(
        level=lvl,
        format=f"%(levelname)s %(asctime)s [rank {a.rank}] %(message)s",
        datefmt="%m-%d %H:%M:%S",
        force=True,
    )
    logging.getLogger("pagedrs").setLevel(lvl)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the other ranks stop
    try:
        run_rank(a.rank, a.world_size, a.host, a.port, a.launch_config, a.device, a.timeout)
    except BaseException:  # reported through the store and the log
        return 1
    return 0


if __name__ == "__main__":
    # os._exit: skip interpreter teardown (a broken gloo group must not abort() the process at exit).
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
