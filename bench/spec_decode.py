"""Speculative decoding: the same copy-heavy chat requests through pagedrs without speculation, with n-gram
(prompt lookup) and with self-drafting (early exit), and with a draft model when one is given
(`--methods ... draft_model --draft-model PATH`), side by side in one run, at several batch sizes.

    python bench/spec_decode.py                              # default model, batch 1, 4, 16
    python bench/spec_decode.py --batch-sizes 1 --json bench/results/spec-decode-cpu.json

Requests: chat-templated rewrite / summarise / code-edit instructions whose answers repeat much of the
prompt (three tasks over five source texts: Python, a JSON record, a paragraph, a list, a SQL query: 15
prompts), greedy, each answer running to its end of sequence or --max-tokens (`--ignore-eos` makes every
answer exactly --max-tokens long, past the answer: on the default model that is mostly an invented next
chat turn, which repeats nothing). At batch size B the prompts go to an `LLM` with --threads torch threads
B at a time, `max(--num-prompts, B)` of them in all, so every batch size answers the same prompts. Each
configuration runs the workload once to warm up, then --repeats timed times, the configurations taking
turns within each repeat (all engines are built first); the figure is the best repeat (least disturbed by
other load). Reported per configuration and batch size: output tokens/s, the speed-up over no speculation at the
same batch size, draft tokens proposed and accepted (acceptance rate = accepted / proposed; mean
acceptance length = 1 + accepted per verification, as vLLM reports it), whether the greedy token ids
equal the run without speculation, the engine steps taken and the ceiling: the speed-up were a step with
drafts to cost what a step without them costs (steps without speculation / steps with it), which is what
the proposals are worth on the workload whatever the verification costs. Speculation is forced at every
batch size here (disable_by_batch_size above the largest batch) so that the cut-off the engine uses by
default can be read off the table.
"""

from __future__ import annotations

# pagedrs before torch: importing it shortens libgomp's idle spin, which torch's import fixes for good
import pagedrs  # noqa: F401

# isort: split

import argparse
import sys
import time
from typing import Any

import torch
from _common import add_commit_arg, command_line, git_info, machine_info, write_json

from pagedrs import LLM, SamplingParams

TEXTS = [
    "def parse_config(path):\n    with open(path) as f:\n        lines = f.read().splitlines()\n"
    "    config = {}\n    for line in lines:\n        if not line or line.startswith('#'):\n"
    "            continue\n        key, value = line.split('=', 1)\n        config[key.strip()] = value.strip()\n"
    "    return config\n",
    '{"id": 4182, "name": "Ada Lovelace", "email": "ada@example.com", "roles": ["admin", "editor"], '
    '"active": true, "created": "2024-03-01", "last_login": "2024-11-20", "quota": {"disk": 50, "seats": 3}}',
    "The library opens at nine in the morning and closes at six in the evening on weekdays. On Saturdays it "
    "opens at ten and closes at four. It is closed on Sundays and public holidays. Members may borrow up to "
    "eight books at a time for three weeks, and may renew each loan twice unless another member reserved it.",
    "Shopping list: two litres of milk, a loaf of rye bread, six eggs, a kilo of apples, a bag of rice, "
    "olive oil, black pepper, three onions, a head of garlic, tomatoes, fresh basil and a block of parmesan.",
    "SELECT customers.name, orders.id, orders.total FROM customers JOIN orders ON orders.customer_id = "
    "customers.id WHERE orders.total > 100 AND orders.status = 'shipped' ORDER BY orders.total DESC LIMIT 20;",
]
TASKS = [
    "Rewrite the following exactly, but in a code block:\n",
    "Repeat the following text, then fix any spelling mistakes:\n",
    "Add a comment line above this and reproduce it unchanged otherwise:\n",
]


def prompts(llm: LLM, n: int) -> list[str]:
    tok = llm.get_tokenizer()
    out = []
    for i in range(n):
        msg = TASKS[i % len(TASKS)] + TEXTS[i % len(TEXTS)]
        out.append(
            tok.apply_chat_template(
                [{"role": "user", "content": msg}], tokenize=False, add_generation_prompt=True
            )
        )
    return out


def run_configs(
    args: argparse.Namespace, configs: dict[str, dict[str, Any] | None]
) -> dict[str, dict[int, Any]]:
    """Every configuration's engine built first; then, per batch size, each warmed up once and timed
    --repeats times, the configurations taking turns within each repeat (so that a slower or faster
    stretch of the machine falls on all of them)."""
    llms = {
        name: LLM(
            args.model,
            speculative_config=spec,
            num_threads=args.threads,
            cpu_kv_cache_gb=1.0,
            disable_log_stats=True,
            seed=0,
        )
        for name, spec in configs.items()
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    results: dict[str, dict[int, Any]] = {name: {} for name in configs}
    for b in args.batch_sizes:
        batch = prompts(next(iter(llms.values())), max(args.num_prompts, b))
        rounds = [batch[i : i + b] for i in range(0, len(batch), b)]
        best: dict[str, Any] = {}
        for llm in llms.values():  # warm-up
            for r in rounds:
                llm.generate(r, params, use_tqdm=False)
        for _ in range(args.repeats):
            for name, llm in llms.items():
                engine = llm.llm_engine
                before = engine.get_stats()
                t0 = time.perf_counter()
                outs = [o for r in rounds for o in llm.generate(r, params, use_tqdm=False)]
                dt = time.perf_counter() - t0
                after = engine.get_stats()
                if name not in best or dt < best[name][0]:
                    best[name] = (dt, outs, before, after)
        for name, (dt, outs, before, after) in best.items():
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            drafts = after.spec_num_drafts - before.spec_num_drafts
            proposed = after.spec_num_draft_tokens - before.spec_num_draft_tokens
            accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
            results[name][b] = {
                "seconds": dt,
                "output_tokens": n_out,
                "output_tok_s": n_out / dt,
                "verifications": drafts,
                "draft_tokens": proposed,
                "accepted_tokens": accepted,
                "governor_pauses": after.spec_num_pauses - before.spec_num_pauses,
                "steps": after.num_steps - before.num_steps,
                "acceptance_rate": accepted / proposed if proposed else None,
                "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
                "token_ids": [list(o.outputs[0].token_ids) for o in outs],
            }
    for llm in llms.values():
        llm.llm_engine.shutdown()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path or name (default: the embedded default model)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=15, help="prompts per batch size (at least B)")
    p.add_argument(
        "--ignore-eos", action="store_true", help="every answer exactly --max-tokens long, past its end"
    )
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--draft-layers", type=int, default=None, help="self_draft's layers (default: a quarter)")
    p.add_argument(
        "--methods",
        nargs="+",
        default=["ngram", "self_draft"],
        choices=["ngram", "self_draft", "draft_model"],
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="draft_model's model (folder, GGUF file or Hub name): a smaller "
        "model sharing the target's tokenizer",
    )
    p.add_argument("--json", default=None, help="write the figures here")
    add_commit_arg(p)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    forced = max(args.batch_sizes) + 1
    configs: dict[str, dict[str, Any] | None] = {"none": None}
    if "ngram" in args.methods:
        configs["ngram"] = {
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_min": args.prompt_lookup_min,
            "prompt_lookup_max": args.prompt_lookup_max,
            "disable_by_batch_size": forced,
        }
    if "self_draft" in args.methods:
        configs["self_draft"] = {
            "method": "self_draft",
            "num_speculative_tokens": args.k,
            "draft_layers": args.draft_layers,
            "disable_by_batch_size": forced,
        }
    if "draft_model" in args.methods:
        if args.draft_model is None:
            p.error("--methods draft_model needs --draft-model")
        configs["draft_model"] = {
            "model": args.draft_model,
            "num_speculative_tokens": args.k,
            "disable_by_batch_size": forced,
        }
    runs = run_configs(args, configs)
    base = runs["none"]
    table = []
    for name, res in runs.items():
        for b, r in res.items():
            r["speedup"] = r["output_tok_s"] / base[b]["output_tok_s"]
            # The speed-up if a step with drafts cost what a step without them costs: what the proposer's
            # drafts are worth on this workload whatever the verification costs (its ceiling).
            r["free_verification_speedup"] = base[b]["steps"] / r["steps"] if r["steps"] else None
            r["greedy_identical"] = r["token_ids"] == base[b]["token_ids"]
            table.append((name, b, r))
    print(
        f"{'config':>11} {'batch':>5} {'out tok/s':>10} {'speed-up':>9} {'accept':>7} {'mean len':>8} {'same ids':>8} {'pauses':>6}"
        f" {'steps':>6} {'ceiling':>7}"
    )
    for name, b, r in table:
        rate = "-" if r["acceptance_rate"] is None else f"{100 * r['acceptance_rate']:.1f}%"
        mlen = "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
        print(
            f"{name:>11} {b:>5} {r['output_tok_s']:>10.1f} {r['speedup']:>8.2f}x {rate:>7} {mlen:>8} {str(r['greedy_identical']):>8} {r['governor_pauses']:>6}"
            f" {r['steps']:>6} {r['free_verification_speedup'] or 0:>6.2f}x"
        )
    if args.json:
        for res in runs.values():
            for r in res.values():
                r.pop("token_ids")
        write_json(
            args.json,
            {
                "bench": "spec_decode",
                "command": command_line(),
                "machine": machine_info(),
                "git": git_info(args.commit),
                "torch_threads": args.threads,
                "configs": configs,
                "results": {name: {str(b): r for b, r in res.items()} for name, res in runs.items()},
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
