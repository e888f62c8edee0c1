//! llama.cpp's GGUF weight block layouts (ggml's `block_q4_0` ... `block_q6_K`, `block_mxfp4`,
//! `block_iq4_nl`, `block_iq4_xs`), decoded 32 weights at a time into small integers plus a scale and an offset per 16 weights:
//! `weight[i] = scale[i / 16] * vals[i] + offset[i / 16]`.
//!
//! This decoding is what the portable dot product and the dequantizer use; the AVX2 kernels read the same
//! bytes with vector loads.

/// A GGUF block type the kernels take. Names and numeric ids are ggml's (`GGML_TYPE_Q4_0 = 2`, ...).
#[allow(non_camel_case_types)] // ggml's names, as every GGUF tool prints them
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantType {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    /// 4-bit codes into the non-linear codebook `KVALUES_IQ4NL`, one f16 scale per 32 weights.
    IQ4_NL,
    /// `IQ4_NL`'s codes in blocks of 256 with a 6-bit scale per 32 under one f16 scale.
    IQ4_XS,
    /// OCP microscaling FP4 as ggml's `block_mxfp4` (gpt-oss's experts): an e8m0 exponent byte, then 16
    /// bytes of e2m1 codes (weight j in the low nibble of byte j, weight j + 16 in the high one).
    MXFP4,
}

/// Weights per sub-block: the unit an activation block (and one decode) covers.
pub const SUB: usize = 32;

impl QuantType {
    pub const ALL: [QuantType; 13] = [
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q5_0,
        QuantType::Q5_1,
        QuantType::Q8_0,
        QuantType::Q2_K,
        QuantType::Q3_K,
        QuantType::Q4_K,
        QuantType::Q5_K,
        QuantType::Q6_K,
        QuantType::IQ4_NL,
        QuantType::IQ4_XS,
        QuantType::MXFP4,
    ];

    /// The type with ggml's numeric id (`GGMLQuantizationType` in gguf-py), if the kernels take it.
    pub fn from_ggml_id(id: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.ggml_id() == id)
    }

    pub fn ggml_id(self) -> u32 {
        match self {
            QuantType::Q4_0 => 2,
            QuantType::Q4_1 => 3,
            QuantType::Q5_0 => 6,
            QuantType::Q5_1 => 7,
            QuantType::Q8_0 => 8,
            QuantType::Q2_K => 10,
            QuantType::Q3_K => 11,
            QuantType::Q4_K => 12,
            QuantType::Q5_K => 13,
            QuantType::Q6_K => 14,
            QuantType::IQ4_NL => 20,
            QuantType::IQ4_XS => 23,
            QuantType::MXFP4 => 39,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            QuantType::Q4_0 => "Q4_0",
            QuantType::Q4_1 => "Q4_1",
            QuantType::Q5_0 => "Q5_0",
            QuantType::Q5_1 => "Q5_1",
            QuantType::Q8_0 => "Q8_0",
            QuantType::Q2_K => "Q2_K",
            QuantType::Q3_K => "Q3_K",
            QuantType::Q4_K => "Q4_K",
            QuantType::Q5_K => "Q5_K",
            QuantType::Q6_K => "Q6_K",
            QuantType::IQ4_NL => "IQ4_NL",
            QuantType::IQ4_XS => "IQ4_XS",
            QuantType::MXFP4 => "MXFP4",
        }
    }

    /// Weights per block (32 for the legacy types and IQ4_NL, 256 for the K-quants and IQ4_XS).
    pub fn block_len(self) -> usize {
        match self {
            QuantType::Q2_K
            | QuantType::Q3_K
            | QuantType::Q4_K
            | QuantType::Q5_K
            | QuantType::Q6_K
            | QuantType::IQ4_XS => 256,
            _ => 32,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantType::Q4_0 => 18,
            QuantType::Q4_1 => 20,
            QuantType::Q5_0 => 22,
            QuantType::Q5_1 => 24,
            QuantType::Q8_0 => 34,
            QuantType::Q2_K => 84,
            QuantType::Q3_K => 110,
            QuantType::Q4_K => 144,
            QuantType::Q5_K => 176,
            QuantType::Q6_K => 210,
            QuantType::IQ4_NL => 18,
            QuantType::IQ4_XS => 136,
            QuantType::MXFP4 => 17,
        }
    }

    /// Bytes of one row of `k` weights (`k` a multiple of `block_len`).
    pub fn row_bytes(self, k: usize) -> usize {
        k / self.block_len() * self.block_bytes()
    }
}

/// IEEE half -> f32 (exact; subnormals, infinities and NaN included).
pub fn f16_to_f32(bits: u16) -> f32 {
    let sign = u32::from(bits & 0x8000) << 16;
    let exp = u32::from((bits >> 10) & 0x1f);
    let mant = u32::from(bits & 0x3ff);
    if exp == 0 {
        // zero or subnormal: mant * 2^-24
        let v = mant as f32 * (1.0 / 16_777_216.0);
        return if sign != 0 { -v } else { v };
    }
    let body = if exp == 31 {
        0x7f80_0000 | (mant << 13)
    } else {
        ((exp + 112) << 23) | (mant << 13)
    };
    f32::from_bits(sign | body)
}

#[inline(always)]
pub(crate) fn half_at(b: &[u8], off: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[off], b[off + 1]]))
}

/// The FP4 e2m1 values doubled, by 4-bit code (ggml's `kvalues_mxfp4`): integers, so that a block is
/// `e8m0_half(e) * KVALUES_MXFP4[code]` with the scale halved instead.
pub(crate) const KVALUES_MXFP4: [i8; 16] =
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// The IQ4_NL / IQ4_XS codebook by 4-bit code (ggml's `kvalues_iq4nl`).
pub(crate) const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// An e8m0 exponent byte as `2^(e - 127) / 2`, exact (ggml's `GGML_E8M0_TO_FP32_HALF`): `e` 0 and 1
/// are the subnormals 2^-128 and 2^-127, and 255 is 2^127 (no NaN).
#[inline(always)]
pub(crate) fn e8m0_half(e: u8) -> f32 {
    if e < 2 {
        f32::from_bits(0x0020_0000 << e)
    } else {
        f32::from_bits(u32::from(e - 1) << 23)
    }
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` (0..8) of a Q4_K / Q5_K block.
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The 16 6-bit scales of a Q3_K block (one per 16 weights), minus 32, from its 12 scale bytes: unpacked
/// 4 at a time with ggml's `kmask`s as `dequantize_row_q3_K` does (scale i: the low 4 bits from byte i,
/// or the high nibble of byte i - 8; the top 2 bits from byte 8 + i % 4 at bit 2 * (i / 4)).
#[inline(always)]
pub(crate) fn scales_q3_k(sc: &[u8]) -> [i8; 16] {
    let word =
        |i: usize| u32::from_le_bytes([sc[4 * i], sc[4 * i + 1], sc[4 * i + 2], sc[4 * i + 3]]);
    let (a0, a1, tmp) = (word(0), word(1), word(2));
    let (k1, k2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
    let aux = [
        (a0 & k2) | ((tmp & k1) << 4),
        (a1 & k2) | (((tmp >> 2) & k1) << 4),
        ((a0 >> 4) & k2) | (((tmp >> 4) & k1) << 4),
        ((a1 >> 4) & k2) | (((tmp >> 6) & k1) << 4),
    ];
    let mut out = [0i8; 16];
    for (o, b) in out.iter_mut().zip(aux.iter().flat_map(|a| a.to_le_bytes())) {
        *o = b as i8 - 32;
    }
    out
}

/// The 6-bit scale of sub-block `ib` (0..8) of an IQ4_XS block, minus 32.
#[inline(always)]
pub(crate) fn scale_iq4_xs(ib: usize, block: &[u8]) -> i8 {
    let scales_h = u16::from_le_bytes([block[2], block[3]]);
    let lo = (block[4 + ib / 2] >> (4 * (ib % 2))) & 0x0f;
    let hi = ((scales_h >> (2 * ib)) & 3) as u8;
    (lo | (hi << 4)) as i8 - 32
}

/// Q2_K / Q3_K sub-block `sub`: 32 weights of 2 bits at shift `2 * (sub % 4)` of 32 quant bytes
/// (`qs[32 * (sub / 4)..]`), 16 weights per scale; Q3_K with a third bit from `hmask` (clear: minus 4).
fn decode_low_k(
    qt: QuantType,
    block: &[u8],
    sub: usize,
    vals: &mut [i8; SUB],
) -> ([f32; 2], [f32; 2]) {
    let (n, j) = (sub / 4, sub % 4);
    let (g0, g1) = (8 * n + 2 * j, 8 * n + 2 * j + 1);
    if qt == QuantType::Q2_K {
        let (d, dmin) = (half_at(block, 80), half_at(block, 82));
        let qs = &block[16 + 32 * n..][..32];
        for (v, &q) in vals.iter_mut().zip(qs) {
            *v = ((q >> (2 * j)) & 3) as i8;
        }
        let (s0, s1) = (block[g0], block[g1]);
        let scale = [d * f32::from(s0 & 0x0f), d * f32::from(s1 & 0x0f)];
        (
            [scale[0], scale[1]],
            [-(dmin * f32::from(s0 >> 4)), -(dmin * f32::from(s1 >> 4))],
        )
    } else {
        let d = half_at(block, 108);
        let (hm, qs, sc) = (&block[..32], &block[32 + 32 * n..][..32], &block[96..108]);
        let bit = 4 * n + j;
        for (i, v) in vals.iter_mut().enumerate() {
            let low = ((qs[i] >> (2 * j)) & 3) as i8;
            *v = if (hm[i] >> bit) & 1 != 0 {
                low
            } else {
                low - 4
            };
        }
        let sc = scales_q3_k(sc);
        ([d * f32::from(sc[g0]), d * f32::from(sc[g1])], [0.0; 2])
    }
}

/// IQ4_NL / IQ4_XS sub-block `sub`: 16 bytes of codes (weight i in the low nibble of byte i, weight
/// i + 16 in the high one) into `KVALUES_IQ4NL`; returns the sub-block's scale.
fn decode_iq4(qt: QuantType, block: &[u8], sub: usize, vals: &mut [i8; SUB]) -> f32 {
    let (qs, scale) = if qt == QuantType::IQ4_NL {
        (&block[2..18], half_at(block, 0))
    } else {
        let ls = scale_iq4_xs(sub, block);
        (
            &block[8 + 16 * sub..][..16],
            half_at(block, 0) * f32::from(ls),
        )
    };
    for i in 0..16 {
        vals[i] = KVALUES_IQ4NL[usize::from(qs[i] & 0x0f)];
        vals[i + 16] = KVALUES_IQ4NL[usize::from(qs[i] >> 4)];
    }
    scale
}

/// Decodes sub-block `sub` (32 weights) of `block` into `vals`; returns (scale, offset) per half.
#[inline(always)]
pub(crate) fn decode_sub(
    qt: QuantType,
    block: &[u8],
    sub: usize,
    vals: &mut [i8; SUB],
) -> ([f32; 2], [f32; 2]) {
    match qt {
        QuantType::Q4_0 => {
            let d = half_at(block, 0);
            for i in 0..16 {
                let q = block[2 + i];
                vals[i] = (q & 0x0f) as i8 - 8;
                vals[i + 16] = (q >> 4) as i8 - 8;
            }
            ([d; 2], [0.0; 2])
        }
        QuantType::Q4_1 => {
            let (d, m) = (half_at(block, 0), half_at(block, 2));
            for i in 0..16 {
                let q = block[4 + i];
                vals[i] = (q & 0x0f) as i8;
                vals[i + 16] = (q >> 4) as i8;
            }
            ([d; 2], [m; 2])
        }
        QuantType::Q5_0 | QuantType::Q5_1 => {
            let (d, m, qh_at) = if qt == QuantType::Q5_0 {
                (half_at(block, 0), 0.0, 2)
            } else {
                (half_at(block, 0), half_at(block, 2), 4)
            };
            let qh = u32::from_le_bytes([
                block[qh_at],
                block[qh_at + 1],
                block[qh_at + 2],
                block[qh_at + 3],
            ]);
            let bias = if qt == QuantType::Q5_0 { 16 } else { 0 };
            for i in 0..16 {
                let q = block[qh_at + 4 + i];
                let h0 = ((qh >> i) & 1) as u8;
                let h1 = ((qh >> (i + 16)) & 1) as u8;
                vals[i] = ((q & 0x0f) | (h0 << 4)) as i8 - bias;
                vals[i + 16] = ((q >> 4) | (h1 << 4)) as i8 - bias;
            }
            ([d; 2], [m; 2])
        }
        QuantType::Q8_0 => {
            let d = half_at(block, 0);
            for (v, &q) in vals.iter_mut().zip(&block[2..34]) {
                *v = q as i8;
            }
            ([d; 2], [0.0; 2])
        }
        QuantType::Q4_K | QuantType::Q5_K => {
            let (d, dmin) = (half_at(block, 0), half_at(block, 2));
            let (sc, m) = scale_min_k4(sub, &block[4..16]);
            // 64 weights per 32 bytes of qs: sub-block 2j in the low nibbles, 2j + 1 in the high ones.
            let qs_at = if qt == QuantType::Q4_K { 16 } else { 48 };
            let shift = 4 * (sub & 1);
            let qs = &block[qs_at + 32 * (sub / 2)..][..32];
            for (i, v) in vals.iter_mut().enumerate() {
                let mut q = (qs[i] >> shift) & 0x0f;
                if qt == QuantType::Q5_K {
                    q |= ((block[16 + i] >> sub) & 1) << 4;
                }
                *v = q as i8;
            }
            ([d * f32::from(sc); 2], [-(dmin * f32::from(m)); 2])
        }
        QuantType::Q6_K => {
            // 128 weights per half block: ql[64], qh[32], scales[8]; quarter t = sub % 4.
            let (half, t) = (sub / 4, sub % 4);
            let d = half_at(block, 208);
            let ql = &block[64 * half..][..64];
            let qh = &block[128 + 32 * half..][..32];
            let sc = &block[192 + 8 * half..][..8];
            let (lo_at, nib_shift) = (32 * (t & 1), 4 * (t >> 1));
            for (i, v) in vals.iter_mut().enumerate() {
                let lo = (ql[lo_at + i] >> nib_shift) & 0x0f;
                let hi = (qh[i] >> (2 * t)) & 3;
                *v = (lo | (hi << 4)) as i8 - 32;
            }
            let s0 = f32::from(sc[2 * t] as i8);
            let s1 = f32::from(sc[2 * t + 1] as i8);
            ([d * s0, d * s1], [0.0; 2])
        }
        QuantType::Q2_K | QuantType::Q3_K => decode_low_k(qt, block, sub, vals),
        QuantType::IQ4_NL | QuantType::IQ4_XS => ([decode_iq4(qt, block, sub, vals); 2], [0.0; 2]),
        QuantType::MXFP4 => {
            for i in 0..16 {
                let q = block[1 + i];
                vals[i] = KVALUES_MXFP4[usize::from(q & 0x0f)];
                vals[i + 16] = KVALUES_MXFP4[usize::from(q >> 4)];
            }
            ([e8m0_half(block[0]); 2], [0.0; 2])
        }
    }
}

/// Dequantizes one row (`out.len()` weights, a multiple of the block length) from its bytes.
pub fn dequantize_row(qt: QuantType, row: &[u8], out: &mut [f32]) {
    let (bl, bb) = (qt.block_len(), qt.block_bytes());
    let mut vals = [0i8; SUB];
    for (block, o) in row.chunks_exact(bb).zip(out.chunks_exact_mut(bl)) {
        for (sub, o) in o.chunks_exact_mut(SUB).enumerate() {
            let (scale, offset) = decode_sub(qt, block, sub, &mut vals);
            for (i, (y, &v)) in o.iter_mut().zip(&vals).enumerate() {
                *y = scale[i / 16] * f32::from(v) + offset[i / 16];
            }
        }
    }
}
