//! `quant_matmul` over W in the x8 layout (`x8`): 8 weight rows per packed group.

#[cfg(target_arch = "x86_64")]
use super::avx2;
#[cfg(target_arch = "aarch64")]
use super::neon;
use super::{begin, rows_per_task, x8, ActRow, Isa, MatmulDims, QuantType, QuantizedActs};
use crate::pool::{parallel_for, SharedOut};
use crate::KernelError;

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
    // The NEON kernels take Q4_0 / Q4_1 / Q8_0; the other layouts run the portable kernel there.
    #[cfg(target_arch = "aarch64")]
    if matches!(isa, Isa::Neon | Isa::NeonDot)
        && matches!(qt, QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q8_0)
    {
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
        (false, QuantType::Q5_0) => avx2::x8_group_q5::<R, false, false>(w, nb, &rows),
        (false, QuantType::Q5_1) => avx2::x8_group_q5::<R, true, false>(w, nb, &rows),
        (true, QuantType::Q5_0) => avx2::x8_group_q5::<R, false, true>(w, nb, &rows),
        (true, QuantType::Q5_1) => avx2::x8_group_q5::<R, true, true>(w, nb, &rows),
        (_, QuantType::Q4_K) => avx2::x8_group_k45::<R, false>(w, nb, &rows),
        (_, QuantType::Q5_K) => avx2::x8_group_k45::<R, true>(w, nb, &rows),
        (_, QuantType::Q6_K) => avx2::x8_group_q6k::<R>(w, nb, &rows),
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
