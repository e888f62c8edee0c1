"""The engine: `LLMEngine` (the offline step loop, its core in this process), `AsyncLLMEngine` (the
server's, its core in its own process), `DPLLMEngine` and `EngineArgs`; `factory` picks which runs. By
concern: `core/` (the step), `frontend/` (input and output processing), `client/` (the channel to a core
and where it runs), `dp/` (data-parallel replicas and their router)."""
