"""The Anthropic Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``), as vLLM, SGLang
and llama-server serve it: Anthropic's request and response shapes over the chat engine path."""
