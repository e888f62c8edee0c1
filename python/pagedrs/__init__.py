"""pagedrs: PagedAttention LLM inference and serving engine."""
