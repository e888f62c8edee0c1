"""Liquid scaling: the model cut into shards that move between ranks while it serves (vLLM 0.5's liquid
fork). `shards` moves weights and KV, `executor` is rank 0's executor, `rank` a rank >= 1, `control` the
engine core's side, `policy` the automatic rule, `log` the fork's log block."""
