"""``python -m pagedrs.launch_server --model-path M [--tp-size N] [--mem-fraction-static F] [--host H]
[--port P] ...``: SGLang's launch command, serving the same API as ``pagedrs serve`` (OpenAI routes plus
SGLang's /generate and /get_model_info). Every ``pagedrs serve`` flag is accepted too."""

from __future__ import annotations

import argparse
import sys

from pagedrs.entrypoints.cli_args import sglang_serve_argv


def main(argv: list[str] | None = None) -> int:
    from pagedrs.entrypoints.cli_args import check_serve_args, make_serve_parser, parse_serve_args
    from pagedrs.entrypoints.openai.api_server import run_server

    parser = make_serve_parser(
        argparse.ArgumentParser(
            prog="python -m pagedrs.launch_server",
            description="pagedrs API server, started with SGLang's flags",
        )
    )
    args = parser.parse_args(sglang_serve_argv(list(sys.argv[1:] if argv is None else argv)))
    check_serve_args(parser, args)
    engine_args, server_args = parse_serve_args(args)
    return run_server(engine_args, server_args)


if __name__ == "__main__":
    sys.exit(main())
