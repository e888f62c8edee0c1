//! One error enum for the core; every message carries the numbers involved.

/// Everything the core can refuse. The binding maps each variant to a Python exception class.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("invalid scheduler config: {0}")]
    InvalidConfig(String),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("prompt is empty (seq id {seq_id})")]
    EmptyPrompt { seq_id: i64 },
    #[error("duplicate seq id {seq_id}")]
    DuplicateSeqId { seq_id: i64 },
    #[error(
        "prompt has {prompt_len} tokens; prompt + 1 output token = {} > max_model_len {max_model_len}",
        prompt_len + 1
    )]
    PromptTooLong {
        prompt_len: usize,
        max_model_len: usize,
    },
    #[error(
        "prompt of {prompt_len} tokens needs {needed} blocks but the pool has only {num_blocks}"
    )]
    PromptExceedsPool {
        prompt_len: usize,
        needed: usize,
        num_blocks: usize,
    },
    #[error("token id {token_id} is out of range [0, {limit})")]
    TokenOutOfRange { token_id: i64, limit: u64 },
    #[error("unknown seq id {seq_id}")]
    UnknownSeqId { seq_id: i64 },
    #[error("cannot resize to {requested} blocks: {in_use} blocks are in use")]
    ResizeTooSmall { requested: usize, in_use: usize },
    #[error("cannot resize: {0}")]
    Resize(String),
    #[error("out of blocks: need {needed}, {free} free")]
    OutOfBlocks { needed: usize, free: usize },
    #[error("plan for step {given} is not the pending step ({pending})")]
    PlanMismatch { given: u64, pending: String },
    #[error("plan for step {step} is still waiting for update(); call update() before schedule()")]
    PlanPending { step: u64 },
    #[error(
        "block tables of the plan for step {step} are gone: schedule() for step {latest} has rewritten \
         the block table since; read plan.block_tables before the next schedule()"
    )]
    StalePlan { step: u64, latest: u64 },
    #[error("got {got} sampled token ids, the plan has {expected} logits rows")]
    SampledLength { got: usize, expected: usize },
    #[error("invariant violated: {0}")]
    Invariant(String),
}

pub type Result<T> = std::result::Result<T, Error>;
