//! One task of `quant_matmul`: a run of weight rows against every group of activation rows, on the
//! kernels of the call.

#[cfg(target_arch = "x86_64")]
use super::avx2;
#[cfg(target_arch = "aarch64")]
use super::neon;
use super::{dot_portable, Interleaved, Isa, MatmulDims, QuantType, QuantizedActs, RowGroup};
use crate::pool::SharedOut;

pub(crate) struct Tile<'a> {
    pub(crate) isa: Isa,
    pub(crate) qt: QuantType,
    pub(crate) w: &'a [u8],
    pub(crate) row_bytes: usize,
    pub(crate) acts: &'a QuantizedActs,
    pub(crate) groups: &'a [Interleaved],
    pub(crate) out: SharedOut,
    pub(crate) d: MatmulDims,
}

/// The activation rows split into groups that share each weight row's unpacking: 8 rows at a time for
/// the AVX2 block-group kernels (Q4_0, Q4_1, Q8_0, MXFP4), 4 for the others (whose per-row accumulators would
/// not fit the registers at 8; the NEON kernels' spilled in the inner loop at 8 too), then 2 and 1 for
/// the rest (m = 7 runs as 4 + 2 + 1). Every kernel gives a row the same bits in any group.
pub(crate) fn row_groups(isa: Isa, qt: QuantType, acts: &QuantizedActs) -> Vec<Interleaved> {
    let max = if isa.takes_eight_rows(qt) { 8 } else { 4 };
    let mut groups = Vec::new();
    let mut i = 0;
    for r in [8, 4, 2, 1] {
        while r <= max && i + r <= acts.rows {
            groups.push(Interleaved::new(acts, i, r));
            i += r;
        }
    }
    groups
}

impl Tile<'_> {
    /// Outputs of weight rows `rows` for every activation row, one row group at a time: each weight row of
    /// the range (a few KiB, cache resident) is unpacked once per group.
    pub(crate) fn run(&self, rows: std::ops::Range<usize>) {
        for g in self.groups {
            match g.r {
                8 => self.run_group::<8>(g, rows.clone()),
                4 => self.run_group::<4>(g, rows.clone()),
                2 => self.run_group::<2>(g, rows.clone()),
                _ => self.run_group::<1>(g, rows.clone()),
            }
        }
    }

    fn run_group<const R: usize>(&self, g: &Interleaved, rows: std::ops::Range<usize>) {
        let group = g.group::<R>(self.acts);
        for n in rows {
            self.store(g.i, n, self.dot(n, &group));
        }
    }

    #[inline]
    fn dot<const R: usize>(&self, n: usize, g: &RowGroup<'_, R>) -> [f32; R] {
        let wrow = &self.w[n * self.row_bytes..][..self.row_bytes];
        match self.isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512Vnni => {
                let nb = self.d.k / self.qt.block_len();
                // SAFETY: the AVX2 kernels are used only when detected; `wrow` holds `nb` whole blocks, every
                // activation row `k / 32` sub-blocks (checked in `validate`) and the interleaved scales
                // 8 floats past any block's start.
                #[allow(unsafe_code)]
                unsafe {
                    avx2::group_rows(self.qt, wrow.as_ptr(), nb, g)
                }
            }
            #[cfg(target_arch = "aarch64")]
            Isa::Neon | Isa::NeonDot => {
                let nb = self.d.k / self.qt.block_len();
                // SAFETY: the kernels are supported (`begin`); `wrow` holds `nb` whole blocks, every
                // activation row `k / 32` sub-blocks (checked in `validate`) and the interleaved sums
                // 8 floats past any block's start.
                #[allow(unsafe_code)]
                unsafe {
                    if self.isa == Isa::NeonDot {
                        neon::group_rows_sdot(self.qt, wrow.as_ptr(), nb, g)
                    } else {
                        neon::group_rows(self.qt, wrow.as_ptr(), nb, g)
                    }
                }
            }
            Isa::Portable => g.rows.map(|r| dot_portable(self.qt, wrow, r)),
        }
    }

    #[inline]
    fn store<const R: usize>(&self, i: usize, n: usize, v: [f32; R]) {
        for (r, v) in v.into_iter().enumerate() {
            let at = (i + r) * self.d.ldo + self.d.col0 + n;
            // SAFETY: `at < m * ldo` (validated); only this task writes column `col0 + n`.
            #[allow(unsafe_code)]
            unsafe {
                *self.out.at(at) = v;
            }
        }
    }
}
