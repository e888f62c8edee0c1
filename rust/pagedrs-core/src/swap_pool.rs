//! The host (CPU) swap pool: blocks of preempted-by-swap sequences.

#[derive(Debug, Clone)]
pub struct SwapPool {
    ref_cnt: Vec<u32>,
    // INVARIANT: a swap block is on the free stack iff its ref count is 0.
    free: Vec<u32>,
}

impl SwapPool {
    pub fn new(num_blocks: usize) -> Self {
        Self {
            ref_cnt: vec![0; num_blocks],
            free: (0..num_blocks as u32).rev().collect(),
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_cnt.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn ref_count(&self, b: u32) -> u32 {
        self.ref_cnt[b as usize]
    }

    pub fn allocate(&mut self) -> Option<u32> {
        let b = self.free.pop()?;
        self.ref_cnt[b as usize] = 1;
        Some(b)
    }

    pub fn free(&mut self, b: u32) {
        let r = &mut self.ref_cnt[b as usize];
        debug_assert!(*r > 0, "double free of swap block {b}");
        *r -= 1;
        if *r == 0 {
            self.free.push(b);
        }
    }

    pub fn check(&self) -> Result<(), String> {
        let mut seen = vec![false; self.num_blocks()];
        for &b in &self.free {
            let i = b as usize;
            if i >= seen.len() || seen[i] || self.ref_cnt[i] != 0 {
                return Err(format!(
                    "swap block {b} is free twice, out of range or referenced"
                ));
            }
            seen[i] = true;
        }
        if let Some(b) = (0..seen.len()).find(|&b| !seen[b] && self.ref_cnt[b] == 0) {
            return Err(format!("swap block {b} has no refs but is not free"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_free_roundtrip() {
        let mut s = SwapPool::new(2);
        let a = s.allocate().unwrap();
        let b = s.allocate().unwrap();
        assert_eq!((a, b), (0, 1));
        assert!(s.allocate().is_none());
        s.free(a);
        assert_eq!(s.num_free(), 1);
        s.check().unwrap();
        s.free(b);
        assert_eq!(s.num_free(), 2);
        s.check().unwrap();
    }
}
