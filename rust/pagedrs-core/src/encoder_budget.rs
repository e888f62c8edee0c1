//! The image-encoder work one step may schedule, as vLLM's `max_num_encoder_input_tokens`: a prompt
//! chunk that reaches an image's tokens runs the image's encoder (its whole output, once), so the
//! encoder rows of the images the step's chunks reach first are summed against a per-step budget. A
//! chunk that would reach an image past the budget stops at the image's start (0 tokens, waiting for
//! a later step, when it starts at or inside it). An image larger than the whole budget is refused when
//! the request is added (by the caller), so every image fits some step.

use std::collections::HashMap;

/// A sequence's image spans `(start, end)` in prompt positions, sorted, and how far its chunks were
/// scheduled: an image starting below that mark was charged in an earlier step.
#[derive(Debug, Default)]
struct SeqItems {
    spans: Vec<(usize, usize)>,
    scheduled_to: usize,
}

#[derive(Debug)]
pub struct EncoderBudget {
    limit: usize,
    remaining: usize,
    by_seq: HashMap<i64, SeqItems>,
}

impl Default for EncoderBudget {
    fn default() -> Self {
        Self {
            limit: usize::MAX,
            remaining: usize::MAX,
            by_seq: HashMap::new(),
        }
    }
}

impl EncoderBudget {
    pub fn limit(&self) -> usize {
        self.limit
    }

    pub fn set_limit(&mut self, limit: usize) {
        self.limit = limit;
        self.remaining = limit;
    }

    /// Called at the start of each step: the whole budget is free again.
    pub fn start_step(&mut self) {
        self.remaining = self.limit;
    }

    pub fn set(&mut self, seq_id: i64, mut spans: Vec<(usize, usize)>) {
        spans.retain(|&(s, e)| e > s);
        spans.sort_unstable();
        if spans.is_empty() {
            self.by_seq.remove(&seq_id);
        } else {
            let scheduled_to = 0;
            self.by_seq.insert(
                seq_id,
                SeqItems {
                    spans,
                    scheduled_to,
                },
            );
        }
    }

    pub fn remove(&mut self, seq_id: i64) {
        self.by_seq.remove(&seq_id);
    }

    /// The sequence lost its computed tokens (preempted for recompute): its images count again.
    pub fn restart(&mut self, seq_id: i64) {
        if let Some(items) = self.by_seq.get_mut(&seq_id) {
            items.scheduled_to = 0;
        }
    }

    /// `num_new` tokens from `nc` cut back so the images the chunk reaches first fit the step's
    /// remaining budget: to the start of the first one that does not, or 0 when the chunk starts at
    /// or inside it.
    pub fn cut(&self, seq_id: i64, nc: usize, num_new: usize) -> usize {
        let Some(items) = self.by_seq.get(&seq_id) else {
            return num_new;
        };
        let mut left = self.remaining;
        for &(s, e) in &items.spans {
            if s >= nc + num_new {
                break;
            }
            if e <= nc || s < items.scheduled_to {
                continue; // behind the chunk, or charged by an earlier step
            }
            if e - s > left {
                return s.saturating_sub(nc);
            }
            left -= e - s;
        }
        num_new
    }

    /// Charges the images a scheduled chunk `[nc, nc + num_new)` reaches first.
    pub fn charge(&mut self, seq_id: i64, nc: usize, num_new: usize) {
        let Some(items) = self.by_seq.get_mut(&seq_id) else {
            return;
        };
        let end = nc + num_new;
        for &(s, e) in &items.spans {
            if s < end && e > nc && s >= items.scheduled_to {
                self.remaining = self.remaining.saturating_sub(e - s);
            }
        }
        items.scheduled_to = items.scheduled_to.max(end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_reaches_no_more_images_than_the_budget() {
        let mut b = EncoderBudget::default();
        assert_eq!(b.cut(7, 0, 100), 100); // no images, no limit
        b.set_limit(12);
        b.set(7, vec![(20, 24), (3, 7)]); // 4 rows each
        b.set(8, vec![(0, 12)]);
        assert_eq!(b.cut(7, 0, 30), 30); // 8 rows fit 12
        b.charge(7, 0, 30);
        assert_eq!(b.cut(8, 0, 5), 0); // 12 rows, 4 left: wait
        assert_eq!(b.cut(7, 30, 4), 4); // images behind: no charge
        b.start_step();
        assert_eq!(b.cut(8, 0, 5), 5);
        b.charge(8, 0, 5);
        assert_eq!(b.cut(8, 5, 5), 5); // the rest of a charged image is free
        b.set(9, vec![(2, 6), (8, 12)]);
        assert_eq!(b.cut(9, 0, 10), 2); // the budget spent: it stops at its first image
    }

    #[test]
    fn cut_stops_before_the_image_that_does_not_fit() {
        let mut b = EncoderBudget::default();
        b.set_limit(6);
        b.set(1, vec![(2, 6), (8, 12)]);
        assert_eq!(b.cut(1, 0, 16), 8); // the first fits, the second does not: stop at 8
        b.charge(1, 0, 8);
        b.start_step();
        assert_eq!(b.cut(1, 8, 8), 8); // the next step takes it
        b.restart(1); // recomputed from 0: both count again
        b.start_step();
        assert_eq!(b.cut(1, 0, 16), 8);
        assert_eq!(b.cut(1, 4, 12), 4); // a prefix hit inside the first image: it still counts
        b.remove(1);
        assert_eq!(b.cut(1, 0, 16), 16);
    }
}
