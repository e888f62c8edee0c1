//! Token ranges of a prompt that one prefill chunk must take whole: a multimodal item whose tokens
//! attend to each other both ways (Gemma 3's images), as vLLM keeps such an item in one chunk. A
//! chunk may start inside a span (after a prefix-cache hit) but never ends strictly inside one.

use std::collections::HashMap;

/// Spans by sequence id, each `(start, end)` in prompt positions, sorted, disjoint.
#[derive(Debug, Default)]
pub struct AtomicSpans {
    by_seq: HashMap<i64, Vec<(usize, usize)>>,
}

impl AtomicSpans {
    pub fn set(&mut self, seq_id: i64, mut spans: Vec<(usize, usize)>) {
        spans.retain(|&(s, e)| e > s + 1);
        spans.sort_unstable();
        if spans.is_empty() {
            self.by_seq.remove(&seq_id);
        } else {
            self.by_seq.insert(seq_id, spans);
        }
    }

    pub fn remove(&mut self, seq_id: i64) {
        self.by_seq.remove(&seq_id);
    }

    /// `num_new` tokens from `nc` cut back so the chunk does not end inside a span: to the span's
    /// start, or 0 (wait for a larger budget) when the chunk starts at or inside that span.
    pub fn cut(&self, seq_id: i64, nc: usize, num_new: usize) -> usize {
        if self.by_seq.is_empty() {
            return num_new;
        }
        let Some(spans) = self.by_seq.get(&seq_id) else {
            return num_new;
        };
        let end = nc + num_new;
        for &(s, e) in spans {
            if s < end && end < e {
                return s.saturating_sub(nc);
            }
        }
        num_new
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cut_never_ends_inside_a_span() {
        let mut a = AtomicSpans::default();
        a.set(7, vec![(10, 14), (20, 21)]);
        assert_eq!(a.cut(7, 0, 8), 8); // ends before the span
        assert_eq!(a.cut(7, 0, 12), 10); // cut back to its start
        assert_eq!(a.cut(7, 0, 14), 14); // takes it whole
        assert_eq!(a.cut(7, 10, 2), 0); // starts at the span, cannot take it whole: wait
        assert_eq!(a.cut(7, 12, 2), 2); // starts inside (a prefix hit), ends at its end
        assert_eq!(a.cut(7, 19, 2), 2); // one-token spans are dropped
        assert_eq!(a.cut(8, 0, 12), 12); // another sequence
        a.remove(7);
        assert_eq!(a.cut(7, 0, 12), 12);
    }
}
