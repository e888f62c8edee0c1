"""Chat Completions: protocol (request and response bodies), the serving class and the reply (content,
reasoning, tool calls) it builds, the route."""
