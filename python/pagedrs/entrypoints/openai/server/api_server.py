"""``python -m pagedrs.entrypoints.openai.server.api_server [flags]``: the API server of
``pagedrs.entrypoints.openai.api_server`` (the module vLLM documents), started under this name too."""

from __future__ import annotations

import sys

from pagedrs.entrypoints.openai.api_server import main, resolve_server_args, run_server

__all__ = ["main", "resolve_server_args", "run_server"]

if __name__ == "__main__":
    sys.exit(main(prog="python -m pagedrs.entrypoints.openai.server.api_server"))
