"""``pagedrs serve|generate|chat|bench``."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from pagedrs.entrypoints.cli_args import (
    add_engine_args,
    check_serve_args,
    engine_kwargs,
    make_serve_parser,
    parse_serve_args,
)

BENCHES = ("serving", "throughput")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)


def _sampling_params(args: argparse.Namespace):  # SamplingParams, imported lazily
    from pagedrs import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
    )


def _make_llm(args: argparse.Namespace):  # LLM, imported lazily
    from pagedrs import LLM

    return LLM(**engine_kwargs(args))


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = list(args.prompt) or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("pagedrs generate: give --prompt or prompts on stdin, one a line", file=sys.stderr)
        return 2
    llm = _make_llm(args)
    for out in llm.generate(prompts, _sampling_params(args), use_tqdm=False):
        if len(prompts) > 1:
            print(f"### {out.prompt!r}")
        print(out.outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    params = _sampling_params(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    if args.message:
        messages.append({"role": "user", "content": args.message})
        print(llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text)
        return 0
    print("pagedrs chat: type a message, an empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        print(reply)
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    script = Path(__file__).resolve().parents[3] / "bench" / f"{args.which}.py"
    if not script.is_file():
        print(
            f"pagedrs bench {args.which}: {script} not found; the benchmarks ship with the source "
            f"checkout, run them as `python bench/{args.which}.py` there",
            file=sys.stderr,
        )
        return 2
    sys.argv = [str(script), *args.bench_args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedrs.entrypoints.openai.api_server import run_server

    engine_args, server_args = parse_serve_args(args)  # the flags end here, typed
    return run_server(engine_args, server_args)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedrs", description="pagedrs LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible API server")
    make_serve_parser(serve)
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="complete prompts and print the text")
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    _sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat with the model (the tokenizer's chat template)")
    chat.add_argument("--message", default=None, help="one message, answered once (no prompt loop)")
    chat.add_argument("--system", default=None, help="system message")
    _sampling_args(chat)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", help="run a benchmark from bench/ (source checkout)")
    bench.add_argument("which", choices=BENCHES)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        check_serve_args(parser, args)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
