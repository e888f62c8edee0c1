//! pagedrs-core: block pool, prefix cache, requests, scheduler, step plan. No pyo3 here.
