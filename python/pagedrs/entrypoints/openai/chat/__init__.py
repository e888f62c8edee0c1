"""Chat Completions: the serving class and the reply (content, reasoning, tool calls) it builds."""
