"""The liquid fork's log block of one scale event, read back from a log: its lines as regexes (the text as
the fork prints it) and one `LiquidBlock` per `---------Start N'th liquid` header."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

HEADER = re.compile(r"---------Start \d+'th liquid: Scale (?:out|in) from \S+ to \S+---------")
START = re.compile(r"Start to do liquid from src: (\d+) to dst: (\d+) with shard_ids: (\[[0-9, ]*\])")
SENT_KV = re.compile(r"Successfully send kv cache shards: (\[[0-9, ]*\]) to rank: (\d+)")
AFTER_OUT = re.compile(r"After scale out, num_gpu_blocks: #(\d+)")
SHRINK = re.compile(r"Shrink to: #(\d+), currently using blocks: #(\d+)")
FINISHED = re.compile(
    r"Finished liquid for (?P<n>\d+) times, output: Completed! Move shard: \[[0-9, ]*\] from \[[0-9, ]*\] "
    r"to \[[0-9, ]*\];liquid e2e latency: (?P<e2e>[0-9.]+)s, .*liquid model weights latency: "
    r"(?P<weights>[0-9.]+)s, liquid kvc latency: (?P<kv>[0-9.]+)s;, current mem info on \S+: .*"
    r"current gpu block: #(?P<blocks>\d+)"
)


@dataclass
class LiquidBlock:
    header: str
    text: str = ""
    moves: list[tuple[int, int, list[int]]] = field(default_factory=list)
    sent_kv: tuple[list[int], int] | None = None
    after_scale_out: int | None = None
    shrink: tuple[int, int] | None = None
    finished: re.Match[str] | None = None


def liquid_blocks(log: str) -> list[LiquidBlock]:
    """One block per event header, holding the lines up to the next header."""
    starts = [m for m in HEADER.finditer(log)]
    blocks = []
    for i, m in enumerate(starts):
        text = log[m.end() : starts[i + 1].start() if i + 1 < len(starts) else len(log)]
        b = LiquidBlock(m.group(0), text)
        b.moves = [(int(s), int(d), ast.literal_eval(ids)) for s, d, ids in START.findall(text)]
        if (k := SENT_KV.search(text)) is not None:
            b.sent_kv = (ast.literal_eval(k.group(1)), int(k.group(2)))
        if (a := AFTER_OUT.search(text)) is not None:
            b.after_scale_out = int(a.group(1))
        if (s := SHRINK.search(text)) is not None:
            b.shrink = (int(s.group(1)), int(s.group(2)))
        b.finished = FINISHED.search(text)
        blocks.append(b)
    return blocks


def pool_blocks(budget_bytes: int, per_block_1: int, weights_1: int, held: int, degree: int) -> int:
    """The pool each rank holds at `degree`, by the liquid fork's rule: the KV budget of degree 1 plus the
    weight bytes the rank no longer holds (`weights_1 - held`), in blocks of 1/degree of the KV heads."""
    return (budget_bytes + weights_1 - held) // (per_block_1 // degree)
