"""Quantizers for the GGUF types gguf-py can only dequantize (Q2_K, Q3_K, IQ4_NL, IQ4_XS): simple
round-to-nearest ones (not llama.cpp's error-minimizing searches) that write llama.cpp's block layouts
(`block_q2_K`, `block_q3_K`, `block_iq4_nl`, `block_iq4_xs`), so that a test can write a GGUF file of
these types from float weights. gguf-py's dequantizer reads them back (the tests check it)."""

from __future__ import annotations

import gguf
import numpy as np
import numpy.typing as npt

Q = gguf.GGMLQuantizationType
LOW_BIT_TYPES = (Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS)
# llama.cpp's kvalues_iq4nl
KVALUES_IQ4NL = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32
)

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]


def _half(v: F32) -> tuple[U8, F32]:
    """Values as f16: (their bytes [n, 2], the values they round to as float32)."""
    h = v.astype(np.float16)
    return h.view(np.uint8).reshape(-1, 2), h.astype(np.float32)


def _div(a: F32, b: F32) -> F32:
    """a / b, 0 where b is 0."""
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b != 0)


def _signed_max(g: F32) -> F32:
    """The value of largest magnitude along the last axis, with its sign."""
    idx = np.abs(g).argmax(axis=-1)
    return np.take_along_axis(g, idx[..., None], axis=-1)[..., 0]


def _iq4_codes(x: F32, scale: F32) -> U8:
    """Nearest codebook entries of x / scale (scale broadcast over the last axis of 32), as 16 bytes of
    nibble pairs per 32 (weight i low, weight i + 16 high)."""
    t = _div(x, scale[..., None])
    codes = np.abs(KVALUES_IQ4NL - t[..., None]).argmin(axis=-1).astype(np.uint8)
    return codes[..., :16] | (codes[..., 16:] << 4)


def _iq4_nl(blocks: F32) -> U8:
    d_bytes, d = _half(_signed_max(blocks) / -127)
    return np.concatenate([d_bytes, _iq4_codes(blocks, d)], axis=1)


def _iq4_xs(blocks: F32) -> U8:
    sub = blocks.reshape(-1, 8, 32)
    s = _signed_max(sub) / -127
    d_bytes, d = _half(np.abs(s).max(axis=1) / 31)
    ls = np.clip(np.rint(_div(s, d[:, None])), -32, 31).astype(np.int64) + 32
    qs = _iq4_codes(sub, d[:, None] * (ls - 32)).reshape(-1, 128)
    scales_l = ((ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)).astype(np.uint8)
    scales_h = (((ls >> 4) & 3) << (2 * np.arange(8))).sum(axis=1).astype(np.uint16)
    return np.concatenate([d_bytes, scales_h.view(np.uint8).reshape(-1, 2), scales_l, qs], axis=1)


def _pack_2bit(q: npt.NDArray[np.int64]) -> U8:
    """[blocks, 256] values 0..3 -> 64 bytes: weight 128n + 32j + i at bits 2j of byte 32n + i."""
    q = q.reshape(-1, 2, 4, 32)
    return (q << (2 * np.arange(4))[None, None, :, None]).sum(axis=2).reshape(-1, 64).astype(np.uint8)


def _q2_k(blocks: F32) -> U8:
    g = blocks.reshape(-1, 16, 16)
    lo = np.minimum(g.min(axis=-1), 0)
    s, m = (g.max(axis=-1) - lo) / 3, -lo
    d_bytes, d = _half(s.max(axis=1) / 15)
    dm_bytes, dmin = _half(m.max(axis=1) / 15)
    sc = np.clip(np.rint(_div(s, d[:, None])), 0, 15).astype(np.int64)
    mn = np.clip(np.rint(_div(m, dmin[:, None])), 0, 15).astype(np.int64)
    dl, ml = d[:, None] * sc, dmin[:, None] * mn
    q = np.clip(np.rint(_div(g + ml[..., None], dl[..., None])), 0, 3).astype(np.int64)
    scales = (sc | (mn << 4)).astype(np.uint8)
    return np.concatenate([scales, _pack_2bit(q.reshape(-1, 256)), d_bytes, dm_bytes], axis=1)


def _q3_k(blocks: F32) -> U8:
    g = blocks.reshape(-1, 16, 16)
    s = _signed_max(g) / -4
    d_bytes, d = _half(np.abs(s).max(axis=1) / 31)
    sc = np.clip(np.rint(_div(s, d[:, None])), -32, 31).astype(np.int64)
    dl = d[:, None] * sc
    big = np.clip(np.rint(_div(g, dl[..., None])), -4, 3).astype(np.int64) + 4  # 0..7
    big = big.reshape(-1, 256)
    hbits = (big >> 2).reshape(-1, 8, 32)  # sub-block 4n + j -> bit 4n + j of hmask byte i
    hmask = (hbits << np.arange(8)[None, :, None]).sum(axis=1).astype(np.uint8)
    u = sc + 32  # 6 bits per group of 16
    low = np.concatenate([(u[:, :8] & 15) | ((u[:, 8:] & 15) << 4)], axis=1)
    high = ((u >> 4) & 3).reshape(-1, 4, 4)  # [.., i // 4, i % 4] -> byte 8 + i % 4, bits 2 * (i // 4)
    high = (high << (2 * np.arange(4))[None, :, None]).sum(axis=1)
    scales = np.concatenate([low, high], axis=1).astype(np.uint8)
    return np.concatenate([hmask, _pack_2bit(big & 3), scales, d_bytes], axis=1)


_QUANTIZERS = {Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs}


def quantize(a: npt.NDArray[np.float32], qtype: Q) -> U8:
    """A float [rows, cols] matrix as uint8 [rows, row_bytes] of `qtype` blocks (gguf.quants.quantize's
    signature); the types gguf-py quantizes itself go to it."""
    if qtype not in _QUANTIZERS:
        return gguf.quants.quantize(a, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = a.shape
    blocks = np.asarray(a, np.float32).reshape(-1, block)
    out = _QUANTIZERS[qtype](blocks)
    assert out.shape == (len(blocks), size), (qtype, out.shape)
    return out.reshape(rows, cols // block * size)
