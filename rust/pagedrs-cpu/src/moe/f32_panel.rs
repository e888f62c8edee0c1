//! The float32 experts' matmul on AVX2 + FMA, any rows per expert.
//!
//! Experts of 1-3 rows (a decode step's usual case: bounded by reading the weights) take the weights one
//! row at a time from `STREAMS` (3 for 3 rows) places of the run at once: so many long sequential
//! streams, which the hardware prefetchers run ahead on together (one Zen 4 core reads ~25 GB/s from 4-8
//! streams, 18-21 GB/s from one). Larger experts are split into groups of at most 4 rows and the weights
//! are read one panel of `PANEL` rows at a time: every group passes the panel (from memory once, then from
//! L1) in register tiles of R activation rows x C weight rows (R*C accumulators, C weight vectors and one
//! activation vector within the 16 ymm registers, at least 8 independent FMA chains), so each weight load
//! serves R rows and each activation load C weight rows. A tile reads C short streams, which the hardware
//! prefetchers follow poorly: the rows `AHEAD` tiles on are prefetched into L2, a line per line consumed.
//!
//! Measured on one core of a 2-core AMD EPYC (Zen 4), 768 x 768 weights in DRAM (thread CPU time, quiet
//! machine): 1 row 24-28 GB/s, 2 rows 23-25, 3 rows 21-23, 4 rows 20-22, 8 rows 14 (50-60 GFLOP/s),
//! 32 rows 82 GFLOP/s; weights in L2, 4-32 rows 90-100 GFLOP/s (the two FMA pipes' peak). AVX-512 would
//! add no FMA throughput on Zen 4 (its 512-bit FMAs take both 256-bit pipes).

use crate::pool::SharedOut;
use std::arch::x86_64::*;

/// Weight rows per panel: a multiple of every tile width below; 12 rows of a 768-wide expert (36 KB)
/// come back from L1/L2 for the expert's later groups of rows.
const PANEL: usize = 12;
/// How many tiles ahead the weight stream is prefetched.
const AHEAD: usize = 2;
/// Up to this many rows per expert, one weight row at a time from `STREAMS` places (`Tile::far`).
const ROW_AT_A_TIME: usize = 2;
/// Weight streams of the one-row-at-a-time experts: rows a quarter of the run apart.
const STREAMS: usize = 4;

/// Weight rows `rows` of `w` (`[n, kdim]`) against the `m` rows of `a` (`[m, kdim]`), into `out` rows
/// `s0..s0 + m` (width `n`).
///
/// # Safety
/// The CPU has AVX2 and FMA; `out` holds rows `s0..s0 + m` of `n` floats, and only this call writes
/// their columns `rows`; `rows.end <= n` and `w` holds `n * kdim` floats.
#[target_feature(enable = "avx2,fma")]
#[allow(unsafe_code)]
pub(super) unsafe fn panel(
    w: &[f32],
    a: &[f32],
    kdim: usize,
    out: SharedOut,
    s0: usize,
    n: usize,
    rows: std::ops::Range<usize>,
) {
    let m = a.len() / kdim.max(1);
    if m == 0 || kdim == 0 {
        return;
    }
    let tile = |i: usize, end: usize| Tile {
        w,
        a,
        i,
        kdim,
        o: out.at((s0 + i) * n),
        n,
        end,
    };
    if m <= ROW_AT_A_TIME {
        // the run's quarters side by side, the rows left over one at a time
        let t = tile(0, 0);
        let q = rows.len() / STREAMS;
        for j in rows.start..rows.start + q {
            match m {
                2 => t.far::<2, STREAMS>(j, q),
                _ => t.far::<1, STREAMS>(j, q),
            }
        }
        for j in rows.start + STREAMS * q..rows.end {
            match m {
                2 => t.row::<2>(j),
                _ => t.row::<1>(j),
            }
        }
        return;
    }
    // groups of rows as even as 4-row groups allow: 5 -> 3 + 2, 6 -> 3 + 3, 7 -> 4 + 3
    let groups = m.div_ceil(4);
    if m == 3 {
        // three streams of 3 rows: 9 accumulators, as sequential as the one-row-at-a-time experts
        let t = tile(0, 0);
        let q = rows.len() / 3;
        for j in rows.start..rows.start + q {
            t.far::<3, 3>(j, q);
        }
        for j in rows.start + 3 * q..rows.end {
            t.far::<3, 1>(j, 0);
        }
        return;
    }
    let mut j0 = rows.start;
    while j0 < rows.end {
        let jend = (j0 + PANEL).min(rows.end);
        let mut i = 0;
        for g in 0..groups {
            let r = (m - i).div_ceil(groups - g);
            let t = tile(i, if g == 0 { rows.end } else { 0 });
            match r {
                4 => t.panel::<4, 3>(j0, jend),
                3 => t.panel::<3, 3>(j0, jend),
                _ => t.panel::<2, 4>(j0, jend),
            }
            i += r;
        }
        j0 = jend;
    }
}

/// Activation rows `i..`, output cells from `o` (row stride `n`, column 0 of the expert's output).
struct Tile<'a> {
    w: &'a [f32],
    a: &'a [f32],
    i: usize,
    kdim: usize,
    o: *mut f32,
    n: usize,
    /// Weight rows from `end` on are not prefetched (0: none is, the panel is in cache already).
    end: usize,
}

impl Tile<'_> {
    /// Weight rows `j0..jend` in tiles of C (the last ones narrower).
    #[target_feature(enable = "avx2,fma")]
    #[allow(unsafe_code)]
    #[inline]
    unsafe fn panel<const R: usize, const C: usize>(&self, j0: usize, jend: usize) {
        let mut j = j0;
        while j + C <= jend {
            self.run::<R, C>(j);
            j += C;
        }
        match jend - j {
            0 => {}
            1 => self.run::<R, 1>(j),
            2 => self.run::<R, 2>(j),
            3 => self.run::<R, 3>(j),
            4 => self.run::<R, 4>(j),
            _ => self.run::<R, 5>(j),
        }
    }

    /// Rows `i..i + R` against the `STREAMS` weight rows `j + s * q`: as many long sequential streams, which
    /// the hardware prefetchers run ahead on together (one core reads more from several streams than from
    /// one). Safety: as `run`.
    #[target_feature(enable = "avx2,fma")]
    #[allow(unsafe_code)]
    #[inline]
    unsafe fn far<const R: usize, const S: usize>(&self, j: usize, q: usize) {
        let k = self.kdim;
        let ap = self.a.as_ptr().add(self.i * k);
        let wp = self.w.as_ptr().add(j * k);
        let mut acc = [[_mm256_setzero_ps(); S]; R];
        let whole = k / 8 * 8;
        let mut p = 0;
        while p < whole {
            let mut wv = [_mm256_setzero_ps(); S];
            for (s, v) in wv.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(wp.add(s * q * k + p));
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let av = _mm256_loadu_ps(ap.add(r * k + p));
                for (s, v) in row.iter_mut().enumerate() {
                    *v = _mm256_fmadd_ps(av, wv[s], *v);
                }
            }
            p += 8;
        }
        for (r, row) in acc.iter().enumerate() {
            for (s, &v) in row.iter().enumerate() {
                let mut sum = hsum(v);
                for c in whole..k {
                    sum += *ap.add(r * k + c) * *wp.add(s * q * k + c);
                }
                *self.o.add(r * self.n + j + s * q) = sum;
            }
        }
    }

    /// Rows `i..i + R` against weight row `j`, two accumulators each (16 floats a step). Safety: as `run`.
    #[target_feature(enable = "avx2,fma")]
    #[allow(unsafe_code)]
    #[inline]
    unsafe fn row<const R: usize>(&self, j: usize) {
        let k = self.kdim;
        let ap = self.a.as_ptr().add(self.i * k);
        let wp = self.w.as_ptr().add(j * k);
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let whole = k / 16 * 16;
        let mut p = 0;
        while p < whole {
            let w0 = _mm256_loadu_ps(wp.add(p));
            let w1 = _mm256_loadu_ps(wp.add(p + 8));
            for (r, acc) in acc.iter_mut().enumerate() {
                acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(ap.add(r * k + p)), w0, acc[0]);
                acc[1] = _mm256_fmadd_ps(_mm256_loadu_ps(ap.add(r * k + p + 8)), w1, acc[1]);
            }
            p += 16;
        }
        for (r, acc) in acc.iter().enumerate() {
            let mut s = hsum(_mm256_add_ps(acc[0], acc[1]));
            for q in whole..k {
                s += *ap.add(r * k + q) * *wp.add(q);
            }
            *self.o.add(r * self.n + j) = s;
        }
    }

    /// The R x C dots of rows `i..i + R` with weight rows `j..j + C`. Safety: AVX2 + FMA; the rows exist;
    /// `o` points at cells only this call writes.
    #[target_feature(enable = "avx2,fma")]
    #[allow(unsafe_code)]
    #[inline]
    unsafe fn run<const R: usize, const C: usize>(&self, j: usize) {
        let k = self.kdim;
        let ap = self.a.as_ptr().add(self.i * k);
        let wp = self.w.as_ptr().add(j * k);
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let whole = k / 8 * 8;
        // the next C weight rows (contiguous after these) are fetched while these are in use: one line of
        // them per line of these, so the stream of C rows reads ahead as a single sequential one would
        let ahead = j + (AHEAD + 1) * C <= self.end;
        let pf = wp.wrapping_add(AHEAD * C * k) as *const i8;
        let mut p = 0;
        while p < whole {
            if ahead && p % 16 == 0 {
                for c in 0..C {
                    // into L2 (on Zen 4 a T0 prefetch, held in L1's fewer miss buffers, streamed slower)
                    _mm_prefetch::<_MM_HINT_T1>(pf.add(4 * (p * C + c * 16)));
                }
            }
            let mut wv = [_mm256_setzero_ps(); C];
            for (c, v) in wv.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(wp.add(c * k + p));
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let av = _mm256_loadu_ps(ap.add(r * k + p));
                for (c, v) in row.iter_mut().enumerate() {
                    *v = _mm256_fmadd_ps(av, wv[c], *v);
                }
            }
            p += 8;
        }
        for (r, row) in acc.iter().enumerate() {
            for (c, &v) in row.iter().enumerate() {
                let mut s = hsum(v);
                for q in whole..k {
                    s += *ap.add(r * k + q) * *wp.add(c * k + q);
                }
                *self.o.add(r * self.n + j + c) = s;
            }
        }
    }
}

#[target_feature(enable = "avx2")]
#[allow(unsafe_code)]
#[inline]
unsafe fn hsum(v: __m256) -> f32 {
    let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2)))
}
