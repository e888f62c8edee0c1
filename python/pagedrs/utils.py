"""Small helpers shared across pagedrs (and the names vLLM users import from `vllm.utils`)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
import uuid

__all__ = ["die_with_parent", "random_uuid"]


def random_uuid() -> str:
    """A random hex id (as `vllm.utils.random_uuid`), e.g. for request ids."""
    return uuid.uuid4().hex


def die_with_parent(parent_pid: int) -> None:
    """A child process (engine core, tensor-parallel worker) must not outlive its parent:
    PR_SET_PDEATHSIG where Linux has it, and a watcher thread for the rest (and for the race where
    the parent died before prctl)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
