"""Embeddings: protocol (request and response bodies), the serving class, the route."""
