//! pagedrs-core: block pool, prefix cache, requests, scheduler, step plan. No pyo3 here.
//!
//! One step: [`Scheduler::schedule`] decides who runs and returns a [`StepPlan`] of flat arrays;
//! the runner executes it; [`Scheduler::update`] appends the sampled tokens, applies the stop
//! checks, frees finished sequences and caches newly full blocks.

pub mod atomic_spans;
pub mod block_pool;
pub mod block_table;
pub mod config;
pub mod encoder_budget;
pub mod error;
pub mod free_queue;
mod groups;
mod invariants;
pub mod kv_connector;
pub mod kv_events;
pub mod kv_groups;
pub mod kv_tier;
pub mod paged_group;
pub mod plan;
pub mod prefix_cache;
mod queries;
pub mod recurrent_group;
pub mod request;
mod resize;
mod schedule;
pub mod scheduler;
pub mod sliding_window;
pub mod spec;
pub mod spec_governor;
pub mod swap_pool;
mod tier_admit;
mod update;
pub mod wire;

pub use block_table::BlockTable;
pub use config::{Config, NewRequest, SpecProposer};
pub use error::{Error, Result};
pub use kv_groups::{GroupStats, KvGroup, KvGroups};
pub use paged_group::PagedGroup;
pub use plan::StepPlan;
pub use recurrent_group::RecurrentGroup;
pub use request::{FinishReason, Finished, Status};
pub use scheduler::{Scheduler, Stats};
pub use wire::{WirePlan, OP_EXECUTE, WIRE_HEADER_LEN};

/// Index of a device block in the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockId(pub u32);
