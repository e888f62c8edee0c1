"""The engine: LLMEngine (sync step loop) and AsyncLLMEngine (server side)."""
