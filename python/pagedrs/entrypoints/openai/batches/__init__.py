"""Files and batches: protocol (request and response bodies), the SQLite store, the worker that runs jobs,
the routes."""
