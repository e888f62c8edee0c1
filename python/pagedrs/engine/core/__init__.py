"""The engine core: the step (schedule -> execute -> update) and what lives beside it (per-request state,
pooling, grammars, LoRA slots, prefix-cache events), the messages it speaks, and its busy loop behind a
ZeroMQ channel (`proc`, the core process)."""
