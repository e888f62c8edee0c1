//! A process-wide pool of worker threads that stays warm between calls: a batch-1 decode step makes a
//! few hundred small matmul calls, and starting threads for each (tens of microseconds) would cost more
//! than the work. Workers spin for a short while after a job, then sleep on a condvar.
//!
//! One job at a time: a call that finds the pool busy (another thread's job) runs its tasks itself.
//! Tasks are handed out through an atomic counter, so a participant slowed down by another process on
//! the same core takes fewer of them; and once the caller has run out of tasks it closes the job, so a
//! worker that was not scheduled in time never joins it and is never waited for.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock, TryLockError};
use std::time::{Duration, Instant};

/// How long an idle worker spins before it sleeps.
const SPIN: Duration = Duration::from_micros(200);
/// Upper bound on the worker count (the caller is one more participant).
const MAX_WORKERS: usize = 63;

/// `tasks` calls of `f`, each index once, on up to `threads` threads (the caller included). Returns
/// when every call has returned. `f` must not panic (the kernels it runs check their inputs first).
pub fn parallel_for(threads: usize, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
    if threads <= 1 || tasks <= 1 {
        (0..tasks).for_each(f);
        return;
    }
    let pool = Pool::get();
    let helpers = (threads - 1).min(pool.workers).min(tasks - 1);
    let _busy = match pool.submit.try_lock() {
        Ok(guard) => guard,
        Err(TryLockError::Poisoned(e)) => e.into_inner(),
        Err(TryLockError::WouldBlock) => {
            (0..tasks).for_each(f);
            return;
        }
    };
    if helpers == 0 {
        (0..tasks).for_each(f);
        return;
    }
    let job = Job {
        f,
        tasks,
        next: AtomicUsize::new(0),
    };
    let shared = &pool.shared;
    let epoch = {
        let mut state = shared.lock();
        state.epoch += 1;
        // A worker dereferences the pointer only after joining this epoch in `shared.joined` (which
        // fails once the job is closed); this function returns after closing the job and seeing every
        // joined worker leave, so `job` outlives every use.
        state.job = (&raw const job).cast();
        state.helpers = helpers;
        shared
            .joined
            .store(state.epoch << JOIN_BITS, Ordering::SeqCst);
        shared.epoch.store(state.epoch, Ordering::SeqCst);
        state.epoch
    };
    if shared.sleepers.load(Ordering::SeqCst) > 0 {
        let _state = shared.lock();
        shared.wake.notify_all();
    }
    job.run();
    shared.joined.fetch_or(CLOSED, Ordering::SeqCst);
    let start = Instant::now();
    while shared.joined.load(Ordering::Acquire) & COUNT != 0 {
        if start.elapsed() < SPIN {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
    debug_assert_eq!(shared.joined.load(Ordering::Relaxed) >> JOIN_BITS, epoch);
}

/// `Shared::joined` = epoch << JOIN_BITS | CLOSED | count of workers inside the job.
const JOIN_BITS: u32 = 16;
const CLOSED: u64 = 1 << (JOIN_BITS - 1);
const COUNT: u64 = CLOSED - 1;

/// Enters the job of `epoch` unless it is closed or over; on success the caller must `leave`.
fn join(shared: &Shared, epoch: u64) -> bool {
    let mut cur = shared.joined.load(Ordering::SeqCst);
    loop {
        if cur >> JOIN_BITS != epoch || cur & CLOSED != 0 {
            return false;
        }
        match shared
            .joined
            .compare_exchange_weak(cur, cur + 1, Ordering::SeqCst, Ordering::SeqCst)
        {
            Ok(_) => return true,
            Err(now) => cur = now,
        }
    }
}

/// An output buffer that the tasks of one `parallel_for` write at disjoint positions (each task only
/// its own elements: the caller's invariant, stated at each write). Float32 unless named otherwise.
pub struct SharedOut<T = f32>(*mut T);
// SAFETY: the tasks write disjoint elements, and `parallel_for` returns after the last one has.
#[allow(unsafe_code)]
unsafe impl<T> Send for SharedOut<T> {}
#[allow(unsafe_code)]
unsafe impl<T> Sync for SharedOut<T> {}

impl<T> Clone for SharedOut<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for SharedOut<T> {}

impl<T> SharedOut<T> {
    pub fn new(out: &mut [T]) -> Self {
        SharedOut(out.as_mut_ptr())
    }

    /// The element at `offset` (a method, so that closures capture the `Sync` wrapper, not its field).
    pub fn at(self, offset: usize) -> *mut T {
        self.0.wrapping_add(offset)
    }

    /// The buffer from element `offset` on (a sub-buffer whose writes follow the same rule).
    pub fn offset(self, offset: usize) -> Self {
        SharedOut(self.0.wrapping_add(offset))
    }
}

/// Worker count of the pool (the number of CPUs the process may use, minus the caller).
pub fn num_workers() -> usize {
    Pool::get().workers
}

struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    tasks: usize,
    next: AtomicUsize,
}

impl Job<'_> {
    fn run(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.tasks {
                return;
            }
            (self.f)(i);
        }
    }
}

struct State {
    epoch: u64,
    job: *const Job<'static>,
    helpers: usize,
}

// SAFETY: `job` is only dereferenced under the protocol described in `parallel_for`.
#[allow(unsafe_code)]
unsafe impl Send for State {}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    /// Mirror of `state.epoch`, for spinning without the lock.
    epoch: AtomicU64,
    /// Which job may be joined, whether it is closed, and how many workers are inside it.
    joined: AtomicU64,
    sleepers: AtomicUsize,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

struct Pool {
    shared: &'static Shared,
    workers: usize,
    submit: Mutex<()>,
}

impl Pool {
    fn get() -> &'static Pool {
        static POOL: OnceLock<Pool> = OnceLock::new();
        POOL.get_or_init(|| {
            let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
            let shared: &'static Shared = Box::leak(Box::new(Shared {
                state: Mutex::new(State {
                    epoch: 0,
                    job: std::ptr::null(),
                    helpers: 0,
                }),
                wake: Condvar::new(),
                epoch: AtomicU64::new(0),
                joined: AtomicU64::new(0),
                sleepers: AtomicUsize::new(0),
            }));
            let mut workers = 0;
            for index in 0..cpus.saturating_sub(1).min(MAX_WORKERS) {
                let spawned = std::thread::Builder::new()
                    .name(format!("pagedrs-cpu-{index}"))
                    .spawn(move || worker(shared, index));
                if spawned.is_ok() {
                    workers += 1;
                } else {
                    break;
                }
            }
            Pool {
                shared,
                workers,
                submit: Mutex::new(()),
            }
        })
    }
}

fn worker(shared: &'static Shared, index: usize) {
    let mut seen = 0u64;
    loop {
        wait_for_epoch(shared, seen);
        let (epoch, job, helpers) = {
            let state = shared.lock();
            (state.epoch, state.job, state.helpers)
        };
        seen = epoch;
        if index < helpers && join(shared, epoch) {
            // SAFETY: joined to `epoch` while it was open: its caller waits for this worker to leave.
            #[allow(unsafe_code)]
            unsafe { &*job }.run();
            shared.joined.fetch_sub(1, Ordering::Release);
        }
    }
}

fn wait_for_epoch(shared: &Shared, seen: u64) {
    let start = Instant::now();
    let mut spins = 0u32;
    while shared.epoch.load(Ordering::SeqCst) == seen {
        spins = spins.wrapping_add(1);
        if spins % 64 != 0 || start.elapsed() < SPIN {
            std::hint::spin_loop();
            continue;
        }
        let mut state = shared.lock();
        shared.sleepers.fetch_add(1, Ordering::SeqCst);
        while state.epoch == seen {
            state = shared.wake.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        shared.sleepers.fetch_sub(1, Ordering::SeqCst);
        return;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once() {
        for threads in [1, 2, 4] {
            for tasks in [0, 1, 2, 7, 64] {
                let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                parallel_for(threads, tasks, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn concurrent_callers_all_finish() {
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    for _ in 0..200 {
                        let sum = AtomicUsize::new(0);
                        parallel_for(2, 16, &|i| {
                            sum.fetch_add(i, Ordering::Relaxed);
                        });
                        assert_eq!(sum.load(Ordering::Relaxed), 120);
                    }
                });
            }
        });
    }
}
