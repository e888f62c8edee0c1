//! The persistent block table: one row per running sequence, kept across steps and rewritten in
//! place only where a sequence's blocks changed, so a runner copies only those rows to the device
//! instead of rebuilding a padded `[B, max_blocks]` table every step.
//!
//! A row belongs to one running sequence from the moment it starts running (admitted, swapped in,
//! forked) until it stops (finished, aborted, preempted). Changes are recorded as they happen and
//! written at the next `flush()`, which only `schedule()` calls: between two `schedule()` calls the
//! table does not change, so a plan's rows stay valid until the next plan.

use crate::request::Seq;

/// `[num_rows, width]` int32, row-major. Entries past a row's last block are 0.
#[derive(Debug)]
pub struct BlockTable {
    // INVARIANT: allocated once with its final size and never reallocated (Python holds a
    // zero-copy view of it for the scheduler's whole life).
    data: Box<[i32]>,
    width: usize,
    /// The sequence slot owning each row; None while the row is free.
    owner: Vec<Option<u32>>,
    /// How many leading entries of each row may be non-zero (its table length when last written).
    written: Vec<u32>,
    /// First entry of each row to rewrite at the next flush; None while the row is clean.
    dirty_from: Vec<Option<u32>>,
    // INVARIANT: a row is in `dirty` iff `dirty_from[row]` is Some (so it appears once).
    dirty: Vec<u32>,
    /// Free rows, lowest on top: rows in use stay packed at the front of the table.
    free: Vec<u32>,
}

impl BlockTable {
    pub fn new(num_rows: usize, width: usize) -> Self {
        Self {
            data: vec![0; num_rows * width].into_boxed_slice(),
            width,
            owner: vec![None; num_rows],
            written: vec![0; num_rows],
            dirty_from: vec![None; num_rows],
            dirty: Vec::new(),
            free: (0..num_rows as u32).rev().collect(),
        }
    }

    pub fn num_rows(&self) -> usize {
        self.owner.len()
    }

    /// Entries per row: `ceil(max_model_len / block_size)`.
    pub fn width(&self) -> usize {
        self.width
    }

    /// The whole table, row-major.
    pub fn as_slice(&self) -> &[i32] {
        &self.data
    }

    pub fn row(&self, row: u32) -> &[i32] {
        let r = row as usize * self.width;
        &self.data[r..r + self.width]
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// A free row for sequence `slot`, to be written in full at the next flush.
    pub(crate) fn acquire(&mut self, slot: u32) -> u32 {
        let row = self
            .free
            .pop()
            .expect("a free block-table row: running sequences never exceed max_num_seqs");
        self.owner[row as usize] = Some(slot);
        self.mark(row, 0);
        row
    }

    /// Frees `row`. Its contents stay as they are until the row is reused (so a plan that names
    /// it stays readable until the next `schedule()`).
    pub(crate) fn release(&mut self, row: u32) {
        debug_assert!(self.owner[row as usize].is_some(), "row {row} freed twice");
        self.owner[row as usize] = None;
        self.free.push(row);
    }

    /// Entries `from..` of `row` changed in its owner's block table.
    pub(crate) fn mark(&mut self, row: u32, from: usize) {
        let from = from as u32;
        match &mut self.dirty_from[row as usize] {
            Some(f) => *f = (*f).min(from),
            d @ None => {
                *d = Some(from);
                self.dirty.push(row);
            }
        }
    }

    /// Writes every changed row from its owner's block table; appends the rows written to
    /// `changed`.
    pub(crate) fn flush(&mut self, seqs: &[Seq], changed: &mut Vec<i32>) {
        let w = self.width;
        for row in self.dirty.drain(..) {
            let r = row as usize;
            let from = self.dirty_from[r].take().expect("a dirty row has a start") as usize;
            let Some(slot) = self.owner[r] else {
                continue; // freed since it was marked; rewritten in full when reused
            };
            let table = &seqs[slot as usize].block_table;
            assert!(
                table.len() <= w,
                "block table of {} blocks exceeds the row width {w}",
                table.len()
            );
            let dst = &mut self.data[r * w..(r + 1) * w];
            let from = from.min(table.len());
            for (d, &b) in dst[from..table.len()].iter_mut().zip(&table[from..]) {
                *d = b as i32;
            }
            let old = self.written[r] as usize;
            if old > table.len() {
                dst[table.len()..old].fill(0);
            }
            self.written[r] = table.len() as u32;
            changed.push(row as i32);
        }
    }

    /// Every owned row belongs to a running sequence that names it, and clean rows hold exactly
    /// their owner's block table followed by zeros.
    pub(crate) fn check(&self, seqs: &[Seq]) -> Result<(), String> {
        let mut owned = 0;
        for (r, owner) in self.owner.iter().enumerate() {
            let Some(slot) = *owner else { continue };
            owned += 1;
            let seq = &seqs[slot as usize];
            if !seq.alive || seq.row != Some(r as u32) {
                return Err(format!(
                    "block-table row {r} is owned by slot {slot}, which does not hold it"
                ));
            }
            if self.dirty_from[r].is_none() {
                let row = self.row(r as u32);
                let n = seq.block_table.len();
                let same = row[..n]
                    .iter()
                    .zip(&seq.block_table)
                    .all(|(&a, &b)| a == b as i32);
                if !same || row[n..].iter().any(|&x| x != 0) {
                    return Err(format!(
                        "block-table row {r} of seq {} differs from its block table",
                        seq.seq_id
                    ));
                }
            }
        }
        if owned + self.free.len() != self.num_rows() {
            return Err(format!(
                "block-table rows: {owned} owned + {} free != {}",
                self.free.len(),
                self.num_rows()
            ));
        }
        if self.dirty.len() != self.dirty_from.iter().filter(|d| d.is_some()).count() {
            return Err("block-table dirty list and dirty marks disagree".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_reused_lowest_first_and_written_lazily() {
        let mut t = BlockTable::new(3, 4);
        assert_eq!(t.acquire(7), 0);
        assert_eq!(t.acquire(8), 1);
        t.release(0);
        assert_eq!(t.acquire(9), 0);
        assert_eq!(t.num_free(), 1);
        assert_eq!(t.as_slice().len(), 12);
        assert!(t.as_slice().iter().all(|&x| x == 0));
    }
}
