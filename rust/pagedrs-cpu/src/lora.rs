//! LoRA deltas of a batch that mixes adapters, on the CPU, in one call per layer: for each row `i` whose
//! adapter slot is `s = slots[i] >= 0`,
//!
//! ```text
//! t = A[s] @ x[i]                      (shrink: A[s] is [rank, k])
//! out[i, col0 .. col0 + width] += t @ Bt[s]  (expand: Bt[s] = B[s]^T is [rank, width], the scaling
//!                                             folded in; row r of it added t[r] times, r in order)
//! ```
//!
//! and rows with slot -1 (the base model) are left alone. Rank row `r` may be given an output column range
//! (`cols[r]`): the rank rows of one slice of a fused layer (q of q|k|v) then expand only into that
//! slice's columns, skipping the zeros of the block-diagonal B. This is punica's BGMV (one adapter per row,
//! gathered by index) for the few rows of a decode step: the torch form of the same arithmetic takes a
//! gather, two batched matmuls, a mask and a scatter per layer, whose per-op cost is most of a small
//! step's LoRA time. The rows are grouped by slot first (a counting sort), and rows of one slot go in
//! tiles of up to four that share each load of the adapter's rows (the reuse punica's SGMV gets from
//! grouping rows by adapter): a decode step's rows of one adapter, a prefill chunk's rows of a request. Rows are independent and each row's sums run in a fixed order, so a row gets the same bits
//! whatever the batch, the tiling or the thread count.

use crate::pool::{parallel_for, SharedOut};
use crate::KernelError;

/// Shapes of one call: x `[m, k]`; A `[num_slots, rank, k]`; Bt `[num_slots, rank, width]`; out rows of
/// `ldo` floats of which columns `col0 .. col0 + width` get the delta added.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoraDims {
    pub m: usize,
    pub k: usize,
    pub rank: usize,
    pub width: usize,
    pub num_slots: usize,
    pub ldo: usize,
    pub col0: usize,
}

/// Rows per task on the pool (rows grouped by slot): a row costs `rank * (k + width)` multiply-adds (tens
/// of thousands), so a few rows already pay for the hand-out; long calls (prefill chunks) take more, so
/// that more of a slot's rows share their adapter's loads in tiles of up to `TILE` rows.
const ROWS_PER_TASK: usize = 4;
const ROWS_PER_LONG_TASK: usize = 16;
const TILE: usize = 4;

/// `dot(a, x_j)` for `N` rows at once, each in 8 lanes then summed (vectorizes without reassociation:
/// every row gets the same bits as alone, on any CPU).
#[inline(always)]
fn dots<const N: usize>(a: &[f32], xs: &[&[f32]; N]) -> [f32; N] {
    let k = a.len();
    let full = k - k % 8;
    let mut acc = [[0.0f32; 8]; N];
    let mut c = 0;
    while c < full {
        let av = &a[c..c + 8];
        for (acc, x) in acc.iter_mut().zip(xs) {
            let xv = &x[c..c + 8];
            for l in 0..8 {
                acc[l] += av[l] * xv[l];
            }
        }
        c += 8;
    }
    let mut out = [0.0f32; N];
    for ((o, acc), x) in out.iter_mut().zip(&acc).zip(xs) {
        let tail: f32 = a[full..].iter().zip(&x[full..]).map(|(p, q)| p * q).sum();
        *o = ((acc[0] + acc[1]) + (acc[2] + acc[3]))
            + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
            + tail;
    }
    out
}

/// The delta of the `N` rows `idx` that share slot `s`: one pass over each rank row of `A[s]` and
/// `Bt[s]` serves all of them.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn tile<const N: usize>(
    x: &[f32],
    a_s: &[f32],
    b_s: &[f32],
    ranges: &[(usize, usize)],
    out: SharedOut,
    idx: &[usize],
    d: &LoraDims,
    t: &mut [f32],
) {
    let xs: [&[f32]; N] = std::array::from_fn(|j| &x[idx[j] * d.k..][..d.k]);
    for r in 0..d.rank {
        let v = dots::<N>(&a_s[r * d.k..][..d.k], &xs);
        for j in 0..N {
            t[j * d.rank + r] = v[j];
        }
    }
    // SAFETY: the rows' columns `col0 .. col0 + width` are inside `out` (checked by `lora_add`); the
    // rows are distinct and only this task writes them.
    #[allow(unsafe_code)]
    let mut rows: [&mut [f32]; N] = std::array::from_fn(|j| unsafe {
        std::slice::from_raw_parts_mut(out.at(idx[j] * d.ldo + d.col0), d.width)
    });
    for (r, &(c0, c1)) in ranges.iter().enumerate() {
        let w = &b_s[r * d.width..][c0..c1];
        for (j, row) in rows.iter_mut().enumerate() {
            let tr = t[j * d.rank + r];
            for (o, &w) in row[c0..c1].iter_mut().zip(w) {
                *o += tr * w;
            }
        }
    }
}

/// One call's operands, shared by its tasks.
struct Call<'a> {
    x: &'a [f32],
    a: &'a [f32],
    bt: &'a [f32],
    slots: &'a [i64],
    order: &'a [usize], // the rows that have a slot, grouped by slot
    ranges: &'a [(usize, usize)],
    out: SharedOut,
    d: &'a LoraDims,
}

/// Positions `lo..hi` of `c.order`: runs of one slot in tiles of up to `TILE`.
#[inline(always)]
fn rows_body(c: &Call, lo: usize, hi: usize) {
    let d = c.d;
    let mut t = vec![0.0f32; TILE * d.rank];
    let mut p = lo;
    while p < hi {
        let slot = c.slots[c.order[p]];
        let mut n = 1;
        while n < TILE && p + n < hi && c.slots[c.order[p + n]] == slot {
            n += 1;
        }
        let s = slot as usize; // `order` holds only rows with a slot
        let a_s = &c.a[s * d.rank * d.k..][..d.rank * d.k];
        let b_s = &c.bt[s * d.rank * d.width..][..d.rank * d.width];
        let idx = &c.order[p..p + n];
        match n {
            1 => tile::<1>(c.x, a_s, b_s, c.ranges, c.out, idx, d, &mut t),
            2 => tile::<2>(c.x, a_s, b_s, c.ranges, c.out, idx, d, &mut t),
            3 => tile::<3>(c.x, a_s, b_s, c.ranges, c.out, idx, d, &mut t),
            _ => tile::<4>(c.x, a_s, b_s, c.ranges, c.out, idx, d, &mut t),
        }
        p += n;
    }
}

/// `rows_body` compiled for AVX2 (wider vectors for the same operations in the same order: the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(unsafe_code)]
unsafe fn rows_avx2(c: &Call, lo: usize, hi: usize) {
    rows_body(c, lo, hi)
}

fn rows_portable(c: &Call, lo: usize, hi: usize) {
    rows_body(c, lo, hi)
}

/// The widest build of `rows_body` this CPU runs.
fn rows_fn() -> fn(&Call, usize, usize) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        #[allow(unsafe_code)]
        return |c, lo, hi| unsafe { rows_avx2(c, lo, hi) };
    }
    rows_portable
}

/// The rows that have a slot, grouped by slot (a counting sort, rows in order within a slot).
fn grouped_rows(slots: &[i64], num_slots: usize) -> Vec<usize> {
    let mut start = vec![0usize; num_slots + 1];
    for &s in slots.iter().filter(|&&s| s >= 0) {
        start[s as usize + 1] += 1;
    }
    for i in 0..num_slots {
        start[i + 1] += start[i];
    }
    let mut order = vec![0usize; start[num_slots]];
    for (i, &s) in slots.iter().enumerate() {
        if s >= 0 {
            order[start[s as usize]] = i;
            start[s as usize] += 1;
        }
    }
    order
}

/// Adds every row's LoRA delta of its slot to `out` (see the module docs).
/// `cols`: `[start, end)` of each rank row's columns within `0..width` (2 * rank values), or empty for
/// every column.
#[allow(clippy::too_many_arguments)]
pub fn lora_add(
    x: &[f32],
    a: &[f32],
    bt: &[f32],
    slots: &[i64],
    cols: &[i64],
    out: &mut [f32],
    d: &LoraDims,
    num_threads: usize,
) -> Result<(), KernelError> {
    KernelError::check_len("x", x.len(), d.m * d.k)?;
    KernelError::check_len("a", a.len(), d.num_slots * d.rank * d.k)?;
    KernelError::check_len("bt", bt.len(), d.num_slots * d.rank * d.width)?;
    KernelError::check_len("slots", slots.len(), d.m)?;
    KernelError::check_len("out", out.len(), d.m * d.ldo)?;
    if d.col0 + d.width > d.ldo {
        return Err(KernelError::Columns {
            col0: d.col0,
            n: d.width,
            ldo: d.ldo,
        });
    }
    let ranges: Vec<(usize, usize)> = if cols.is_empty() {
        vec![(0, d.width); d.rank]
    } else {
        KernelError::check_len("cols", cols.len(), 2 * d.rank)?;
        let mut v = Vec::with_capacity(d.rank);
        for (r, c) in cols.chunks_exact(2).enumerate() {
            if c[0] < 0 || c[0] > c[1] || c[1] > d.width as i64 {
                return Err(KernelError::RankColumns {
                    row: r,
                    start: c[0],
                    end: c[1],
                    width: d.width,
                });
            }
            v.push((c[0] as usize, c[1] as usize));
        }
        v
    };
    for (i, &s) in slots.iter().enumerate() {
        if s < -1 || s >= d.num_slots as i64 {
            return Err(KernelError::Row {
                index: i,
                id: s,
                n: d.num_slots,
            });
        }
    }
    if d.rank == 0 || d.width == 0 || d.k == 0 {
        return Ok(());
    }
    let order = grouped_rows(slots, d.num_slots);
    let n = order.len();
    let per_task = if n >= 4 * ROWS_PER_LONG_TASK {
        ROWS_PER_LONG_TASK
    } else {
        ROWS_PER_TASK
    };
    let call = Call {
        x,
        a,
        bt,
        slots,
        order: &order,
        ranges: &ranges,
        out: SharedOut::new(out),
        d,
    };
    let rows = rows_fn();
    parallel_for(num_threads, n.div_ceil(per_task), &|task| {
        let lo = task * per_task;
        rows(&call, lo, (lo + per_task).min(n));
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }

    /// With B as `[num_slots, width, rank]` (the kernel takes its transpose).
    fn reference(x: &[f32], a: &[f32], b: &[f32], slots: &[i64], out: &mut [f32], d: &LoraDims) {
        for i in 0..d.m {
            if slots[i] < 0 {
                continue;
            }
            let s = slots[i] as usize;
            let t: Vec<f64> = (0..d.rank)
                .map(|r| {
                    (0..d.k)
                        .map(|j| {
                            f64::from(a[(s * d.rank + r) * d.k + j]) * f64::from(x[i * d.k + j])
                        })
                        .sum()
                })
                .collect();
            for c in 0..d.width {
                let v: f64 = (0..d.rank)
                    .map(|r| f64::from(b[(s * d.width + c) * d.rank + r]) * t[r])
                    .sum();
                out[i * d.ldo + d.col0 + c] += v as f32;
            }
        }
    }

    /// Random x `[m, k]`, A, B `[num_slots, width, rank]` and its transpose Bt (what the kernel takes).
    #[allow(clippy::type_complexity)]
    fn random_case(seed: &mut u64, d: &LoraDims) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let x: Vec<f32> = (0..d.m * d.k).map(|_| lcg(seed)).collect();
        let a: Vec<f32> = (0..d.num_slots * d.rank * d.k).map(|_| lcg(seed)).collect();
        let b: Vec<f32> = (0..d.num_slots * d.width * d.rank)
            .map(|_| lcg(seed))
            .collect();
        let mut bt = vec![0.0f32; b.len()];
        for s in 0..d.num_slots {
            for c in 0..d.width {
                for r in 0..d.rank {
                    bt[(s * d.rank + r) * d.width + c] = b[(s * d.width + c) * d.rank + r];
                }
            }
        }
        (x, a, b, bt)
    }

    /// Every row run alone (m = 1) gives the bits it got in `batch`.
    #[allow(clippy::too_many_arguments)]
    fn assert_rows_alone(
        x: &[f32],
        a: &[f32],
        bt: &[f32],
        slots: &[i64],
        base: &[f32],
        batch: &[f32],
        d: &LoraDims,
    ) {
        for i in 0..d.m {
            let one = LoraDims { m: 1, ..*d };
            let mut row = base[i * d.ldo..][..d.ldo].to_vec();
            lora_add(
                &x[i * d.k..][..d.k],
                a,
                bt,
                &slots[i..=i],
                &[],
                &mut row,
                &one,
                1,
            )
            .unwrap();
            assert_eq!(row, batch[i * d.ldo..][..d.ldo], "row {i}");
        }
    }

    #[test]
    fn matches_a_reference_and_leaves_base_rows_and_other_columns_alone() {
        let mut seed = 7u64;
        for &(m, k, rank, width, slots_n) in
            &[(1, 64, 8, 24, 1), (9, 37, 5, 13, 3), (17, 96, 24, 40, 4)]
        {
            let d = LoraDims {
                m,
                k,
                rank,
                width,
                num_slots: slots_n,
                ldo: width + 7,
                col0: 3,
            };
            let (x, a, b, bt) = random_case(&mut seed, &d);
            let slots: Vec<i64> = (0..m).map(|i| (i % (slots_n + 1)) as i64 - 1).collect();
            let base: Vec<f32> = (0..m * d.ldo).map(|_| lcg(&mut seed)).collect();
            let mut want = base.clone();
            reference(&x, &a, &b, &slots, &mut want, &d);
            let mut full = base.clone();
            lora_add(&x, &a, &bt, &slots, &[], &mut full, &d, 1).unwrap();
            for (at, (&g, &w)) in full.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                    "m{m} k{k} [{at}]: {g} vs {w}"
                );
                let (i, c) = (at / d.ldo, at % d.ldo);
                if slots[i] < 0 || c < 3 || c >= 3 + width {
                    assert_eq!(g.to_bits(), base[at].to_bits(), "touched [{i}, {c}]");
                }
            }
            // column ranges: with B zero outside each rank row's range, the same result
            let ranges: Vec<i64> = (0..rank)
                .flat_map(|r| {
                    let c0 = (r * width / rank) as i64;
                    [c0, (c0 + 1 + (r % 3) as i64).min(width as i64)]
                })
                .collect();
            let mut bz = bt.clone();
            for s in 0..slots_n {
                for r in 0..rank {
                    for c in 0..width {
                        if (c as i64) < ranges[2 * r] || (c as i64) >= ranges[2 * r + 1] {
                            bz[(s * rank + r) * width + c] = 0.0;
                        }
                    }
                }
            }
            let (mut dense, mut ranged) = (base.clone(), base.clone());
            lora_add(&x, &a, &bz, &slots, &[], &mut dense, &d, 1).unwrap();
            lora_add(&x, &a, &bz, &slots, &ranges, &mut ranged, &d, 2).unwrap();
            for (g, w) in ranged.iter().zip(&dense) {
                assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "ranged {g} vs {w}");
            }
            // each row's bits do not depend on the batch around it or the threads
            for threads in [2, 3] {
                let mut again = base.clone();
                lora_add(&x, &a, &bt, &slots, &[], &mut again, &d, threads).unwrap();
                assert_eq!(again, full);
            }
            assert_rows_alone(&x, &a, &bt, &slots, &base, &full, &d);
        }
    }

    #[test]
    fn tiles_of_one_slot_give_each_row_its_bits_alone() {
        // runs of one slot as a prefill chunk has them (tiles of 1-4 rows, tails, base rows between),
        // enough rows for the long tasks
        let mut seed = 11u64;
        let (m, k, rank, width, slots_n) = (70, 45, 6, 21, 3);
        let d = LoraDims {
            m,
            k,
            rank,
            width,
            num_slots: slots_n,
            ldo: width + 2,
            col0: 1,
        };
        let (x, a, b, bt) = random_case(&mut seed, &d);
        let runs = [7usize, 1, 3, 5, 2, 9, 4, 6, 1, 8, 3, 2, 19];
        let mut slots = Vec::new();
        for (n, &len) in runs.iter().enumerate() {
            slots.extend(std::iter::repeat_n((n % (slots_n + 1)) as i64 - 1, len));
        }
        assert_eq!(slots.len(), m);
        let base: Vec<f32> = (0..m * d.ldo).map(|_| lcg(&mut seed)).collect();
        let mut want = base.clone();
        reference(&x, &a, &b, &slots, &mut want, &d);
        for threads in [1, 2, 3] {
            let mut got = base.clone();
            lora_add(&x, &a, &bt, &slots, &[], &mut got, &d, threads).unwrap();
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{g} vs {w}");
            }
            assert_rows_alone(&x, &a, &bt, &slots, &base, &got, &d);
        }
    }

    #[test]
    fn bad_arguments_are_errors() {
        let d = LoraDims {
            m: 2,
            k: 4,
            rank: 2,
            width: 3,
            num_slots: 2,
            ldo: 3,
            col0: 0,
        };
        let (x, a, b) = (vec![0.0; 8], vec![0.0; 16], vec![0.0; 12]);
        let mut out = vec![0.0; 6];
        assert!(matches!(
            lora_add(&x, &a, &b, &[0, 2], &[], &mut out, &d, 1),
            Err(KernelError::Row {
                index: 1,
                id: 2,
                n: 2
            })
        ));
        assert!(matches!(
            lora_add(&x, &a[..8], &b, &[0, -1], &[], &mut out, &d, 1),
            Err(KernelError::Length { name: "a", .. })
        ));
        assert!(matches!(
            lora_add(&x, &a, &b[..6], &[0, -1], &[], &mut out, &d, 1),
            Err(KernelError::Length { name: "bt", .. })
        ));
        assert!(matches!(
            lora_add(&x, &a, &b, &[0, -1], &[0, 4, 0, 1], &mut out, &d, 1),
            Err(KernelError::RankColumns { row: 0, .. })
        ));
        let wide = LoraDims { col0: 1, ..d };
        assert!(matches!(
            lora_add(&x, &a, &b, &[0, -1], &[], &mut out, &wide, 1),
            Err(KernelError::Columns { .. })
        ));
    }
}
