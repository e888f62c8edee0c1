//! Matmuls over weights kept in llama.cpp's GGUF block layouts: `y[M, N] = x[M, K] @ W[N, K]^T`, with
//! each row of W stored as its GGUF blocks (the layout of the file's tensor data, unchanged).
//!
//! As llama.cpp does: the activations are quantized to 8 bits per block of 32 once per call, then each
//! output is a sum of integer dot products (32 weights at a time) times the two block scales. Weight
//! rows are split over the warm thread pool; each weight row is unpacked once per group of activation
//! rows (8, 4, 2 or 1 rows; see `row_groups`).
//! On x86-64 the AVX2 + FMA + F16C kernels are chosen at run time (with AVX-512 VNNI's `vpdpbusd` in
//! the x8 kernels where the CPU has it), on aarch64 the NEON ones (with the `dotprod` extension's `sdot`
//! where the CPU has it); elsewhere (or without them) the portable decoder runs.

mod act;
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx2;
mod formats;
#[cfg(target_arch = "aarch64")]
#[allow(unsafe_code)]
mod neon;
pub mod x8;

pub use act::{dot_portable, ActRow, Interleaved, QuantizedActs, RowGroup};
pub use formats::{dequantize_row, f16_to_f32, QuantType};

use crate::pool::{parallel_for, SharedOut};
use crate::KernelError;

/// Which kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// The AVX2 kernels, with AVX-512 VNNI (on 256-bit vectors, AVX512VL) in the x8 ones.
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
    /// aarch64 Advanced SIMD (baseline Armv8).
    #[cfg(target_arch = "aarch64")]
    Neon,
    /// Advanced SIMD with the Armv8.2 `dotprod` extension.
    #[cfg(target_arch = "aarch64")]
    NeonDot,
}

impl Isa {
    /// The best kernels this CPU runs.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        for isa in [Isa::Avx512Vnni, Isa::Avx2] {
            if isa.is_supported() {
                return isa;
            }
        }
        #[cfg(target_arch = "aarch64")]
        for isa in [Isa::NeonDot, Isa::Neon] {
            if isa.is_supported() {
                return isa;
            }
        }
        Isa::Portable
    }

    /// The kernels the matmuls run by default: `PAGEDRS_CPU_ISA` when it names kernels this CPU runs (a
    /// cap for comparisons, as oneDNN's `ONEDNN_MAX_CPU_ISA`: "avx2" on an AVX-512 VNNI CPU, or
    /// "portable"), else `detect()`. Read once per process.
    pub fn chosen() -> Isa {
        static CHOSEN: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *CHOSEN.get_or_init(|| {
            std::env::var("PAGEDRS_CPU_ISA")
                .ok()
                .and_then(|name| Isa::by_name(&name))
                .filter(|isa| isa.is_supported())
                .unwrap_or_else(Isa::detect)
        })
    }

    /// The kernel set called `name` (`Isa::name`) on this architecture.
    pub fn by_name(name: &str) -> Option<Isa> {
        Isa::ALL.iter().copied().find(|isa| isa.name() == name)
    }

    /// These kernels where this CPU runs them, else the nearest ones below that it runs (AVX-512 VNNI ->
    /// AVX2 -> portable; NEON dotprod -> NEON -> portable).
    pub fn or_supported(self) -> Isa {
        let below = match self {
            Isa::Portable => return Isa::Portable,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => Isa::Avx2,
            #[cfg(target_arch = "aarch64")]
            Isa::NeonDot => Isa::Neon,
            #[allow(unreachable_patterns)]
            _ => Isa::Portable,
        };
        if self.is_supported() {
            self
        } else {
            below.or_supported()
        }
    }

    /// Whether this CPU runs the kernels.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::is_x86_feature_detected!("avx2")
                    && std::is_x86_feature_detected!("fma")
                    && std::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                Isa::Avx2.is_supported()
                    && std::is_x86_feature_detected!("avx512vl")
                    && std::is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[cfg(target_arch = "aarch64")]
            Isa::NeonDot => {
                std::arch::is_aarch64_feature_detected!("neon")
                    && std::arch::is_aarch64_feature_detected!("dotprod")
            }
        }
    }

    /// Every kernel set of this architecture, from the portable one to the best.
    pub const ALL: &'static [Isa] = &[
        Isa::Portable,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni,
        #[cfg(target_arch = "aarch64")]
        Isa::Neon,
        #[cfg(target_arch = "aarch64")]
        Isa::NeonDot,
    ];

    /// Every kernel set this CPU runs, the portable one first and the best last.
    pub fn supported() -> Vec<Isa> {
        Isa::ALL
            .iter()
            .copied()
            .filter(|isa| isa.is_supported())
            .collect()
    }

    /// Whether the kernels take groups of 8 activation rows for `qt` (the AVX2 block-group kernels).
    fn takes_eight_rows(self, qt: QuantType) -> bool {
        #[cfg(target_arch = "x86_64")]
        if self.is_x86() {
            return matches!(
                qt,
                QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q8_0 | QuantType::MXFP4
            );
        }
        let _ = qt;
        false
    }

    /// The AVX2 kernels (with or without VNNI in the x8 ones).
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn is_x86(self) -> bool {
        matches!(self, Isa::Avx2 | Isa::Avx512Vnni)
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => "avx2",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => "avx512-vnni",
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => "neon",
            #[cfg(target_arch = "aarch64")]
            Isa::NeonDot => "neon-dotprod",
        }
    }
}

/// Shapes of one call: x `[m, k]`, W `[n, k]` (as `n` rows of `qt.row_bytes(k)` bytes), and out rows of
/// `ldo` floats of which columns `col0..col0 + n` are written (so the pieces of a fused layer whose
/// weights have different types can write one output).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulDims {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub ldo: usize,
    pub col0: usize,
}

/// Tasks per thread of one call: each task is a contiguous run of weight rows, so that every thread
/// reads the weights as a few long sequential streams (the hardware prefetchers follow them; at batch 1
/// the matmuls stream ~100 MB of weights per step). Measured on the 2-core AVX2 CI machine, a batch-1
/// step's matmuls over the default model with 2 threads: 16-row tasks (about 100 per call) 12.6 ms,
/// 4 tasks per thread 9.7 ms. More than one task per thread leaves the tail to the others when a thread
/// is slowed down by another process.
const TASKS_PER_THREAD: usize = 4;
/// The fewest output rows per task: enough work to amortize the hand-out.
const MIN_ROWS_PER_TASK: usize = 16;

/// Output rows per task of a call producing `n` columns on `threads` threads.
fn rows_per_task(n: usize, threads: usize) -> usize {
    n.div_ceil(threads.max(1) * TASKS_PER_THREAD)
        .max(MIN_ROWS_PER_TASK)
}

/// `out[i, col0 + j] = sum_k x[i, k] * W[j, k]` for the dims given; the other columns are untouched.
pub fn quant_matmul(
    qt: QuantType,
    w: &[u8],
    x: &[f32],
    out: &mut [f32],
    dims: &MatmulDims,
    num_threads: usize,
) -> Result<(), KernelError> {
    quant_matmul_with(Isa::chosen(), qt, w, x, out, dims, num_threads)
}

/// `quant_matmul` with the kernels chosen by the caller (tests compare them). Kernels this CPU does not
/// run fall back to the nearest ones below that it runs (`Isa::or_supported`).
pub fn quant_matmul_with(
    isa: Isa,
    qt: QuantType,
    w: &[u8],
    x: &[f32],
    out: &mut [f32],
    dims: &MatmulDims,
    num_threads: usize,
) -> Result<(), KernelError> {
    let Some((isa, acts)) = begin(isa, qt, w, x, out, dims)? else {
        return Ok(());
    };
    let d = *dims;
    let groups = row_groups(isa, qt, &acts);
    let row_bytes = qt.row_bytes(d.k);
    let out = SharedOut::new(out);
    let per_task = rows_per_task(d.n, num_threads);
    let tasks = d.n.div_ceil(per_task);
    parallel_for(num_threads, tasks, &|task| {
        let rows = task * per_task..((task + 1) * per_task).min(d.n);
        let tile = Tile {
            isa,
            qt,
            w,
            row_bytes,
            acts: &acts,
            groups: &groups,
            out,
            d,
        };
        tile.run(rows);
    });
    Ok(())
}

/// What both layouts' matmuls do first: check the arguments, pick the kernels that run (`isa` where this
/// CPU has it, else the portable ones) and quantize the activations; None when there is nothing to compute.
fn begin(
    isa: Isa,
    qt: QuantType,
    w: &[u8],
    x: &[f32],
    out: &[f32],
    dims: &MatmulDims,
) -> Result<Option<(Isa, QuantizedActs)>, KernelError> {
    validate(qt, w, x, out, dims)?;
    if dims.m == 0 || dims.n == 0 {
        return Ok(None);
    }
    let isa = isa.or_supported();
    Ok(Some((isa, QuantizedActs::new_with(isa, x, dims.m, dims.k))))
}

/// `quant_matmul` over W in the x8 layout (`x8::pack`; `n` a multiple of 8), on the kernels chosen by the
/// caller (`Isa::chosen()` by default); the AVX2, NEON and portable kernels give the same bits (see `x8`).
pub fn quant_matmul_x8_with(
    isa: Isa,
    qt: QuantType,
    w: &[u8],
    x: &[f32],
    out: &mut [f32],
    dims: &MatmulDims,
    num_threads: usize,
) -> Result<(), KernelError> {
    x8::check(qt, w.len(), dims.n, dims.k)?;
    let Some((isa, acts)) = begin(isa, qt, w, x, out, dims)? else {
        return Ok(());
    };
    let d = *dims;
    let nb = d.k / qt.block_len();
    let group_bytes = x8::ROWS * qt.row_bytes(d.k);
    let groups = d.n / x8::ROWS;
    let per_task = rows_per_task(d.n, num_threads).div_ceil(x8::ROWS);
    let out = SharedOut::new(out);
    parallel_for(num_threads, groups.div_ceil(per_task), &|task| {
        for g in task * per_task..((task + 1) * per_task).min(groups) {
            let wg = &w[g * group_bytes..][..group_bytes];
            let store = |i: usize, v: [f32; x8::ROWS]| {
                let at = i * d.ldo + d.col0 + g * x8::ROWS;
                // SAFETY: `at + 8 <= m * ldo` (validated); only this task writes these 8 columns.
                #[allow(unsafe_code)]
                unsafe {
                    std::ptr::copy_nonoverlapping(v.as_ptr(), out.at(at), x8::ROWS);
                }
            };
            x8_group_rows(isa, qt, wg, nb, &acts, d.m, &store);
        }
    });
    Ok(())
}

/// The `m` activation rows of `acts` against one packed group `wg` of W (`nb` blocks), each row's 8
/// outputs given to `store`, on the kernels of `isa` (supported): what `quant_matmul_x8_with` runs per
/// group, and the fused experts step per group of an expert's rows.
pub(crate) fn x8_group_rows(
    isa: Isa,
    qt: QuantType,
    wg: &[u8],
    nb: usize,
    acts: &QuantizedActs,
    m: usize,
    store: &impl Fn(usize, [f32; x8::ROWS]),
) {
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    if isa.is_x86() {
        // 4 activation rows share each block's loads, then the 1-3 left in one group: the
        // same bits for a row in any group.
        while i < m {
            let r = (m - i).min(4);
            // One activation row is bound by reading the weights, and the AVX2 kernel measured
            // a little faster there (`bench/quant_kernel.py --isas avx2,avx512-vnni`): VNNI from two rows.
            let vnni = isa == Isa::Avx512Vnni && r > 1;
            // SAFETY: the kernels are supported (`isa` is, as the callers' `or_supported` gives:
            // AVX2/FMA/F16C, and AVX512VL/VNNI for `vnni`); `wg` is `nb` packed blocks, each row `nb` sub-blocks.
            #[allow(unsafe_code)]
            unsafe {
                match r {
                    4 => x8_rows::<4>(vnni, qt, wg.as_ptr(), nb, acts, i, store),
                    3 => x8_rows::<3>(vnni, qt, wg.as_ptr(), nb, acts, i, store),
                    2 => x8_rows::<2>(vnni, qt, wg.as_ptr(), nb, acts, i, store),
                    _ => x8_rows::<1>(vnni, qt, wg.as_ptr(), nb, acts, i, store),
                }
            }
            i += r;
        }
    }
    #[cfg(target_arch = "aarch64")]
    if matches!(isa, Isa::Neon | Isa::NeonDot) {
        // 4 activation rows share each block's loads, then the 1-3 left in one group.
        while i < m {
            let r = (m - i).min(4);
            // SAFETY: the kernels are supported (`isa` is); `wg` is `nb` packed blocks, each row
            // `nb` sub-blocks.
            #[allow(unsafe_code)]
            unsafe {
                match r {
                    4 => neon_x8_rows::<4>(isa, qt, wg.as_ptr(), nb, acts, i, store),
                    3 => neon_x8_rows::<3>(isa, qt, wg.as_ptr(), nb, acts, i, store),
                    2 => neon_x8_rows::<2>(isa, qt, wg.as_ptr(), nb, acts, i, store),
                    _ => neon_x8_rows::<1>(isa, qt, wg.as_ptr(), nb, acts, i, store),
                }
            }
            i += r;
        }
    }
    for i in i..m {
        store(i, x8::group_portable(qt, wg, nb, acts.row(i)));
    }
}

/// Activation rows `i..i + R` against one packed group of W, each row's 8 outputs given to `store`
/// (`vnni`: on the AVX-512 VNNI kernels, which the CPU must have).
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn x8_rows<const R: usize>(
    vnni: bool,
    qt: QuantType,
    w: *const u8,
    nb: usize,
    acts: &QuantizedActs,
    i: usize,
    store: &impl Fn(usize, [f32; x8::ROWS]),
) {
    let rows: [ActRow<'_>; R] = std::array::from_fn(|r| acts.row(i + r));
    let acc = match (vnni, qt) {
        (false, QuantType::Q4_1) => avx2::x8_group::<R, true, false>(w, nb, &rows),
        (false, QuantType::Q4_0) => avx2::x8_group::<R, false, false>(w, nb, &rows),
        (false, _) => avx2::x8_group_q8::<R, false>(w, nb, &rows),
        (true, QuantType::Q4_1) => avx2::x8_group::<R, true, true>(w, nb, &rows),
        (true, QuantType::Q4_0) => avx2::x8_group::<R, false, true>(w, nb, &rows),
        (true, _) => avx2::x8_group_q8::<R, true>(w, nb, &rows),
    };
    for (r, a) in acc.into_iter().enumerate() {
        let mut v = [0.0f32; x8::ROWS];
        std::arch::x86_64::_mm256_storeu_ps(v.as_mut_ptr(), a);
        store(i + r, v);
    }
}

/// `x8_rows` on the NEON kernels (`isa` `Neon` or `NeonDot`, supported).
#[cfg(target_arch = "aarch64")]
#[allow(unsafe_code)]
unsafe fn neon_x8_rows<const R: usize>(
    isa: Isa,
    qt: QuantType,
    w: *const u8,
    nb: usize,
    acts: &QuantizedActs,
    i: usize,
    store: &impl Fn(usize, [f32; x8::ROWS]),
) {
    let rows: [ActRow<'_>; R] = std::array::from_fn(|r| acts.row(i + r));
    let out = if isa == Isa::NeonDot {
        neon::x8_group_sdot::<R>(qt, w, nb, &rows)
    } else {
        neon::x8_group::<R>(qt, w, nb, &rows)
    };
    for (r, v) in out.into_iter().enumerate() {
        store(i + r, v);
    }
}

/// `quant_get_rows` over W in the x8 layout.
pub fn quant_get_rows_x8(
    qt: QuantType,
    w: &[u8],
    n: usize,
    k: usize,
    ids: &[i64],
    out: &mut [f32],
) -> Result<(), KernelError> {
    x8::check(qt, w.len(), n, k)?;
    KernelError::check_len("out", out.len(), ids.len() * k)?;
    check_ids(ids, n)?;
    let mut row = vec![0u8; qt.row_bytes(k)];
    for (&id, o) in ids.iter().zip(out.chunks_exact_mut(k)) {
        x8::unpack_row(qt, w, k, id as usize, &mut row);
        dequantize_row(qt, &row, o);
    }
    Ok(())
}

fn check_ids(ids: &[i64], n: usize) -> Result<(), KernelError> {
    for (i, &id) in ids.iter().enumerate() {
        if id < 0 || id as usize >= n {
            return Err(KernelError::Row { index: i, id, n });
        }
    }
    Ok(())
}

/// Dequantizes rows `ids` of W (`[n, k]`) into `out` (`[ids.len(), k]`): an embedding lookup.
pub fn quant_get_rows(
    qt: QuantType,
    w: &[u8],
    n: usize,
    k: usize,
    ids: &[i64],
    out: &mut [f32],
) -> Result<(), KernelError> {
    check_k(qt, k)?;
    let rb = qt.row_bytes(k);
    KernelError::check_len("weight", w.len(), n * rb)?;
    KernelError::check_len("out", out.len(), ids.len() * k)?;
    check_ids(ids, n)?;
    for (&id, o) in ids.iter().zip(out.chunks_exact_mut(k.max(1))) {
        dequantize_row(qt, &w[id as usize * rb..][..rb], o);
    }
    Ok(())
}

fn check_k(qt: QuantType, k: usize) -> Result<(), KernelError> {
    if k == 0 || k % qt.block_len() != 0 {
        return Err(KernelError::BlockLen {
            qtype: qt.name(),
            k,
            block: qt.block_len(),
        });
    }
    Ok(())
}

fn validate(
    qt: QuantType,
    w: &[u8],
    x: &[f32],
    out: &[f32],
    d: &MatmulDims,
) -> Result<(), KernelError> {
    check_k(qt, d.k)?;
    KernelError::check_len("weight", w.len(), d.n * qt.row_bytes(d.k))?;
    KernelError::check_len("x", x.len(), d.m * d.k)?;
    if d.col0 + d.n > d.ldo {
        return Err(KernelError::Columns {
            col0: d.col0,
            n: d.n,
            ldo: d.ldo,
        });
    }
    KernelError::check_len("out", out.len(), d.m * d.ldo)
}

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

#[cfg(test)]
mod tests;
