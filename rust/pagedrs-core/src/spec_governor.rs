//! Engine-wide pause of speculation that measures slower than decoding without it.
//!
//! `disable_by_batch_size` (vLLM's) turns speculation off above a batch size fixed in advance; whether it
//! pays below that depends on the drafter, the workload and the machine (an early-exit draft that the
//! full model rarely agrees with costs a sub-forward per draft and saves nothing). The governor compares,
//! per batch size, what the steps with drafts cost per emitted token against the steps without drafts:
//! after [`WINDOW`] speculating steps that together took longer than their emitted tokens would have at the
//! plain rate, no sequence proposes for [`MIN_PAUSE`] steps, doubling with every losing window in a row
//! up to [`MAX_PAUSE`]; a winning window resets the pause. The paused steps are plain decode steps, so
//! they also keep the plain rate current. Steps with prompt tokens are not compared (a prefill chunk's
//! cost has nothing to do with the drafts).

/// Speculating steps compared at a time.
pub const WINDOW: u32 = 8;
/// First pause after a losing window, in scheduler steps.
pub const MIN_PAUSE: u32 = 64;
/// Longest pause: a workload that turns copy-heavy later is found again within this many steps.
pub const MAX_PAUSE: u32 = 4096;
/// Steps without drafts taken to measure the plain rate of a batch size that has none yet.
pub const BASELINE_STEPS: u32 = 4;
/// Weight of the newest step in the plain rate (an exponential moving average).
const EMA: f64 = 0.25;

/// What a step held, as far as the governor cares.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepShape {
    /// Sequences sampled.
    pub rows: usize,
    /// Draft tokens verified.
    pub drafts: usize,
    /// Tokens emitted (one per row without drafts; one plus the accepted drafts with).
    pub emitted: usize,
    /// Whether any prompt tokens ran (such steps are not compared).
    pub prefill: bool,
}

#[derive(Debug, Default, Clone)]
pub struct SpecGovernor {
    /// Seconds per emitted token of decode steps without drafts, by batch size (0: not measured).
    plain: Vec<f64>,
    /// The window's speculating steps: their seconds, and their emitted tokens at the plain rate.
    spent: f64,
    at_plain_rate: f64,
    steps: u32,
    /// Speculating steps seen at batch sizes with no plain rate yet.
    unmeasured: u32,
    pause_left: u32,
    next_pause: u32,
    num_pauses: u64,
}

impl SpecGovernor {
    /// Whether speculation is paused this step.
    pub fn paused(&self) -> bool {
        self.pause_left > 0
    }

    /// Steps left in the current pause.
    pub fn pause_left(&self) -> u32 {
        self.pause_left
    }

    /// Pauses begun so far (losing windows and plain-rate measurements).
    pub fn num_pauses(&self) -> u64 {
        self.num_pauses
    }

    /// The plain rate of `rows`-sequence decode steps (seconds per token), if measured.
    pub fn plain_rate(&self, rows: usize) -> Option<f64> {
        self.plain.get(rows).copied().filter(|&r| r > 0.0)
    }

    /// A scheduler step was planned (paused or not, as `paused()` said before): a pause counts down.
    pub fn tick(&mut self) {
        self.pause_left = self.pause_left.saturating_sub(1);
    }

    /// A finished step and its wall time.
    pub fn observe(&mut self, step: StepShape, secs: f64) {
        if step.prefill || step.rows == 0 || step.emitted == 0 || !(secs.is_finite() && secs > 0.0)
        {
            return;
        }
        if step.drafts == 0 {
            if self.plain.len() <= step.rows {
                self.plain.resize(step.rows + 1, 0.0);
            }
            let per_token = secs / step.emitted as f64;
            let rate = &mut self.plain[step.rows];
            *rate = if *rate > 0.0 {
                *rate + EMA * (per_token - *rate)
            } else {
                per_token
            };
            return;
        }
        let Some(rate) = self.plain_rate(step.rows) else {
            self.unmeasured += 1;
            if self.unmeasured >= WINDOW {
                self.unmeasured = 0;
                self.pause(BASELINE_STEPS);
            }
            return;
        };
        self.spent += secs;
        self.at_plain_rate += rate * step.emitted as f64;
        self.steps += 1;
        if self.steps < WINDOW {
            return;
        }
        if self.spent > self.at_plain_rate {
            let pause = self.next_pause.clamp(MIN_PAUSE, MAX_PAUSE);
            self.pause(pause);
            self.next_pause = pause.saturating_mul(2).min(MAX_PAUSE);
        } else {
            self.next_pause = MIN_PAUSE;
        }
        self.spent = 0.0;
        self.at_plain_rate = 0.0;
        self.steps = 0;
    }

    fn pause(&mut self, steps: u32) {
        self.pause_left = steps;
        self.num_pauses += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(rows: usize) -> StepShape {
        StepShape {
            rows,
            drafts: 0,
            emitted: rows,
            prefill: false,
        }
    }

    fn spec(rows: usize, drafts: usize, accepted: usize) -> StepShape {
        StepShape {
            rows,
            drafts,
            emitted: rows + accepted,
            prefill: false,
        }
    }

    /// Counts the steps of a pause (ticking until it ends).
    fn run_out(g: &mut SpecGovernor) -> u32 {
        let mut n = 0;
        while g.paused() {
            n += 1;
            g.tick();
        }
        n
    }

    #[test]
    fn losing_windows_pause_longer_and_longer() {
        let mut g = SpecGovernor::default();
        g.observe(plain(1), 0.010);
        assert_eq!(g.plain_rate(1), Some(0.010));
        let mut pauses = Vec::new();
        for _ in 0..8 {
            // 15 ms for a step that emitted 1 token: slower than the plain 10 ms.
            for i in 0..WINDOW {
                assert!(!g.paused(), "paused before the window ended (step {i})");
                g.observe(spec(1, 3, 0), 0.015);
            }
            assert!(g.paused());
            pauses.push(run_out(&mut g));
        }
        assert_eq!(pauses, [64, 128, 256, 512, 1024, 2048, 4096, 4096]);
        assert_eq!(g.num_pauses(), 8);
    }

    #[test]
    fn winning_windows_keep_speculating_and_reset_the_pause() {
        let mut g = SpecGovernor::default();
        g.observe(plain(2), 0.020); // 10 ms a token at batch 2
        for _ in 0..WINDOW {
            g.observe(spec(2, 8, 0), 0.030);
        }
        assert_eq!(run_out(&mut g), MIN_PAUSE);
        for _ in 0..WINDOW {
            g.observe(spec(2, 8, 0), 0.030);
        }
        assert_eq!(run_out(&mut g), 2 * MIN_PAUSE);
        // 30 ms for 2 + 4 tokens: 5 ms a token, faster than plain.
        for _ in 0..10 * WINDOW {
            g.observe(spec(2, 8, 4), 0.030);
            assert!(!g.paused());
        }
        for _ in 0..WINDOW {
            g.observe(spec(2, 8, 0), 0.030);
        }
        assert_eq!(
            run_out(&mut g),
            MIN_PAUSE,
            "a win in between resets the pause"
        );
    }

    #[test]
    fn a_window_is_judged_on_its_sum() {
        let mut g = SpecGovernor::default();
        g.observe(plain(1), 0.010);
        // Seven slow steps and one that emitted 9 tokens: 7 * 14 + 30 = 128 ms for 16 tokens (160 ms at
        // the plain rate) pays.
        for _ in 0..WINDOW - 1 {
            g.observe(spec(1, 8, 0), 0.014);
        }
        g.observe(spec(1, 8, 8), 0.030);
        assert!(!g.paused());
    }

    #[test]
    fn rates_are_per_batch_size_and_prefill_steps_are_ignored() {
        let mut g = SpecGovernor::default();
        g.observe(plain(1), 0.010);
        g.observe(plain(4), 0.016); // 4 ms a token
        g.observe(
            StepShape {
                prefill: true,
                ..plain(4)
            },
            1.0,
        );
        assert_eq!(g.plain_rate(4), Some(0.004));
        g.observe(plain(4), 0.024);
        assert!(
            (g.plain_rate(4).unwrap() - 0.0045).abs() < 1e-12,
            "EMA 0.25"
        );
        assert_eq!(g.plain_rate(2), None);
        for _ in 0..WINDOW {
            g.observe(spec(4, 8, 0), 0.020);
        }
        assert!(
            g.paused(),
            "20 ms for 4 tokens loses against 4.5 ms a token"
        );
        let mut g2 = SpecGovernor::default();
        g2.observe(plain(1), 0.010);
        g2.observe(plain(4), 0.016);
        for _ in 0..WINDOW {
            g2.observe(spec(4, 8, 2), 0.020); // 3.3 ms a token: pays at batch 4
        }
        assert!(!g2.paused());
    }

    #[test]
    fn unmeasured_batch_sizes_take_a_short_plain_pause() {
        let mut g = SpecGovernor::default();
        for _ in 0..WINDOW - 1 {
            g.observe(spec(3, 4, 0), 1.0);
        }
        assert!(!g.paused());
        g.observe(spec(3, 4, 0), 1.0);
        assert_eq!(run_out(&mut g), BASELINE_STEPS);
        g.observe(plain(3), 0.375);
        assert_eq!(g.plain_rate(3), Some(0.125));
    }

    #[test]
    fn bad_times_and_empty_steps_are_ignored() {
        let mut g = SpecGovernor::default();
        for secs in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            g.observe(plain(1), secs);
        }
        g.observe(plain(0), 0.01);
        assert_eq!(g.plain_rate(1), None);
        assert_eq!(g.plain_rate(0), None);
    }
}
