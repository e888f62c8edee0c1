"""Completions: protocol (request and response bodies), the serving class, beam search, the route."""
