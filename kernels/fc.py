"""Inner-product (fully connected) kernels, Caffe's InnerProduct: y = x @ W^T + b, or x @ W when
the weight is stored transposed. Only the 2-d matrix product; the layer flattens the axes.

Each kernel reads the weight once per call, for all its rows together, where a BLAS
matrix-vector product per row would read it once per row, and a BLAS GEMM would first copy it
into its packed layout. Two loop shapes do all the work:

- rows_dot: out[m, r] = <a[m], w[r]>, dot products along the rows of w (forward; the input
  gradient of a transposed weight): register tiles (cgp.runtime.simd.dot_tile) of four rows
  of a by six of w, each dot product one fused multiply-add chain per vector lane, then the
  lanes summed in a fixed tree, so its bits depend on its two rows alone: never on the
  chunk, the tile or the machine's compiler.
- rows_axpy: out[m] = sum over r, in order, of a[m, r] * w[r] (the input gradient; forward of a
  transposed weight): register tiles (cgp.runtime.simd) of rows of out by vectors along w's
  rows, each output element one chain of fused multiply-adds over r in order, from 0, so rows
  never mix either, and the tile shape (which follows the row count) changes no bit.

The weight gradient adds dy^T @ x (x^T @ dy when transposed) one gradient row at a time, over
the chunk's rows in row order. Multiply-adds may be fused (FMA): one rounding fewer, the same
on every run. (The engine usually takes dy and x instead and forms the same chains itself,
see cgp.runtime.reduce.outer_tree_sum; this kernel serves weights shared between layers.)

Dimension letters: M rows in the chunk (samples times rows per sample), C inputs per row,
K outputs per row.
"""
from numba import njit

from cgp.kernels.elementwise import copy
from cgp.runtime.simd import (DOT_K, DOT_M, SHAPES, SPEEDS_UNIT, T_MAX, choose_from, dot_tile,
                              lanes, tile, transpose_block)

# rows_axpy's tile shapes: tile.SHAPES, and (4, 4) of its own for calls of 4 rows (LeNet's
# ip1 on 16 workers), which (6, 4) covers with half again as many. Its speed, a little under
# (8, 2)'s when each shape was forced on LeNet's ip1, also gives it 19 and 20 rows, which
# (8, 2) pads to 24 and where it ran faster too.
AXPY_SHAPES = SHAPES + ((4, 4),)
AXPY_SPEEDS = SPEEDS_UNIT + (0.9,)

# rows_axpy's scratch, per row of w: the rows of a tile may reach T_MAX - 1 past the last
# row of out, and its vectors EDGE_MAX elements along w's rows.
EDGE_MAX = max(KV for _, KV in AXPY_SHAPES) * lanes(4)

# rows_axpy runs its tiles over blocks of w's rows of about this many bytes, one block after
# another: a tile's column strip of one block then stays in the caches for the tiles of
# every row of out, and a strip of all of w's rows would cross a page per row.
AXPY_BLOCK_BYTES = 256 << 10


@njit(cache=True, nogil=True)
def rows_dot(a, w, out):
    """a: (M, L); w: (R, L); out: (M, R), OVERWRITTEN: out[m, r] = <a[m], w[r]>, in register
    tiles of DOT_M rows of a by DOT_K of w (tile.dot_tile), which fix every dot product's
    order by its two rows alone. The tiles run down a's rows for each block of w's, which
    stays in the L1 cache meanwhile."""
    M, L = a.shape
    R = w.shape[0]
    if M == 0 or R == 0:
        return
    if not (a.flags.c_contiguous and w.flags.c_contiguous and out.flags.c_contiguous):
        raise ValueError("rows_dot: an operand not C-contiguous")
    af, wf, of = a.reshape(M * L), w.reshape(R * L), out.reshape(M * R)
    for r0 in range(0, R, DOT_K):
        for m0 in range(0, M, DOT_M):
            dot_tile(of, m0 * R + r0, R, min(DOT_M, M - m0), min(DOT_K, R - r0),
                     af, m0 * L, L, wf, r0 * L, L, L)


@njit(cache=True, nogil=True)
def scratch_size(M, R):
    """Elements of rows_axpy's scratch for out of M rows and w of R rows."""
    return R * (M + T_MAX + EDGE_MAX)


@njit(cache=True, nogil=True)
def _tile_rows(T, KV, out, out_off, out_ts, t_valid, v_valid, accumulate, a, a_off, a_step, b,
               b_off, b_step, steps):
    """`tile` over one segment, unit-stride a (compiled once for rows_axpy's calls); (4, 4),
    not in tile.SHAPES, as constants."""
    if T == 4 and KV == 4:
        tile(4, 4, out, out_off, out_ts, t_valid, v_valid, accumulate, a, a_off, 1, 0, a_step,
             b, b_off, 0, b_step, 1, steps)
    else:
        tile(T, KV, out, out_off, out_ts, t_valid, v_valid, accumulate, a, a_off, 1, 0, a_step,
             b, b_off, 0, b_step, 1, steps)


@njit(cache=True, nogil=True, fastmath={"contract"})
def _axpy_4(o, g0, g1, g2, g3, w0, w1, w2, w3):
    """o += g0*w0, then g1*w1, g2*w2, g3*w3, in that order, element by element (one load and
    store of o for four terms)."""
    for l in range(o.size):
        v = o[l]
        v += g0 * w0[l]
        v += g1 * w1[l]
        v += g2 * w2[l]
        v += g3 * w3[l]
        o[l] = v


@njit(cache=True, nogil=True, fastmath={"contract"})
def _axpy_1(o, g, w):
    """o += g*w, element by element."""
    for l in range(o.size):
        o[l] += g * w[l]


@njit(cache=True, nogil=True)
def rows_axpy(a, w, out, scratch):
    """a: (M, R); w: (R, L); out: (M, L), OVERWRITTEN: out[m] = sum over r = 0, 1, ... of
    a[m, r] * w[r], each element one fused multiply-add chain over r in order, from 0.
    scratch: scratch_size(M, R) elements: a transposed (tiles broadcast T rows' a[m, r] side
    by side), and a zero-padded copy of w's last columns in its last block of rows when L is
    not a whole number of tile widths (a tile reads whole vectors; past w's end there may be
    nothing to read, while past the end of any other row lies the next).
    Tiles run over blocks of w's rows (AXPY_BLOCK_BYTES), each block across w's columns, all
    rows of out for each strip of columns; each block's tiles continue the chains where the
    block before left them in out, so the blocks change no bit."""
    M, R = a.shape
    L = w.shape[1]
    if M == 0 or L == 0:
        return
    if R == 0:   # no block of rows to run: the empty sums
        out[:] = 0
        return
    V = lanes(a.itemsize)
    T, KV = choose_from(M, L, V, AXPY_SHAPES, AXPY_SPEEDS)
    KVV = KV * V
    Mp = (M + T - 1) // T * T
    if scratch.size < scratch_size(M, R) or not (a.flags.c_contiguous and w.flags.c_contiguous
                                                 and out.flags.c_contiguous):
        raise ValueError("rows_axpy: scratch too small, or an operand not C-contiguous")
    at, edge = scratch[:R * Mp], scratch[R * Mp:R * (Mp + KVV)]
    af = a.reshape(M * R)
    for m0 in range(0, M, V):
        for r0 in range(0, R, V):
            transpose_block(at, r0 * Mp + m0, Mp, af, m0 * R + r0, R, min(V, M - m0),
                            min(V, R - r0), at, 0, False)
    wf = w.reshape(R * L)
    of = out.reshape(M * L)
    whole = L // KVV * KVV
    rows = max(1, AXPY_BLOCK_BYTES // (L * a.itemsize))
    for r0 in range(0, R, rows):
        rn = min(rows, R - r0)
        more = r0 > 0
        for l0 in range(0, whole, KVV):
            for m0 in range(0, M, T):
                _tile_rows(T, KV, of, m0 * L + l0, L, M - m0, KVV, more, at, r0 * Mp + m0, Mp,
                           wf, r0 * L + l0, L, rn)
        if whole == L:
            continue
        # The last columns: from w itself, or in the last block from the padded copy.
        cols, cols_off, cols_step = wf, r0 * L + whole, L
        if r0 + rn == R:
            for r in range(rn):
                copy(w[r0 + r, whole:], edge[r * KVV:r * KVV + L - whole])
                edge[r * KVV + L - whole:(r + 1) * KVV] = 0
            cols, cols_off, cols_step = edge, 0, KVV
        for m0 in range(0, M, T):
            _tile_rows(T, KV, of, m0 * L + whole, L, M - m0, L - whole, more, at,
                       r0 * Mp + m0, Mp, cols, cols_off, cols_step, rn)


@njit(cache=True, nogil=True)
def add_outer_rows(a, b, g, overwrite):
    """a: (M, J); b: (M, L); g: (J, L) ADDED to: g[j] += a[m, j] * b[m] for m = 0, 1, ... in
    order, each element one fused multiply-add chain from its value in g. overwrite: start
    each chain from 0 instead (bitwise the same as adding into zeros, without a separate pass
    that zeroes g in memory first). All three C-contiguous.
    The whole tiles of T rows of g by KV vectors run each chain in registers (tile.tile); the
    rows and columns left over, which a tile would cover only by reading past the last row of
    a or b, take four rows m per load and store of g, a row of g at a time (the same chains:
    the order stays m = 0, 1, ...). (Those loops alone ran LeNet's ip1 weight gradient at a
    quarter of the tiles' speed.)"""
    M, J = a.shape
    L = b.shape[1]
    if not (a.flags.c_contiguous and b.flags.c_contiguous and g.flags.c_contiguous):
        raise ValueError("add_outer_rows: an operand not C-contiguous")
    V = lanes(a.itemsize)
    T, KV = choose_from(J, L, V, AXPY_SHAPES, AXPY_SPEEDS)
    KVV = KV * V
    tiled_rows, tiled_cols = J // T * T, L // KVV * KVV
    if M == 0 or tiled_rows == 0 or tiled_cols == 0:
        tiled_rows, tiled_cols = 0, 0
    af, bf, gf = a.reshape(M * J), b.reshape(M * L), g.reshape(J * L)
    for j0 in range(0, tiled_rows, T):
        for l0 in range(0, tiled_cols, KVV):
            _tile_rows(T, KV, gf, j0 * L + l0, L, T, KVV, not overwrite, af, j0, J, bf, l0, L, M)
    M4 = M - M % 4
    for j in range(J):
        lo = tiled_cols if j < tiled_rows else 0
        if lo == L:
            continue
        gj = g[j, lo:]
        if overwrite:
            gj[:] = 0
        for m in range(0, M4, 4):
            _axpy_4(gj, a[m, j], a[m + 1, j], a[m + 2, j], a[m + 3, j],
                    b[m, lo:], b[m + 1, lo:], b[m + 2, lo:], b[m + 3, lo:])
        for m in range(M4, M):
            _axpy_1(gj, a[m, j], b[m, lo:])


@njit(cache=True, nogil=True)
def bias_parts(dy, dbs, step, starts, overwrite):
    """dy: (M, K); part i, rows starts[i]:starts[i+1], has its bias gradient (K,) at
    dbs[i*step:], ADDED to (set with overwrite, as if added to zeros): the part's rows of dy
    in row order, what fc_backward adds for those rows alone."""
    K = dy.shape[1]
    for i in range(starts.size - 1):
        db = dbs[i * step:i * step + K]
        if overwrite:
            db[:] = 0
        for m in range(starts[i], starts[i + 1]):
            dym = dy[m]
            for k in range(K):
                db[k] += dym[k]


@njit(cache=True, nogil=True)
def fc_forward(x, w, b, y, transpose, scratch):
    """x: (M, C); w: (K, C), or (C, K) when transpose; b: (K,), or (0,) for no bias;
    y: (M, K), overwritten. y[m] = w @ x[m] (x[m] @ w when transpose), then y[m] += b.
    scratch: scratch_size(M, C) elements when transpose, else unused."""
    M, K = y.shape
    if M == 0:
        return
    if transpose:
        rows_axpy(x, w, y, scratch)
    else:
        rows_dot(x, w, y)
    if b.size > 0:
        for m in range(M):
            ym = y[m]
            for k in range(K):
                ym[k] += b[k]


@njit(cache=True, nogil=True)
def fc_backward(x, w, dy, dx, dw, db, transpose, need_dx, need_dw, overwrite, scratch):
    """x: (M, C); w: (K, C), or (C, K) when transpose; dy: (M, K); dx: (M, C), OVERWRITTEN
    (any array when not need_dx); dw: like w (any array when not need_dw) and db: (K,) or (0,)
    are ADDED to, or, with overwrite, set (as if added to zeros). db += the rows of dy in row
    order; dw += dy^T @ x (x^T @ dy when transpose), over the rows in row order; dx[m] =
    dy[m] @ w (w @ dy[m] when transpose). scratch: scratch_size(M, K) elements when need_dx
    and not transpose, else unused."""
    M, K = dy.shape
    if overwrite:
        db[:] = 0
        if M == 0 and need_dw:
            dw[:] = 0
    if M == 0:
        return
    if db.size > 0:
        for m in range(M):
            dym = dy[m]
            for k in range(K):
                db[k] += dym[k]
    if need_dw:
        if transpose:
            add_outer_rows(x, dy, dw, overwrite)
        else:
            add_outer_rows(dy, x, dw, overwrite)
    if need_dx:
        if transpose:
            rows_dot(dy, w, dx)
        else:
            rows_axpy(dy, w, dx, scratch)


# -- Embed: a lookup table, the product with a one-hot row --------------------------------------

@njit(cache=True, nogil=True)
def embed_forward(idx, w, b, y):
    """idx: (M,) row indices, as floats; w: (V, K); b: (K,), or (0,) for no bias; y: (M, K),
    overwritten: y[m] = w[idx[m]] + b. Returns the first m whose index is not an integer in
    [0, V) (y is left partly written), or -1."""
    V, K = w.shape
    for m in range(idx.size):
        v = idx[m]
        if not (v >= 0 and v < V) or v != int(v):
            return m
        r = int(v)
        for k in range(K):
            y[m, k] = w[r, k] + b[k] if b.size > 0 else w[r, k]
    return -1


@njit(cache=True, nogil=True)
def embed_backward(idx, dy, dws, step, starts):
    """idx: (M,) indices that embed_forward accepted; dy: (M, K); part i, rows
    starts[i]:starts[i+1], ADDS dy[m] to row idx[m] of its weight gradient (V, K) at
    dws[i*step:], its rows in order."""
    K = dy.shape[1]
    for i in range(starts.size - 1):
        base = i * step
        for m in range(starts[i], starts[i + 1]):
            at = base + int(idx[m]) * K
            for k in range(K):
                dws[at + k] += dy[m, k]
