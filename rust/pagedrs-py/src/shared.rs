//! The core scheduler behind its lock, held by the `Scheduler` binding and by each plan it hands out
//! (a plan gathers its padded block tables from the scheduler's persistent table on first read).

use std::sync::{Arc, Mutex, TryLockError};

use pyo3::prelude::*;

use pagedrs_core::Scheduler;

use crate::errors::poisoned;

#[derive(Clone)]
pub struct SharedScheduler(Arc<Mutex<Scheduler>>);

impl SharedScheduler {
    pub fn new(inner: Scheduler) -> Self {
        Self(Arc::new(Mutex::new(inner)))
    }

    /// Runs `f` on the scheduler; waits for the lock without holding the GIL. A scheduler whose lock
    /// was poisoned (a panic inside an earlier call) is never used again: SchedulerPoisonedError.
    pub fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Scheduler) -> R + Send,
    ) -> PyResult<R> {
        match self.0.try_lock() {
            Ok(mut g) => Ok(f(&mut g)),
            Err(TryLockError::Poisoned(_)) => Err(poisoned()),
            Err(TryLockError::WouldBlock) => py
                .detach(|| self.0.lock().map(|mut g| f(&mut g)).map_err(|_| ()))
                .map_err(|()| poisoned()),
        }
    }

    /// Always releases the GIL: for work that grows with the batch.
    pub fn detached<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Scheduler) -> R + Send,
    ) -> PyResult<R> {
        py.detach(|| self.0.lock().map(|mut g| f(&mut g)).map_err(|_| ()))
            .map_err(|()| poisoned())
    }
}
