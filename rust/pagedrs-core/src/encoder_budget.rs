//! The image-encoder work one step may schedule, as vLLM's `max_num_encoder_input_tokens`: a prompt
//! chunk that reaches an image's tokens runs the image's encoder (its whole output, once), so the
//! encoder rows of the images the step's chunks reach first are summed against a per-step budget. A
//! chunk that would reach an image past the budget stops at the image's start (0 tokens, waiting for
//! a later step, when it starts at or inside it). An image larger than the whole budget is refused when
//! the request is added (by the caller), so every image fits some step.
//!
//! An image is charged once, as vLLM's encoder cache manager does: one whose output the runner's
//! encoder cache holds (`update_cached`, told before each step) or that the step already charged (the
//! same image hash in another request or twice in one prompt) costs nothing. A sequence preempted for
//! recompute reaches its images again: charged again only where their outputs left the cache.

use std::collections::{HashMap, HashSet};

/// One image of a sequence: prompt positions `[start, end)` and the image's hash (its encoder output's
/// key in the runner's cache).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Span {
    start: usize,
    end: usize,
    key: String,
}

/// A sequence's image spans, sorted, and how far its chunks were scheduled: an image starting below
/// that mark was charged in an earlier step.
#[derive(Debug, Default)]
struct SeqItems {
    spans: Vec<Span>,
    scheduled_to: usize,
}

#[derive(Debug)]
pub struct EncoderBudget {
    limit: usize,
    remaining: usize,
    by_seq: HashMap<i64, SeqItems>,
    /// Image hashes whose encoder output the runner's cache holds at the start of this step.
    cached: HashSet<String>,
    /// Image hashes charged in this step (their encoder runs once in it).
    step_keys: HashSet<String>,
    /// Encoder rows charged in this step.
    charged: usize,
}

impl Default for EncoderBudget {
    fn default() -> Self {
        Self {
            limit: usize::MAX,
            remaining: usize::MAX,
            by_seq: HashMap::new(),
            cached: HashSet::new(),
            step_keys: HashSet::new(),
            charged: 0,
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
        self.step_keys.clear();
        self.charged = 0;
    }

    /// Encoder rows charged by the current (last scheduled) step.
    pub fn charged(&self) -> usize {
        self.charged
    }

    /// The runner's encoder cache changed: `added` hashes are held now, `removed` ones not.
    pub fn update_cached(&mut self, added: Vec<String>, removed: Vec<String>) {
        for key in removed {
            self.cached.remove(&key);
        }
        self.cached.extend(added);
    }

    /// `spans`: `(start, end, image hash)` of each image of `seq_id`.
    pub fn set(&mut self, seq_id: i64, spans: Vec<(usize, usize, String)>) {
        let mut spans: Vec<Span> = spans
            .into_iter()
            .filter(|(s, e, _)| e > s)
            .map(|(start, end, key)| Span { start, end, key })
            .collect();
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

    /// The sequence lost its computed tokens (preempted for recompute): its images count again, unless
    /// their outputs are still cached.
    pub fn restart(&mut self, seq_id: i64) {
        if let Some(items) = self.by_seq.get_mut(&seq_id) {
            items.scheduled_to = 0;
        }
    }

    /// Whether reaching `span` costs nothing: charged by an earlier step of the sequence, or its
    /// output cached or charged by this step already.
    fn free(&self, span: &Span, scheduled_to: usize) -> bool {
        span.start < scheduled_to
            || self.cached.contains(&span.key)
            || self.step_keys.contains(&span.key)
    }

    /// `num_new` tokens from `nc` cut back so the images the chunk reaches first fit the step's
    /// remaining budget: to the start of the first one that does not, or 0 when the chunk starts at
    /// or inside it.
    pub fn cut(&self, seq_id: i64, nc: usize, num_new: usize) -> usize {
        let Some(items) = self.by_seq.get(&seq_id) else {
            return num_new;
        };
        let mut left = self.remaining;
        let mut seen: Vec<&str> = Vec::new(); // charged by this chunk (an image twice in one prompt)
        for span in &items.spans {
            if span.start >= nc + num_new {
                break;
            }
            if span.end <= nc
                || self.free(span, items.scheduled_to)
                || seen.contains(&span.key.as_str())
            {
                continue; // behind the chunk, or charged already
            }
            if span.end - span.start > left {
                return span.start.saturating_sub(nc);
            }
            left -= span.end - span.start;
            seen.push(&span.key);
        }
        num_new
    }

    /// Charges the images a scheduled chunk `[nc, nc + num_new)` reaches first.
    pub fn charge(&mut self, seq_id: i64, nc: usize, num_new: usize) {
        let Some(items) = self.by_seq.get(&seq_id) else {
            return;
        };
        let end = nc + num_new;
        let mut rows = 0;
        let mut keys = Vec::new();
        for span in &items.spans {
            let free = self.free(span, items.scheduled_to) || keys.contains(&span.key);
            if span.start < end && span.end > nc && !free {
                rows += span.end - span.start;
                keys.push(span.key.clone());
            }
        }
        self.remaining = self.remaining.saturating_sub(rows);
        self.charged += rows;
        self.step_keys.extend(keys);
        if let Some(items) = self.by_seq.get_mut(&seq_id) {
            items.scheduled_to = items.scheduled_to.max(end);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spans with a distinct image each (keys `seq:i`).
    fn distinct(seq: i64, spans: &[(usize, usize)]) -> Vec<(usize, usize, String)> {
        let key = |i: usize| format!("{seq}:{i}");
        spans
            .iter()
            .enumerate()
            .map(|(i, &(s, e))| (s, e, key(i)))
            .collect()
    }

    fn keyed(spans: &[(usize, usize, &str)]) -> Vec<(usize, usize, String)> {
        spans
            .iter()
            .map(|&(s, e, k)| (s, e, k.to_string()))
            .collect()
    }

    #[test]
    fn a_step_reaches_no_more_images_than_the_budget() {
        let mut b = EncoderBudget::default();
        assert_eq!(b.cut(7, 0, 100), 100); // no images, no limit
        b.set_limit(12);
        b.set(7, distinct(7, &[(20, 24), (3, 7)])); // 4 rows each
        b.set(8, distinct(8, &[(0, 12)]));
        assert_eq!(b.cut(7, 0, 30), 30); // 8 rows fit 12
        b.charge(7, 0, 30);
        assert_eq!(b.cut(8, 0, 5), 0); // 12 rows, 4 left: wait
        assert_eq!(b.cut(7, 30, 4), 4); // images behind: no charge
        b.start_step();
        assert_eq!(b.cut(8, 0, 5), 5);
        b.charge(8, 0, 5);
        assert_eq!(b.cut(8, 5, 5), 5); // the rest of a charged image is free
        b.set(9, distinct(9, &[(2, 6), (8, 12)]));
        assert_eq!(b.cut(9, 0, 10), 2); // the budget spent: it stops at its first image
    }

    #[test]
    fn cut_stops_before_the_image_that_does_not_fit() {
        let mut b = EncoderBudget::default();
        b.set_limit(6);
        b.set(1, distinct(1, &[(2, 6), (8, 12)]));
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

    #[test]
    fn an_image_is_charged_once_per_hash() {
        let mut b = EncoderBudget::default();
        b.set_limit(8);
        b.set(1, keyed(&[(2, 6, "a"), (8, 12, "a")])); // the same image twice in one prompt
        b.set(2, keyed(&[(0, 4, "a"), (5, 9, "b")]));
        b.start_step();
        assert_eq!(b.cut(1, 0, 16), 16);
        b.charge(1, 0, 16);
        assert_eq!(b.charged(), 4); // 4 rows, not 8
        assert_eq!(b.cut(2, 0, 12), 12); // "a" charged by this step; "b" fits the 4 left
        b.charge(2, 0, 12);
        assert_eq!(b.charged(), 8);
        b.set(3, keyed(&[(0, 4, "c")]));
        assert_eq!(b.cut(3, 0, 6), 0); // the budget is spent
        b.start_step();
        b.update_cached(vec!["a".into(), "b".into()], vec![]);
        b.set(4, keyed(&[(1, 5, "b"), (6, 10, "c")]));
        assert_eq!(b.cut(4, 0, 12), 12);
        b.charge(4, 0, 12);
        assert_eq!(b.charged(), 4); // "b" cached: only "c"
    }

    #[test]
    fn a_restarted_sequence_pays_again_only_for_dropped_outputs() {
        let mut b = EncoderBudget::default();
        b.set_limit(8);
        b.set(1, keyed(&[(0, 4, "a"), (6, 10, "b")]));
        b.charge(1, 0, 12);
        assert_eq!(b.charged(), 8);
        b.update_cached(vec!["a".into(), "b".into()], vec![]);
        b.restart(1); // preempted for recompute; both outputs cached
        b.start_step();
        b.charge(1, 0, 12);
        assert_eq!(b.charged(), 0);
        b.update_cached(vec![], vec!["b".into()]); // the runner evicted "b"
        b.restart(1);
        b.start_step();
        assert_eq!(b.cut(1, 0, 12), 12);
        b.charge(1, 0, 12);
        assert_eq!(b.charged(), 4);
    }
}
