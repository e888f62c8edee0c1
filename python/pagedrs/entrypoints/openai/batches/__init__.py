"""Files and batches: the SQLite store, the worker that runs jobs, the routes."""
