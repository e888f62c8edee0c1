"""The HTTP server: the app and its routes, uvicorn, several API server processes, middleware, /metrics."""
