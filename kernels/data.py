"""Data layer kernels: Caffe's DataTransformer arithmetic over a batch of records.

Records arrive as (N, D) rows, D = C*H*W, of uint8 or float32 (uint8 values convert to
float32 exactly). One compiled pass writes the float32 batch: NumPy's conversion and then its
operations, one pass each, took longer, and the main process reads each batch while the
workers wait for it or beside its own share of their work.
"""
import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def transform(x, mean, scale, out):
    """x: (N, D) uint8 or float32 records; mean: (D,) float32, or (0,) for none; scale: a
    float32 scalar; out: (N, D) float32. out = (float32(x) - mean) * scale, Caffe's order,
    each operation rounded to float32 (a scale of 1 multiplies exactly, as if skipped)."""
    N, D = x.shape
    if mean.size == 0:
        for n in range(N):
            for d in range(D):
                out[n, d] = np.float32(x[n, d]) * scale
    else:
        for n in range(N):
            for d in range(D):
                out[n, d] = (np.float32(x[n, d]) - mean[d]) * scale


@njit(cache=True, nogil=True)
def resize_linear(src, dst, xofs, alpha, rows, beta, vec_end):
    """OpenCV's cv::resize INTER_LINEAR for 8-bit images (Caffe's resize), as OpenCV 2.4 and
    3.x compute it on x86: 11-bit fixed-point weights, a horizontal pass into int32 and a
    vertical pass whose first vec_end elements of each row take the SSE2 arithmetic and the
    rest the plain C one. src: (H, W, C) uint8; dst: (P, Q, C) uint8; xofs: (Q, 2) int64
    source columns of each output column's two taps; alpha: (Q, 2) int32 their weights;
    rows: (P, 2) int64 source rows; beta: (P, 2) int32 their weights (see cgp.data.images)."""
    P, Q, C = dst.shape
    h0 = np.empty(Q * C, np.int32)
    h1 = np.empty(Q * C, np.int32)
    for p in range(P):
        for which in range(2):
            row = src[rows[p, which]]
            h = h0 if which == 0 else h1
            for q in range(Q):
                for c in range(C):
                    h[q * C + c] = (np.int32(row[xofs[q, 0], c]) * alpha[q, 0]
                                    + np.int32(row[xofs[q, 1], c]) * alpha[q, 1])
        b0, b1 = beta[p, 0], beta[p, 1]
        for x in range(Q * C):
            if x < vec_end:
                # SSE2: each sum >> 4 to 16 bits, times the weight keeping the high 16 bits,
                # then (+2) >> 2.
                v = ((((h0[x] >> 4) * b0) >> 16) + (((h1[x] >> 4) * b1) >> 16) + 2) >> 2
            else:
                v = (h0[x] * b0 + h1[x] * b1 + (1 << 21)) >> 22
            dst[p, x // C, x % C] = min(max(v, 0), 255)
