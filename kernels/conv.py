"""2-d convolution kernels (Caffe's Convolution). No N-d convolution here.

Two paths. Stride 1 (any padding, dilation and groups; every convolution of LeNet and
cifar10) runs the direct kernels: the input is widened S times, one zero-padded copy per kernel
column s, so that every product reads whole rows of it and the column matrix of im2col (R*S
times the input) is never formed. The products run through `tile` (cgp.runtime.simd), a
register-tiled loop of 512-bit fused multiply-adds: the forward pass with output positions
along the vectors, stored straight into NCHW, or, where tiles of fewer output rows skip more
of the padding (small padded images), with output channels along the vectors and the tiles
transposed into NCHW; the weight gradient with output channels along the vectors, from dy
transposed (where the channels are not whole vectors, the last few along T instead, by
vectors of the input's rows: _dw_tiles), or, where channels and rows fill those tiles
poorly (one input channel: LeNet's conv1), as dot products along the positions kept in
lanes (_dw_lanes); and the input gradient either the same way as the
forward pass (gathering, for padded layers) or, where the output is clearly smaller than the
input, through one sample's column matrix, which is then added into dx row by row. Other
strides run im2col and one BLAS GEMM per sample (cgp.runtime.blas), as do stride-1 layers on
small planes where that is faster (the layer chooses: cgp.layers.conv.gemm_faster).

Determinism. Every element of the forward pass and of the input gradient is one chain of
multiply-adds over its own sample's data (through the column matrix: one chain per tap, the
taps added in order), in an order fixed by the layer's shape: it never depends on the other
samples of the chunk, and splitting a batch leaves it bitwise the same.
Products with padding rows are left out where a kernel row reads nothing else: for a whole
tile of positions (forward and gathering), and in the weight gradient for each kernel row.
A zero product leaves a sum as it is (a sum that starts from +0 is never -0), so no finite
result changes; only where an operand is infinite or NaN does a left-out product, which would
have been NaN, not spread.
The weight gradient is kept per part (the engine's chunks; a call may cover several), each
element one chain over the part's samples in order, then positions (by lanes: V chains, lane
l over the positions l, l + V, ... of each sample, samples in order, summed in a fixed tree
at the part's end; V is fixed by the dtype, not by the CPU), so it depends on the part's
composition; chunk boundaries are fixed by the batch size and the chunk count, never
by threads, timing or memory addresses, so the result is the same for any thread count and
any number of parts per call. Tile shapes, buffer alignment and the CPU's vector width change
the speed, never a result.

Memory. The direct path widens one sample's input at a time into scratch ("e"): per worker
and bottom, C*S*(H + 2*pad_h)*Q elements (S times the padded input, where im2col's column
matrix would be R*S times). The forward pass and the weight gradient each widen the sample
they work on: the buffer stays one sample's size whatever the call's, and backward needs
nothing from forward but its input, as in Caffe. (Keeping every sample's copy from forward
to backward instead measured no faster.) Backward adds a block of one sample's dy
transposed (POSITION_BLOCK positions by K, K rounded up to whole vectors), and where the
weight gradient runs its last channels along T, one sample's widened input transposed (about
e's size, in dwt); by lanes, the lane sums (V per weight and bias, K and C*S padded to
lane_tile's shape) in dwt instead, and no dy block: no buffer grows with the chunk.

Dimension letters: N samples in the chunk, C input channels, K output channels (filters),
G groups (C/G and K/G channels per group), H W input height and width, P Q output height and
width, R S kernel height and width. CRS = C*R*S is the column matrix's height, and
CgRS = (C/G)*R*S the length of one filter. V is the number of lanes of a SIMD vector (16 for
float32, 8 for float64), T and KV a tile's shape (see cgp.runtime.simd).
"""
import functools

import numpy as np
from numba import njit

from cgp.runtime.blas import gemm
from cgp.kernels.elementwise import copy
from cgp.runtime.simd import (SHAPES, SPEEDS_STRIDED, SPEEDS_UNIT, T_MAX, choose, lane_tile,
                              lanes, shifted_copy, shifted_row_sum, tile, transpose_block)

# Output positions per block of the weight gradient: the block of dycl that every tile of
# the block reads stays in the L1 cache.
POSITION_BLOCK = 128
# The weight gradient by lanes (_dw_lanes): lane_tile's shape, LANE_M output channels by
# LANE_N rows (c, s) of the widened input (20 accumulators, 4 + 5 operand vectors), and what
# a call costs besides its steps, in steps (loading and storing its accumulators; fitted to
# the shipped nets' layers run both ways, bench/README.md: _dw_by_lanes).
LANE_M, LANE_N = 4, 5
LANE_CALL = 6
# One more tile shape for _convolve_rows' channel tiles, beside SHAPES: ROWS_T channels by
# ROWS_KV vectors of positions, and its speed as in SPEEDS_UNIT. Channel counts that are
# multiples of 10 fill it where SHAPES' T (12, 8, 6, 3) pad them: LeNet's conv1, 20 channels,
# ran as 24 in tiles of 8. Compiled at that call site alone.
ROWS_T, ROWS_KV = 10, 2
ROWS_SPEED = 0.97
# Kernels DW_S wide (5: LeNet's and cifar10's): the weight gradient's main tiles of DW_KV
# vectors of channels take the S rows (c, s) of one input channel and kernel row, T = S, and
# so store the gradient in w's order, channels innermost: no rows padded to whole tiles, and
# one transposition per part into w's layout instead of one per kernel row and channel
# (LeNet's conv2, 48 channels in 3 vectors: x1.07). One shape, compiled alone: with 4
# vectors (cifar10_quick's conv3) it ran x1.06 too, but each shape adds about a second to a
# cold run's compile; with 2 (its conv2: 10 accumulators) x0.96.
DW_S, DW_KV = 5, 3


@njit(cache=True, nogil=True)
def _valid_range(off, stride, size, count):
    """The output positions i in [0, count) whose input position i*stride + off lies in
    [0, size): returns (lo, hi). Floor division rounds toward -inf, which is what makes the
    bounds right for negative offsets (inside the padding)."""
    lo = -(off // stride) if off < 0 else 0
    hi = (size - 1 - off) // stride + 1
    if hi > count:
        hi = count
    if hi < lo:
        hi = lo
    return lo, hi


# ---------------------------------------------------------------------------------------------
# Direct path (stride 1)

@njit(cache=True, nogil=True)
def direct_shapes(C, H, W, K, R, S, pad_h, pad_w, dil_h, dil_w, group, V):
    """How the direct path runs for vectors of V lanes, a function of the layer's shape only:
    (T, KV, positions) of the forward pass (see _rows_tiles), (T, KV) of the weight gradient
    (T rows (c, s) of the widened input by KV vectors of output channels), (T, KV, positions)
    of the input gradient when it gathers, or (T, KV) of its column matrix (T rows (c, r, s)
    by KV vectors of output positions, positions False), and whether the input gradient goes
    through columns (_dx_columns) or gathers (_dx_gather). Every output is the same chain of
    multiply-adds whatever the tile shape: the shapes change the speed, not the results."""
    Cg, Kg = C // group, K // group
    P = H + 2 * pad_h - dil_h * (R - 1)
    Q = W + 2 * pad_w - dil_w * (S - 1)
    T_f, KV_f, pos_f = _rows_tiles(Kg, P * Q, Q, R, dil_h, pad_h, H, V)
    T_w, KV_w, _, _, _ = _dw_tiles(Cg * S, Kg, group, R, P * Q, (H + 2 * pad_h) * Q, V)
    # Gathering computes every input position from all R*S taps, padding included; the
    # column matrix has P*Q positions per tap, but costs a pass that adds it into dx. Go
    # through columns where that is clearly less (unpadded layers).
    columns = 5 * P * Q < 4 * H * W
    if columns:
        T_x, KV_x = choose(Cg * R * S, P * Q, V, True)
        pos_x = False
    else:
        T_x, KV_x, pos_x = _rows_tiles(Cg, H * W, W, R, dil_h, dil_h * (R - 1) - pad_h, P, V)
    return T_f, KV_f, pos_f, T_w, KV_w, T_x, KV_x, pos_x, columns


@njit(cache=True, nogil=True)
def _tiles_cost(nt, nv, T, KV, V, speeds):
    """choose's estimate for tiles (T, KV) of SHAPES over nt by nv outputs."""
    for i in range(len(SHAPES)):
        if SHAPES[i][0] == T and SHAPES[i][1] == KV:
            return _round_up(nt, T) * _round_up(nv, KV * V) / speeds[i]
    return -1.0


@njit(cache=True, nogil=True)
def _dw_tiles(CSg, Kg, group, R, PQ, HpQ, V):
    """How the weight gradient tiles its CSg rows (c, s) by Kg output channels per group:
    (T, KV, Km, Tl, KVl). Channels below Km run in tiles of T rows by KV vectors of channels
    (channels along the vectors); the last Kg - Km (fewer than V, with Tl > 0) in tiles of Tl
    channels by KVl vectors of rows (c, s), read from the widened input transposed: where Kg
    is not a whole number of vectors, this pads the rows instead of the channels (LeNet's
    conv2: 50 channels, 100 rows, 18 % fewer multiply-adds) at the cost of transposing each
    sample's widened input. Km = Kg, Tl = 0 where that costs more (or with groups). The
    estimate: choose's, per position and kernel row, and for the transposition about six
    multiply-adds per element (measured on LeNet's conv2)."""
    T, KV = choose(CSg, Kg, V, False)
    Kr = Kg % V
    if group > 1 or Kr == 0 or Kg < V:
        return T, KV, Kg, 0, 0
    Km = Kg - Kr
    Tm, KVm = choose(CSg, Km, V, False)
    Tl, KVl = choose(Kr, CSg, V, True)
    plain = _tiles_cost(CSg, Kg, T, KV, V, SPEEDS_STRIDED)
    split = (_tiles_cost(CSg, Km, Tm, KVm, V, SPEEDS_STRIDED)
             + _tiles_cost(Kr, CSg, Tl, KVl, V, SPEEDS_UNIT) + 6.0 * CSg * HpQ / (R * PQ))
    if split < plain:
        return Tm, KVm, Km, Tl, KVl
    return T, KV, Kg, 0, 0


@njit(cache=True, nogil=True)
def _dw_layout(CSg, Kg, group, R, PQ, HpQ, V):
    """(Kgp, CSv, left, trans): channels per row of the weight gradient's dy turned
    channels-last (dycl: the main tiles' vectors and the last channels' tiles read within
    it); the transposed widened input's row, rows (c, s) padded to whole vectors; and the
    sizes of the last channels' sums (R times their channels in whole tiles, rows of CSv)
    and of the transposed input (HpQ rows of CSv), which dwt holds after the rest
    (_dw_extra); 0, 0, 0 without them."""
    T, KV, Km, Tl, KVl = _dw_tiles(CSg, Kg, group, R, PQ, HpQ, V)
    Kgp = _round_up(Km, KV * V)
    if Tl == 0:
        return Kgp, 0, 0, 0
    CSv = _round_up(CSg, KVl * V)
    Kgp = max(Kgp, _round_up(Km + _round_up(Kg - Km, Tl), V))
    return Kgp, CSv, R * _round_up(Kg - Km, Tl) * CSv, HpQ * CSv


@njit(cache=True, nogil=True)
def _dw_extra(dwt_size, KCgRS, left, V):
    """Where the last channels' sums and the transposed input start in dwt (_dw_layout):
    after the tiles' sums (dwt_size) and dw's layout (KCgRS), on vector boundaries."""
    o1 = _round_up(dwt_size + KCgRS, V)
    return o1, o1 + _round_up(left, V)


@njit(cache=True, nogil=True)
def _kernel_rows(j0, j1, Qo, R, dil, shift, Hi):
    """The kernel rows [r0, r1) that output positions j0 to j1 - 1 (flat, rows of Qo) read
    anything but padding at: output row p reads input row p + r*dil - shift of Hi rows. From
    the first r that the last row reads inside the input to the last that the first row
    does."""
    p0, p1 = j0 // Qo, (j1 - 1) // Qo
    r0 = max(-((p1 - shift) // dil), 0)
    r1 = max(min((Hi - 1 - p0 + shift) // dil + 1, R), r0)
    return r0, r1


@njit(cache=True, nogil=True)
def _rows_tiles(Ko, PQo, Qo, R, dil, shift, Hi, V):
    """How _convolve_rows tiles Ko channels by PQo positions (rows of Qo; see it for the
    rest): (T, KV, positions), a shape of SHAPES and either T channels by KV vectors of
    positions (positions False) or T positions by KV vectors of channels (True). A tile leaves
    out the kernel rows that read only padding for all its positions, so tiles of fewer
    output rows skip more of a padded layer's work (cifar10_quick's conv3, 8 x 8 with
    padding 2: a tile of one row skips 15 % of it, one of four rows nothing). The estimated
    time: the multiply-adds of every tile over the kernel rows it runs, over the shape's
    speed (SPEEDS_UNIT: both ways the T operands lie side by side). Ties go to channel tiles,
    which need no transposition. Channel tiles also come in (ROWS_T, ROWS_KV)."""
    best_t, best_kv, best_pos, best = 0, 0, False, -1.0
    for i in range(len(SHAPES) + 1):
        T, KV = SHAPES[i] if i < len(SHAPES) else (ROWS_T, ROWS_KV)
        speed = SPEEDS_UNIT[i] if i < len(SHAPES) else ROWS_SPEED
        for positions in (False, True):
            if positions and i == len(SHAPES):
                continue
            span = T if positions else KV * V
            channels = _round_up(Ko, KV * V if positions else T)
            cost = _tile_rows(PQo, span, Qo, R, dil, shift, Hi) * span * channels / speed
            if best < 0 or cost < best:
                best_t, best_kv, best_pos, best = T, KV, positions, cost
    return best_t, best_kv, best_pos


@njit(cache=True, nogil=True)
def _tile_rows(PQo, span, Qo, R, dil, shift, Hi):
    """The kernel rows that tiles of `span` positions run, summed over the tiles (see
    _kernel_rows). The tiles that run all R form one run in the middle (a tile's first row
    only moves down the image, its last too), so only the tiles before and after it are
    counted one by one: a call chooses its tiles in a few steps, not one per tile."""
    n = (PQo + span - 1) // span
    rows, lo, hi = 0, 0, n
    while lo < hi:
        r0, r1 = _kernel_rows(lo * span, min(lo * span + span, PQo), Qo, R, dil, shift, Hi)
        if r1 - r0 == R:
            break
        rows += r1 - r0
        lo += 1
    while hi > lo:
        r0, r1 = _kernel_rows((hi - 1) * span, min(hi * span, PQo), Qo, R, dil, shift, Hi)
        if r1 - r0 == R:
            break
        rows += r1 - r0
        hi -= 1
    return rows + (hi - lo) * R


@njit(cache=True, nogil=True)
def _channel_pad(Ko, T, KV, positions, V):
    """Channels per row of _convolve_rows' repacked weights: whole tiles along T, or whole
    vectors along KV with positions."""
    return _round_up(Ko, KV * V) if positions else _round_up(Ko, T)


def direct_sizes(C, H, W, K, R, S, pad_h, pad_w, dil_h, dil_w, group, V):
    """Scratch sizes (elements) of the direct path for vectors of V lanes, as the tuple
    (e, e extra, wpt, dycl, dycl extra, dwt, dbacc, eb, wft, dxp): see
    conv_forward_direct and conv_backward_direct. Every buffer that feeds vectors has V
    elements to spare, for _aligned. With position tiles, wpt and wft also hold one sample's
    and group's output, channels innermost, after the weights.
    Plain Python, run at a layer's set-up, over the kernels' own shape functions (the
    kernels compile them anyway): as one @njit function of its own it compiled them all
    again into itself, a second or more of a cold first run's compile."""
    Cg, Kg = C // group, K // group
    P = H + 2 * pad_h - dil_h * (R - 1)
    Q = W + 2 * pad_w - dil_w * (S - 1)
    Hp = H + 2 * pad_h
    Hb = H + dil_h * (R - 1)
    T_f, KV_f, pos_f, T_w, KV_w, T_x, KV_x, pos_x, columns = direct_shapes(
        C, H, W, K, R, S, pad_h, pad_w, dil_h, dil_w, group, V)
    Kgp, CSv, left, trans = _dw_layout(Cg * S, Kg, group, R, P * Q, Hp * Q, V)
    Kp = group * Kgp
    o1, o2 = _dw_extra(Kp * R * _round_up(Cg * S, T_w), K * Cg * R * S, left, V)
    dwt = o2 + trans
    if _dw_by_lanes(Cg * S, Kg, group, P * Q, V):
        dwt = max(dwt, _lane_sums_size(Cg * S, K, R, P * Q, V))
    KgT = _channel_pad(Kg, T_f, KV_f, pos_f, V)
    wpt = group * R * Cg * S * KgT + (P * Q * KgT if pos_f else 0)
    if columns:
        eb, wft, dxp = K * P * Q, K * _round_up(Cg * R * S, T_x), Cg * R * S * P * Q
    else:
        CgT = _channel_pad(Cg, T_x, KV_x, pos_x, V)
        eb, wft, dxp = K * S * Hb * W, group * R * Kg * S * CgT + (H * W * CgT if pos_x else 0), 0
    return (C * S * Hp * Q, _e_slack(Hp * Q, V) + V, wpt + V,
            min(P * Q, POSITION_BLOCK) * Kp, V,
            dwt, Kp, eb + 4 * V + V, wft + V,
            dxp + V)


@njit(cache=True, nogil=True)
def _round_up(n, m):
    return (n + m - 1) // m * m


@njit(cache=True, nogil=True)
def _e_slack(row, V):
    """Elements after a sample's widened input that tiles may read: weight-gradient
    tiles run up to T_MAX rows (of `row` elements) past the last row, and forward tiles up to
    four vectors past the last position."""
    return T_MAX * row + 4 * V


@njit(cache=True, nogil=True)
def _aligned(a, V):
    """a[i:] for the first i that puts the view on a vector boundary (V elements): a vector
    load that straddles two cache lines costs two. Scratch sizes allow V extra elements."""
    return a[(-a.ctypes.data // a.itemsize) % V:]


@njit(cache=True, nogil=True)
def widen(src, out, off, S, dil_w, shift_h, shift_w, rows, cols):
    """src: (C', Hs, Ws) one sample, C-contiguous; out: flat, rows C'*S*rows*cols from `off`
    (overwritten). out[off + ((c*S + s)*rows + h)*cols + q] = src[c, h - shift_h,
    q + s*dil_w - shift_w], or 0 outside src: for each kernel column s, the (shifted,
    zero-padded) input that output column q reads, so that kernel row r reads rows
    h + r*dil_h of it, contiguous along (h, q)."""
    Cs, Hs, Ws = src.shape
    sf = src.reshape(Cs * Hs * Ws)
    h_lo, h_hi = _valid_range(-shift_h, 1, Hs, rows)
    for c in range(Cs):
        for s in range(S):
            base = off + (c * S + s) * rows * cols
            col_shift = s * dil_w - shift_w
            q_lo, q_hi = _valid_range(col_shift, 1, Ws, cols)
            # Zero rows: nothing inside [lo, hi) = [0, 0), one row of any period.
            shifted_copy(out, base, sf, 0, rows * cols, 0, 0, h_lo * cols)
            first = (c * Hs + h_lo - shift_h) * Ws + col_shift
            if cols == Ws:
                # Rows as long as the source's ("same" padding): one copy of all of them.
                shifted_copy(out, base + h_lo * cols, sf, first, cols, q_lo, q_hi,
                             (h_hi - h_lo) * cols)
            else:
                for h in range(h_lo, h_hi):
                    shifted_copy(out, base + h * cols, sf, first + (h - h_lo) * Ws, cols, q_lo,
                                 q_hi, cols)
            shifted_copy(out, base + h_hi * cols, sf, 0, rows * cols, 0, 0,
                         (rows - h_hi) * cols)


@njit(cache=True, nogil=True)
def _tile_unit(T, KV, out, out_off, out_ts, t_valid, v_valid, accumulate, a, a_off, a_gstep,
               a_step, b, b_off, b_gstep, b_step, nseg, nstep):
    """`tile` with a_ts = 1, compiled once for all its callers (each call site of the intrinsic
    compiles every tile shape)."""
    tile(T, KV, out, out_off, out_ts, t_valid, v_valid, accumulate, a, a_off, 1, a_gstep,
         a_step, b, b_off, b_gstep, b_step, nseg, nstep)


@njit(cache=True, nogil=True)
def _convolve_rows(e, e_off, row_len, r_step, wt, wt_off, KoT, out, out_off, Ko, PQo, R, steps,
                   Qo, dil, shift, Hi, T, KV, positions, ycl, V):
    """One sample and group of a stride-1 convolution over widened rows (flat arrays):
    out[out_off + k*PQo + j] = sum over r < R, then i < steps, of
        wt[wt_off + (r*steps + i)*KoT + k] * e[e_off + r*r_step + i*row_len + j]
    for k < Ko output channels (wt rows padded to KoT, _channel_pad) and j < PQo positions,
    one chain per element, in tiles of T channels by KV vectors of positions or, with
    `positions`, of T positions by KV vectors of channels, written into ycl (PQo rows of KoT)
    and then transposed into out (_rows_tiles chooses). Output row j // Qo reads, at kernel
    row r, row j // Qo + r*dil - shift of an input Hi rows high, e's padding outside it: a
    tile leaves out the kernel rows that read only padding for all its positions (zero
    products leave its sums as they are). (Cutting the reduction into blocks that fit the L1
    cache gained nothing measurable: the tiles stream it from L2.)"""
    KVV = KV * V
    if positions:
        for j0 in range(0, PQo, T):
            r0, r1 = _kernel_rows(j0, min(j0 + T, PQo), Qo, R, dil, shift, Hi)
            for k0 in range(0, Ko, KVV):
                _tile_unit(T, KV, ycl, j0 * KoT + k0, KoT, PQo - j0, Ko - k0, False,
                           e, e_off + r0 * r_step + j0, r_step, row_len,
                           wt, wt_off + r0 * steps * KoT + k0, steps * KoT, KoT, r1 - r0, steps)
        for j0 in range(0, PQo, V):
            for k0 in range(0, Ko, V):
                transpose_block(out, out_off + k0 * PQo + j0, PQo, ycl, j0 * KoT + k0, KoT,
                                min(V, PQo - j0), min(V, Ko - k0), ycl, 0, False)
        return
    extra = T == ROWS_T and KV == ROWS_KV
    for j0 in range(0, PQo, KVV):
        r0, r1 = _kernel_rows(j0, min(j0 + KVV, PQo), Qo, R, dil, shift, Hi)
        for k0 in range(0, Ko, T):
            if extra:
                tile(ROWS_T, ROWS_KV, out, out_off + k0 * PQo + j0, PQo, Ko - k0, PQo - j0,
                     False, wt, wt_off + r0 * steps * KoT + k0, 1, steps * KoT, KoT,
                     e, e_off + r0 * r_step + j0, r_step, row_len, r1 - r0, steps)
            else:
                _tile_unit(T, KV, out, out_off + k0 * PQo + j0, PQo, Ko - k0, PQo - j0, False,
                           wt, wt_off + r0 * steps * KoT + k0, steps * KoT, KoT,
                           e, e_off + r0 * r_step + j0, r_step, row_len, r1 - r0, steps)


@njit(cache=True, nogil=True)
def conv_forward_direct(x, w, b, y, e, wpt, pad_h, pad_w, dil_h, dil_w, group):
    """Stride-1 forward. x: (N, C, H, W); w: (K, C/G, R, S); b: (K,), or (0,) for no bias;
    y: (N, K, P, Q), C-contiguous. Scratch, flat, sizes from direct_sizes: e, one sample's
    widened input; wpt, the weights with output channels innermost.
    y[n, k, p, q] = (sum over (r, c, s) of w[k, c, r, s] * x[n, c, p + r*dil_h - pad_h,
    q + s*dil_w - pad_w]) + b[k], the sum one fused multiply-add chain in that order."""
    N, C, H, W = x.shape
    K, Cg, R, S = w.shape
    P, Q = y.shape[2], y.shape[3]
    PQ = P * Q
    Kg = K // group
    V = lanes(x.itemsize)
    T, KV, positions, _, _, _, _, _, _ = direct_shapes(C, H, W, K, R, S, pad_h, pad_w, dil_h,
                                                       dil_w, group, V)
    KgT = _channel_pad(Kg, T, KV, positions, V)
    Hp = H + 2 * pad_h
    HpQ = Hp * Q
    CSg = Cg * S
    esz = C * S * HpQ
    e, wpt = _aligned(e, V), _aligned(wpt, V)
    wsz = group * R * CSg * KgT
    if e.size < esz + _e_slack(HpQ, V) or wpt.size < wsz + (PQ * KgT if positions else 0):
        raise ValueError("conv_forward_direct: scratch too small")
    ycl = wpt[wsz:]
    # Weights by (group, r, c, s), output channels innermost (padded to KgT), in blocks of
    # V channels by the S taps of a kernel row, through vector registers: element by element,
    # every read crossed to another row of w, and for small images this repacking, once per
    # call, is not small beside the convolution.
    wf = w.reshape(w.size)
    CgRS = Cg * R * S
    for gr in range(group):
        for k0 in range(0, Kg, V):
            kn = min(V, Kg - k0)
            for c in range(Cg):
                for r in range(R):
                    for s0 in range(0, S, V):
                        transpose_block(wpt, ((gr * R + r) * CSg + c * S + s0) * KgT + k0, KgT,
                                        wf, ((gr * Kg + k0) * Cg + c) * R * S + r * S + s0,
                                        CgRS, kn, min(V, S - s0), wpt, 0, False)
    yf = y.reshape(N * K * PQ)
    for n in range(N):
        widen(x[n], e, 0, S, dil_w, pad_h, pad_w, Hp, Q)
        for gr in range(group):
            _convolve_rows(e, gr * CSg * HpQ, HpQ, dil_h * Q, wpt, gr * R * CSg * KgT,
                           KgT, yf, (n * K + gr * Kg) * PQ, Kg, PQ, R, CSg, Q, dil_h, pad_h, H,
                           T, KV, positions, ycl, V)
        if b.size > 0:
            for k in range(K):
                bk = b[k]
                # A view indexed from 0: an index that may be negative keeps the loop scalar.
                yk = yf[(n * K + k) * PQ:(n * K + k + 1) * PQ]
                for j in range(PQ):
                    yk[j] += bk


@njit(cache=True, nogil=True)
def _dw_by_lanes(CSg, Kg, group, PQ, V):
    """Whether the weight gradient runs by lanes (_dw_lanes) rather than in tiles: where its
    channels and rows (c, s) fill the tiles poorly (one input channel: LeNet's conv1, 5 rows
    of 6 by 20 channels of 32, 52 % of the multiply-adds used) and a sample has enough
    positions to repay a lane_tile call. The estimate, per position and kernel row: the
    tiles' padded multiply-adds over their speed (choose's; _dw_tiles' split of the last
    channels is left out) against the lanes' padded multiply-adds, each call's steps
    (vectors of positions) counted with LANE_CALL more. On the shipped nets it picks LeNet's
    conv1 alone (cifar10_quick's conv1, 15 rows by 32 channels, is near even, and stays in
    tiles)."""
    if group > 1:
        return False
    T, KV = choose(CSg, Kg, V, False)
    tiles = _tiles_cost(CSg, Kg, T, KV, V, SPEEDS_STRIDED)
    steps = (PQ + V - 1) // V
    by_lanes = (_round_up(Kg, LANE_M) * _round_up(CSg, LANE_N) * (steps + LANE_CALL) * V
                / PQ)
    return by_lanes < tiles


@njit(cache=True, nogil=True)
def _lane_sums_size(CSg, K, R, PQ, V):
    """Elements of _dw_lanes' scratch: V lanes for each (channel, kernel row, row (c, s)) of
    the padded tiles, V for each channel's bias (channels padded to LANE_M), then a row of PQ
    ones."""
    return (_round_up(K, LANE_M) * (R * _round_up(CSg, LANE_N) + 1)) * V + PQ


@njit(cache=True, nogil=True)
def _dw_lanes(x, w, dy, dws, dw_step, dbs, db_step, starts, e, dycl, dwt, dbacc, pad_h, pad_w,
              dil_h, dil_w, T, overwrite):
    """The weight and bias gradients of conv_backward_direct (one group) by lanes, for the
    layers _dw_by_lanes picks: dw[k, c, r, s] is the dot product of dy[n, k] with row (c, s)
    of the widened input at kernel row r, over the part's samples and positions, along the
    positions: V chains per element (lane l takes the positions j = l, l + V, ... of each
    sample, samples in order; lane_tile), summed in a fixed tree at the end of the part
    (_lanes_total). No padding of channels to whole vectors and no transposition of dy; the
    channels and rows (c, s) pad only to lane_tile's shape. db[k]: the same lanes over dy
    alone (times a row of ones: a plain loop adding into lanes ran as long as all the rest).
    The lane sums (_lane_sums_size elements, overwritten) live in dwt. Arguments as
    conv_backward_direct's; T: the tiles' T of its weight gradient (direct_shapes), which
    sizes the scratch that _dw_start checks."""
    V = lanes(x.itemsize)
    e, dycl = _aligned(e, V), _aligned(dycl, V)
    if not _dw_start(x, w, dy, dws, dw_step, dbs, db_step, starts, e, dycl, dwt, dbacc, pad_h,
                     x.shape[1] // w.shape[1], T, V, overwrite):   # one group
        return
    sums = dwt
    N, C, H, W = x.shape
    K, Cg, R, S = w.shape
    P, Q = dy.shape[2], dy.shape[3]
    PQ = P * Q
    Hp = H + 2 * pad_h
    HpQ = Hp * Q
    CSg = C * S
    if sums.size < _lane_sums_size(CSg, K, R, PQ, V):
        raise ValueError("conv_backward_direct: scratch too small")
    CSn = _round_up(CSg, LANE_N)
    db_at = _round_up(K, LANE_M) * R * CSn * V
    ones = db_at + _round_up(K, LANE_M) * V
    sums[ones:ones + PQ] = 1
    dyf = dy.reshape(N * K * PQ)
    bias = dbs.size > 0
    for part in range(starts.size - 1):
        n0, n1 = starts[part], starts[part + 1]
        if n1 == n0:
            continue
        sums[:ones] = 0
        for n in range(n0, n1):
            widen(x[n], e, 0, S, dil_w, pad_h, pad_w, Hp, Q)
            for r in range(R):
                # Only the positions whose kernel row r reads no padding row.
                p_lo, p_hi = _valid_range(r * dil_h - pad_h, 1, H, P)
                if p_hi <= p_lo:
                    continue
                for k0 in range(0, K, LANE_M):
                    for cs0 in range(0, CSg, LANE_N):
                        lane_tile(LANE_M, LANE_N, sums, ((k0 * R + r) * CSn + cs0) * V,
                                  R * CSn * V, V, dyf, (n * K + k0) * PQ + p_lo * Q, PQ, K - k0,
                                  e, cs0 * HpQ + (p_lo + r * dil_h) * Q, HpQ, CSg - cs0,
                                  (p_hi - p_lo) * Q)
            if bias:
                for k0 in range(0, K, LANE_M):
                    lane_tile(LANE_M, 1, sums, db_at + k0 * V, V, 0, dyf, (n * K + k0) * PQ,
                              PQ, K - k0, sums, ones, 0, 1, PQ)
        dw = dws[part * dw_step:part * dw_step + K * CSg * R]
        for k in range(K):
            for c in range(C):
                for r in range(R):
                    for s in range(S):
                        i = ((k * C + c) * R + r) * S + s
                        total = _lanes_total(sums, ((k * R + r) * CSn + c * S + s) * V, V)
                        dw[i] = total + (0.0 if overwrite else dw[i])
            if bias:
                i = part * db_step + k
                dbs[i] = _lanes_total(sums, db_at + k * V, V) + (0.0 if overwrite else dbs[i])


@njit(cache=True, nogil=True)
def _channels_last(dy, n, j0, jn, dycl, dbacc, add, Kg, Kgp, V):
    """Positions j0 to j0 + jn - 1 of sample n of dy (N, K, P, Q), C-contiguous, with channels
    innermost: dycl[(j - j0)*Kp + gr*Kgp + kk] = dy[n, gr*Kg + kk, j] (flat positions j,
    Kp = G*Kgp; the padding columns are left alone), in V x V blocks (j0 a multiple of V);
    with `add`, also dbacc[gr*Kgp + kk] += dy[n, gr*Kg + kk, j] for each j in order."""
    N, K, P, Q = dy.shape
    PQ = P * Q
    group = K // Kg
    Kp = group * Kgp
    dyf = dy.reshape(N * K * PQ)
    for j in range(j0, j0 + jn, V):
        for gr in range(group):
            for k0 in range(0, Kg, V):
                transpose_block(dycl, (j - j0) * Kp + gr * Kgp + k0, Kp,
                                dyf, (n * K + gr * Kg + k0) * PQ + j, PQ,
                                min(V, Kg - k0), min(V, j0 + jn - j), dbacc, gr * Kgp + k0, add)


def conv_backward_direct(x, w, dy, dx, dws, dw_step, dbs, db_step, starts, e, dycl, dwt, dbacc,
                         eb, wft, dxp, pad_h, pad_w, dil_h, dil_w, group, need_dx,
                         overwrite=False):
    """Stride-1 backward. x: (N, C, H, W), the input forward saw; w: (K, C/G, R, S);
    dy: (N, K, P, Q); dx: like x,
    C-contiguous (any array when not need_dx), OVERWRITTEN. The samples fall into parts (the
    engine's chunks): part i is samples starts[i] to starts[i+1] - 1, and its weight gradient,
    laid out like w, is ADDED to at dws[i*dw_step:], its bias gradient (K,) at dbs[i*db_step:]
    (no bias when dbs is empty). Scratch, flat (direct_sizes): e, one sample's widened
    input (as in conv_forward_direct); dycl, a block of positions of one sample's dy with
    channels innermost; dwt, one part's weight gradient by channel block, followed by the
    same laid out like w; dbacc, one sample's bias gradient; eb, one sample's dy (widened,
    when gathering); wft, the weights repacked for the input gradient; dxp, one group's
    column matrix of one sample (_dx_columns only).
    db[k] += sums of dy[n, k] over positions, one sample of the part at a time in sample order;
    dw[k, c, r, s] += one chain over the part's (n, p, q) of dy[n, k, p, q] *
    x[n, c, p + r*dil_h - pad_h, q + s*dil_w - pad_w]: each part's gradient is what a call
    with that part alone gives. overwrite: SET each part's gradients instead, bitwise as if
    added to zeros (the engine then skips zeroing them: Layer.can_overwrite_param_diff): each
    chain's result g is stored as g + 0.0, which is 0.0 + g (-0.0 becomes +0.0, as it does
    added to zeros), and an empty part's gradients are zeros. dx: see _dx_gather and
    _dx_columns.
    Plain Python: it picks, once per layer shape (_backward_plan), the kernels that the
    shape runs, the weight gradient's (_dw_lanes, _dw_by_rows or _dw_by_tiles) and the input
    gradient's (_dx_columns or _dx_gather). As one @njit kernel it compiled every way into
    one function on a cold first run (LeNet runs three of the five); as kernels of their
    own, each compiles where it is first run, and the compile processes
    (cgp.runtime.compile) can share them out."""
    by_rows, by_lanes, T, KV, T_x, KV_x, pos_x, columns, V = _backward_plan(
        x.shape, w.shape, dy.shape, pad_h, pad_w, dil_h, dil_w, group, x.itemsize)
    if by_lanes:
        _dw_lanes(x, w, dy, dws, dw_step, dbs, db_step, starts, e, dycl, dwt, dbacc, pad_h,
                  pad_w, dil_h, dil_w, T, overwrite)
    elif by_rows:
        _dw_by_rows(x, w, dy, dws, dw_step, dbs, db_step, starts, e, dycl, dwt, dbacc, pad_h,
                    pad_w, dil_h, dil_w, group, T, overwrite)
    else:
        _dw_by_tiles(x, w, dy, dws, dw_step, dbs, db_step, starts, e, dycl, dwt, dbacc, pad_h,
                     pad_w, dil_h, dil_w, group, T, KV, overwrite)
    if need_dx and x.shape[0] > 0:
        if columns:
            _dx_columns(w, dy, dx, eb, wft, dxp, pad_h, pad_w, dil_h, dil_w, group, T_x, KV_x,
                        V)
        else:
            _dx_gather(w, dy, dx, eb, wft, pad_h, pad_w, dil_h, dil_w, group, T_x, KV_x, pos_x,
                       V)


@functools.lru_cache(maxsize=None)
def _backward_plan(x_shape, w_shape, dy_shape, pad_h, pad_w, dil_h, dil_w, group, itemsize):
    """How conv_backward_direct runs a layer's shapes, as the one kernel chose it in itself:
    (by rows (DW_S wide, DW_KV vectors of channels: _dw_by_rows), by lanes (_dw_by_lanes),
    the weight gradient's T and KV, the input gradient's T, KV and positions, through
    columns, V), from direct_shapes. (Cached: a call looks it up in a fraction of a
    microsecond.)"""
    _, C, H, W = x_shape
    K, Cg, R, S = w_shape
    V = lanes(itemsize)
    _, _, _, T, KV, T_x, KV_x, pos_x, columns = direct_shapes(C, H, W, K, R, S, pad_h, pad_w,
                                                              dil_h, dil_w, group, V)
    return (S == DW_S and KV == DW_KV,
            _dw_by_lanes(Cg * S, K // group, group, dy_shape[2] * dy_shape[3], V), T, KV,
            T_x, KV_x, pos_x, columns, V)


@njit(cache=True, nogil=True)
def _dw_start(x, w, dy, dws, dw_step, dbs, db_step, starts, e, dycl, dwt, dbacc, pad_h, group,
              T, V, overwrite):
    """The start of either weight gradient (_dw_lanes, _dw_by_tiles): where overwriting, an
    empty part's gradients set to zeros (it has no chain to store); then, unless there are no
    samples (False: nothing more to do), the scratch (e and dycl aligned) and the parts
    checked."""
    N, C, H, W = x.shape
    K, Cg, R, S = w.shape
    P, Q = dy.shape[2], dy.shape[3]
    PQ = P * Q
    Kg = K // group
    if overwrite:
        for part in range(starts.size - 1):
            if starts[part + 1] == starts[part]:
                dws[part * dw_step:part * dw_step + K * Cg * R * S] = 0
                dbs[part * db_step:part * db_step + min(K, dbs.size)] = 0
    if N == 0:
        return False
    HpQ = (H + 2 * pad_h) * Q
    CSg = Cg * S
    Kgp, CSv, left, trans = _dw_layout(CSg, Kg, group, R, PQ, HpQ, V)
    Kp = group * Kgp
    _, o2 = _dw_extra(Kp * R * _round_up(CSg, T), K * Cg * R * S, left, V)
    if (dycl.size < min(PQ, POSITION_BLOCK) * Kp or dwt.size < o2 + trans
            or dbacc.size < Kp or e.size < C * S * HpQ + _e_slack(HpQ, V)):
        raise ValueError("conv_backward_direct: scratch too small")
    if starts[0] != 0 or starts[-1] != N:
        raise ValueError("conv_backward_direct: the parts must cover the samples")
    return True


@njit(cache=True, nogil=True)
def _dw_by_tiles(x, w, dy, dws, dw_step, dbs, db_step, starts, e, dycl, dwt, dbacc, pad_h,
                 pad_w, dil_h, dil_w, group, T, KV, overwrite):
    """The weight and bias gradients of conv_backward_direct in tiles, for the layers that
    _dw_by_lanes and _dw_by_rows leave; arguments as conv_backward_direct's, T and KV
    direct_shapes'. dw: T rows (c, s) of e (broadcast) by KV vectors of output channels, each
    element one chain over the part's samples, then positions. Each block of positions is
    turned channels-last just before its tiles, which find it in the L1 cache (and continue
    their chains across blocks): a whole chunk turned at once went through L3, which slowed
    the weight gradient of large outputs (cifar10_quick's first layer) measurably. The last
    Kg - Km channels: _dw_last_channels."""
    N, C, H, W = x.shape
    K, Cg, R, S = w.shape
    P, Q = dy.shape[2], dy.shape[3]
    PQ = P * Q
    Kg = K // group
    V = lanes(x.itemsize)
    e, dycl = _aligned(e, V), _aligned(dycl, V)
    if not _dw_start(x, w, dy, dws, dw_step, dbs, db_step, starts, e, dycl, dwt, dbacc, pad_h,
                     group, T, V, overwrite):
        return
    KVV = KV * V
    Hp = H + 2 * pad_h
    HpQ = Hp * Q
    CSg = Cg * S
    _, _, Km, Tl, KVl = _dw_tiles(CSg, Kg, group, R, PQ, HpQ, V)
    Kgp, CSv, left, trans = _dw_layout(CSg, Kg, group, R, PQ, HpQ, V)
    Kp = group * Kgp
    nkb = _round_up(Km, KVV) // KVV
    CSp = _round_up(CSg, T)
    CgRS = Cg * R * S
    dwt_size = Kp * R * CSp
    o1, o2 = _dw_extra(dwt_size, K * CgRS, left, V)
    lsum, et = dwt[o1:o1 + left], dwt[o2:o2 + trans]
    for part in range(starts.size - 1):
        n0, n1 = starts[part], starts[part + 1]
        for n in range(n0, n1):
            _dw_sample(x, n, e, et, dbacc, Kp, S, dil_w, pad_h, pad_w, Hp, Q, Tl, CSg, CSv, V)
            for p0 in range(0, PQ, POSITION_BLOCK):
                _channels_last(dy, n, p0, min(POSITION_BLOCK, PQ - p0), dycl, dbacc,
                               dbs.size > 0, Kg, Kgp, V)
                for r in range(R):
                    # Only the positions whose kernel row r reads no padding row (see
                    # Determinism above).
                    p_lo, p_hi = _valid_range(r * dil_h - pad_h, 1, H, P)
                    j0 = min(max(p_lo * Q, p0), p0 + POSITION_BLOCK)
                    steps = max(min(p_hi * Q, PQ, p0 + POSITION_BLOCK) - j0, 0)
                    for gr in range(group):
                        for kb in range(nkb):
                            blk = gr * nkb + kb
                            d_off = (j0 - p0) * Kp + gr * Kgp + kb * KVV
                            for cs0 in range(0, CSg, T):
                                tile(T, KV, dwt, ((blk * R + r) * CSp + cs0) * KVV, KVV,
                                     CSg - cs0, KVV, n > n0 or p0 > 0,
                                     e, (gr * CSg + cs0) * HpQ + r * dil_h * Q + j0,
                                     HpQ, 0, 1, dycl, d_off, 0, Kp, 1, steps)
                    _dw_last_channels(lsum, et, dycl, r, j0 - p0, j0, steps, n > n0 or p0 > 0,
                                      Kp, Km, Kg - Km, Tl, KVl, CSg, CSv, dil_h * Q, V)
            _db_store(dbs, dbacc, part * db_step, group, Kg, Kgp, overwrite and n == n0)
        if n1 == n0:
            continue  # no gradient to add: dwt holds the previous part's
        # Into dw: dwt turned into w's layout (dwk) a block of (s, channels) at a time, then
        # added in one pass. (Adding dwt's elements into dw one by one touched a cache line of
        # dw per element: a tenth of cifar10_quick's conv3 backward.)
        dwk = dwt[dwt_size:dwt_size + K * CgRS]
        for gr in range(group):
            for kb in range(nkb):
                blk = gr * nkb + kb
                k0 = gr * Kg + kb * KVV
                kn = min(KVV, Km - kb * KVV)
                for c in range(Cg):
                    for r in range(R):
                        base = (blk * R + r) * CSp + c * S
                        for s0 in range(0, S, V):
                            for kk0 in range(0, kn, V):
                                transpose_block(dwk, (k0 + kk0) * CgRS + (c * R + r) * S + s0,
                                                CgRS, dwt, (base + s0) * KVV + kk0, KVV,
                                                min(V, S - s0), min(V, kn - kk0), dwk, 0, False)
        _dw_store(dws[part * dw_step:part * dw_step + K * CgRS], dwk, lsum, Km, Kg - Km, Tl,
                  R, Cg, S, CSv, overwrite)


@njit(cache=True, nogil=True)
def _dw_by_rows(x, w, dy, dws, dw_step, dbs, db_step, starts, e, dycl, dwt, dbacc, pad_h,
                pad_w, dil_h, dil_w, group, T, overwrite):
    """_dw_by_tiles for kernels DW_S wide whose tiles are DW_KV vectors of channels wide
    (T: direct_shapes', which sizes dwt): each tile takes the S rows (c, s) of one input
    channel and kernel row and stores them in w's order, so one transposition per part
    turns the sums into w's layout. A kernel of its own, so that a cold first run compiles
    only the tiles its layers run: LeNet none of _dw_by_tiles' six shapes, cifar10_quick
    none of these."""
    N, C, H, W = x.shape
    K, Cg, R, S = w.shape
    P, Q = dy.shape[2], dy.shape[3]
    PQ = P * Q
    Kg = K // group
    V = lanes(x.itemsize)
    e, dycl = _aligned(e, V), _aligned(dycl, V)
    if not _dw_start(x, w, dy, dws, dw_step, dbs, db_step, starts, e, dycl, dwt, dbacc, pad_h,
                     group, T, V, overwrite):
        return
    KVV = DW_KV * V
    Hp = H + 2 * pad_h
    HpQ = Hp * Q
    CSg = Cg * S
    _, _, Km, Tl, KVl = _dw_tiles(CSg, Kg, group, R, PQ, HpQ, V)
    Kgp, CSv, left, trans = _dw_layout(CSg, Kg, group, R, PQ, HpQ, V)
    Kp = group * Kgp
    nkb = _round_up(Km, KVV) // KVV
    CgRS = Cg * R * S
    dwt_size = Kp * R * _round_up(CSg, T)
    o1, o2 = _dw_extra(dwt_size, K * CgRS, left, V)
    lsum, et = dwt[o1:o1 + left], dwt[o2:o2 + trans]
    for part in range(starts.size - 1):
        n0, n1 = starts[part], starts[part + 1]
        for n in range(n0, n1):
            _dw_sample(x, n, e, et, dbacc, Kp, S, dil_w, pad_h, pad_w, Hp, Q, Tl, CSg, CSv, V)
            for p0 in range(0, PQ, POSITION_BLOCK):
                _channels_last(dy, n, p0, min(POSITION_BLOCK, PQ - p0), dycl, dbacc,
                               dbs.size > 0, Kg, Kgp, V)
                for r in range(R):
                    p_lo, p_hi = _valid_range(r * dil_h - pad_h, 1, H, P)
                    j0 = min(max(p_lo * Q, p0), p0 + POSITION_BLOCK)
                    steps = max(min(p_hi * Q, PQ, p0 + POSITION_BLOCK) - j0, 0)
                    for gr in range(group):
                        for kb in range(nkb):
                            blk = gr * nkb + kb
                            d_off = (j0 - p0) * Kp + gr * Kgp + kb * KVV
                            for c in range(Cg):
                                tile(DW_S, DW_KV, dwt, ((blk * Cg + c) * R + r) * S * KVV,
                                     KVV, S, KVV, n > n0 or p0 > 0,
                                     e, (gr * CSg + c * S) * HpQ + r * dil_h * Q + j0,
                                     HpQ, 0, 1, dycl, d_off, 0, Kp, 1, steps)
                    _dw_last_channels(lsum, et, dycl, r, j0 - p0, j0, steps, n > n0 or p0 > 0,
                                      Kp, Km, Kg - Km, Tl, KVl, CSg, CSv, dil_h * Q, V)
            _db_store(dbs, dbacc, part * db_step, group, Kg, Kgp, overwrite and n == n0)
        if n1 == n0:
            continue  # no gradient to add: dwt holds the previous part's
        # Into dw: the sums are in rows (c, r, s) already, one transposition into w's layout
        # (dwk), then added in one pass.
        dwk = dwt[dwt_size:dwt_size + K * CgRS]
        for gr in range(group):
            for kb in range(nkb):
                blk = gr * nkb + kb
                k0 = gr * Kg + kb * KVV
                kn = min(KVV, Km - kb * KVV)
                for i0 in range(0, CgRS, V):
                    for kk0 in range(0, kn, V):
                        transpose_block(dwk, (k0 + kk0) * CgRS + i0, CgRS,
                                        dwt, (blk * CgRS + i0) * KVV + kk0, KVV,
                                        min(V, CgRS - i0), min(V, kn - kk0), dwk, 0, False)
        _dw_store(dws[part * dw_step:part * dw_step + K * CgRS], dwk, lsum, Km, Kg - Km, Tl,
                  R, Cg, S, CSv, overwrite)


@njit(cache=True, nogil=True, inline="always")
def _dw_sample(x, n, e, et, dbacc, Kp, S, dil_w, pad_h, pad_w, Hp, Q, Tl, CSg, CSv, V):
    """The start of sample n in the tiled weight gradients: its input widened into e (as
    in conv_forward_direct) and, where the last channels run along T (Tl > 0), transposed
    into et (positions by CSv rows (c, s)); its bias sums dbacc[:Kp] cleared."""
    widen(x[n], e, 0, S, dil_w, pad_h, pad_w, Hp, Q)
    if Tl > 0:
        HpQ = Hp * Q
        for j in range(0, HpQ, V):
            for cs0 in range(0, CSg, V):
                transpose_block(et, j * CSv + cs0, CSv, e, cs0 * HpQ + j, HpQ,
                                min(V, CSg - cs0), min(V, HpQ - j), et, 0, False)
    dbacc[:Kp] = 0


@njit(cache=True, nogil=True, inline="always")
def _dw_last_channels(lsum, et, dycl, r, d_row, j0, steps, accumulate, Kp, Km, Kr, Tl, KVl,
                      CSg, CSv, row_step, V):
    """The last Kr channels of the tiled weight gradients (one group; nothing where Tl is 0)
    at kernel row r, for `steps` positions from j0 (row d_row of the dycl block): tiles of Tl
    channels, broadcast from dycl, by KVl vectors of rows (c, s) of the widened input
    transposed (et, rows of row_step positions a kernel row apart), summed into lsum (rows
    (r, channel) of CSv); the same chains as the other channels'."""
    KrT = _round_up(Kr, Tl) if Tl > 0 else 0
    for t0 in range(0, KrT, max(Tl, 1)):
        for v0 in range(0, CSg, KVl * V):
            _tile_unit(Tl, KVl, lsum, (r * KrT + t0) * CSv + v0, CSv, Kr - t0, CSg - v0,
                       accumulate, dycl, d_row * Kp + Km + t0, 0, Kp,
                       et, (j0 + r * row_step) * CSv + v0, 0, CSv, 1, steps)


@njit(cache=True, nogil=True, inline="always")
def _db_store(dbs, dbacc, at, group, Kg, Kgp, first):
    """A sample's bias sums (dbacc, channels padded to Kgp per group) added into the part's
    bias gradient at dbs[at:] (none where dbs is empty), or, for the part's first sample
    where overwriting (first), added to zeros."""
    if dbs.size > 0:
        for gr in range(group):
            for kk in range(Kg):
                i = at + gr * Kg + kk
                dbs[i] = dbacc[gr * Kgp + kk] + (0.0 if first else dbs[i])


@njit(cache=True, nogil=True, inline="always")
def _dw_store(dw, dwk, lsum, Km, Kr, Tl, R, Cg, S, CSv, overwrite):
    """The end of a part in the tiled weight gradients: the last Kr channels' sums (lsum,
    _dw_last_channels) copied into dwk after the first Km channels', then dwk (w's layout)
    added into the part's gradient dw, or stored (overwrite, as conv_backward_direct's)."""
    KrT = _round_up(Kr, Tl) if Tl > 0 else 0
    CgRS = Cg * R * S
    for t in range(Kr):
        for r in range(R):
            for c in range(Cg):
                for s in range(S):
                    dwk[(Km + t) * CgRS + (c * R + r) * S + s] = \
                        lsum[(r * KrT + t) * CSv + c * S + s]
    if overwrite:
        for i in range(dwk.size):
            dw[i] = dwk[i] + 0.0
    else:
        for i in range(dwk.size):
            dw[i] += dwk[i]


@njit(cache=True, nogil=True)
def _dx_gather(w, dy, dx, eb, wft, pad_h, pad_w, dil_h, dil_w, group, T, KV, positions, V):
    """dx[n, c, h, w] = sum over (r', k, s') of w[k, c, R-1-r', S-1-s'] * dy[n, k,
    h + r'*dil_h - shift_h, w + s'*dil_w - shift_w] (0 outside dy), one chain per element:
    the forward pattern on dy widened with these shifts (eb), the weights flipped (wft,
    followed by one sample's and group's dx, channels innermost, for position tiles). It
    multiplies the zeros around dy too, but for the kernel rows a tile leaves out. Scratch
    as conv_backward_direct's (T, KV, positions: direct_shapes')."""
    eb, wft = _aligned(eb, V), _aligned(wft, V)
    N, C, H, W = dx.shape
    K, Cg, R, S = w.shape
    Kg = K // group
    CgT = _channel_pad(Cg, T, KV, positions, V)
    Hb = H + dil_h * (R - 1)
    HbW = Hb * W
    KSg = Kg * S
    HW = H * W
    wsz = group * R * KSg * CgT
    if eb.size < K * S * HbW + 4 * V or wft.size < wsz + (HW * CgT if positions else 0):
        raise ValueError("conv_backward_direct: scratch too small")
    ycl = wft[wsz:]
    # One filter at a time (a few kB, in L1 for all its taps), with unsigned flat indices: a
    # signed index costs a wrap-around test per element (see im2col).
    wf = w.reshape(w.size)
    RS = R * S
    for gr in range(group):
        for k in range(Kg):
            for r in range(R):
                for s in range(S):
                    base = ((gr * R + r) * KSg + k * S + s) * CgT
                    src = (gr * Kg + k) * Cg * RS + (R - 1 - r) * S + S - 1 - s
                    for c in range(Cg):
                        wft[np.uintp(base + c)] = wf[np.uintp(src + c * RS)]
    shift_h = dil_h * (R - 1) - pad_h
    shift_w = dil_w * (S - 1) - pad_w
    dxf = dx.reshape(N * C * HW)
    for n in range(N):
        widen(dy[n], eb, 0, S, dil_w, shift_h, shift_w, Hb, W)
        for gr in range(group):
            _convolve_rows(eb, gr * KSg * HbW, HbW, dil_h * W, wft, gr * R * KSg * CgT, CgT,
                           dxf, (n * C + gr * Cg) * HW, Cg, HW, R, KSg, W, dil_h, shift_h,
                           dy.shape[2], T, KV, positions, ycl, V)


@njit(cache=True, nogil=True)
def _dx_columns(w, dy, dx, dyc, wt, cols, pad_h, pad_w, dil_h, dil_w, group, T, KV, V):
    """dx through the column matrix, for a layer whose output is clearly smaller than its
    input (unpadded): per sample and group, cols[(c, r, s), j] = sum over k in order of
    w[k, c, r, s] * dy[n, k, j], one chain per element (tiles of T rows by KV vectors of the
    P*Q output positions j), then the rows (c, r, s) are added into dx[n, c] where tap (r, s)
    puts them, each element taking its taps in (r, s) order (tile.shifted_row_sum: the S taps
    of a kernel row at once, several rows of dx at a time). It multiplies no zeros; the adding
    pass touches each column element once. dyc: one sample's dy (with room for a tile's last
    vectors); wt: the weights with (c, r, s) innermost, rows padded to whole tiles (with
    zeros); cols: one group's column matrix (dxp). Each aligned here; T, KV: direct_shapes'."""
    dyc, wt, cols = _aligned(dyc, V), _aligned(wt, V), _aligned(cols, V)
    N, C, H, W = dx.shape
    K, Cg, R, S = w.shape
    P, Q = dy.shape[2], dy.shape[3]
    PQ = P * Q
    Kg = K // group
    CgRS = Cg * R * S
    CgRSp = _round_up(CgRS, T)
    if dyc.size < K * PQ + 4 * V or wt.size < K * CgRSp or cols.size < CgRS * PQ:
        raise ValueError("conv_backward_direct: scratch too small")
    wf = w.reshape(K * CgRS)
    for k in range(K):
        copy(wf[k * CgRS:(k + 1) * CgRS], wt[k * CgRSp:k * CgRSp + CgRS])
        wt[k * CgRSp + CgRS:(k + 1) * CgRSp] = 0
    KVV = KV * V
    dyf = dy.reshape(N * K * PQ)
    dxf = dx.reshape(N * C * H * W)
    for n in range(N):
        copy(dyf[n * K * PQ:(n + 1) * K * PQ], dyc[:K * PQ])
        dxf[n * C * H * W:(n + 1) * C * H * W] = 0
        for gr in range(group):
            for j0 in range(0, PQ, KVV):
                for t0 in range(0, CgRS, T):
                    _tile_unit(T, KV, cols, t0 * PQ + j0, PQ, CgRS - t0, PQ - j0, False,
                               wt, gr * Kg * CgRSp + t0, 0, CgRSp,
                               dyc, gr * Kg * PQ + j0, 0, PQ, 1, Kg)
            for c in range(Cg):
                plane = (n * C + gr * Cg + c) * H * W
                for r in range(R):
                    # Row p + r*dil_h - pad_h of dx takes row p of the S taps (r, s), in order
                    # of s: each element adds its taps in the (r, s) order of the column
                    # matrix's rows.
                    p_lo, p_hi = _valid_range(r * dil_h - pad_h, 1, H, P)
                    shifted_row_sum(dxf, plane + (p_lo + r * dil_h - pad_h) * W, W, cols,
                                    (c * R + r) * S * PQ + p_lo * Q, PQ, S, dil_w, pad_w, Q,
                                    p_hi - p_lo)


# ---------------------------------------------------------------------------------------------
# im2col path (any stride)

@njit(cache=True, nogil=True)
def im2col(x, col, R, S, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, P, Q):
    """x: (C, H, W) one sample; col: (C*R*S, P*Q). Row (c*R + r)*S + s holds, for every output
    position (p, q), the input x[c, p*stride_h - pad_h + r*dil_h, q*stride_w - pad_w + s*dil_w],
    or 0 where that falls in the padding.

    Indexing is flat and unsigned (np.uintp): every index here is non-negative by construction,
    and a signed index would cost a wrap-around test per element (Python's negative indices)
    that keeps the copies from being vectorised; this runs about three times faster."""
    C, H, W = x.shape
    PQ = P * Q
    xf = x.reshape(C * H * W)
    cf = col.reshape(col.size)
    for c in range(C):
        for r in range(R):
            off_h = r * dil_h - pad_h
            p_lo, p_hi = _valid_range(off_h, stride_h, H, P)
            for s in range(S):
                base = ((c * R + r) * S + s) * PQ
                off_w = s * dil_w - pad_w
                q_lo, q_hi = _valid_range(off_w, stride_w, W, Q)
                for i in range(base, base + p_lo * Q):
                    cf[np.uintp(i)] = 0
                for i in range(base + p_hi * Q, base + PQ):
                    cf[np.uintp(i)] = 0
                for p in range(p_lo, p_hi):
                    dst = base + p * Q
                    # Input index of output column q: src + q * stride_w (>= 0 for q >= q_lo).
                    src = (c * H + p * stride_h + off_h) * W + off_w
                    for q in range(q_lo):
                        cf[np.uintp(dst + q)] = 0
                    if stride_w == 1:
                        d = np.uintp(dst + q_lo)
                        t = np.uintp(src + q_lo)
                        for i in range(q_hi - q_lo):
                            cf[d + np.uintp(i)] = xf[t + np.uintp(i)]
                    else:
                        for q in range(q_lo, q_hi):
                            cf[np.uintp(dst + q)] = xf[np.uintp(src + q * stride_w)]
                    for q in range(q_hi, Q):
                        cf[np.uintp(dst + q)] = 0


@njit(cache=True, nogil=True)
def col2im(col, dx, R, S, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, P, Q):
    """The adjoint of im2col: col (C*R*S, P*Q) -> dx (C, H, W), one sample. Overwrites dx;
    overlapping windows add up in the fixed order (c, r, s, p, q). Unsigned flat indices, as
    in im2col."""
    C, H, W = dx.shape
    PQ = P * Q
    dxf = dx.reshape(C * H * W)
    cf = col.reshape(col.size)
    dxf[:] = 0
    for c in range(C):
        for r in range(R):
            off_h = r * dil_h - pad_h
            p_lo, p_hi = _valid_range(off_h, stride_h, H, P)
            for s in range(S):
                base = ((c * R + r) * S + s) * PQ
                off_w = s * dil_w - pad_w
                q_lo, q_hi = _valid_range(off_w, stride_w, W, Q)
                for p in range(p_lo, p_hi):
                    src = base + p * Q
                    dst = (c * H + p * stride_h + off_h) * W + off_w
                    if stride_w == 1:
                        d = np.uintp(dst + q_lo)
                        t = np.uintp(src + q_lo)
                        for i in range(q_hi - q_lo):
                            dxf[d + np.uintp(i)] += cf[t + np.uintp(i)]
                    else:
                        for q in range(q_lo, q_hi):
                            dxf[np.uintp(dst + q * stride_w)] += cf[np.uintp(src + q)]


@njit(cache=True, nogil=True)
def _is_pointwise(R, S, stride_h, stride_w, pad_h, pad_w):
    """A 1x1 kernel with stride 1 and no padding: the column matrix is the input itself."""
    return R == 1 and S == 1 and stride_h == 1 and stride_w == 1 and pad_h == 0 and pad_w == 0


@njit(cache=True, nogil=True)
def _add_bias(y, b):
    """y: (K, PQ) one sample's output; y[k] += b[k] (convolution and deconvolution)."""
    for k in range(y.shape[0]):
        bk = b[k]
        yk = y[k]
        for i in range(y.shape[1]):
            yk[i] += bk


@njit(cache=True, nogil=True)
def _add_bias_grad(dy, db):
    """dy: (K, PQ) one sample's top gradient; db[k] += the sum over positions of dy[k], in
    order (convolution and deconvolution)."""
    for k in range(dy.shape[0]):
        dyk = dy[k]
        acc = dyk[0] * 0
        for i in range(dy.shape[1]):
            acc += dyk[i]
        db[k] += acc


@njit(cache=True, nogil=True)
def conv_forward(x, w, b, y, col, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, group):
    """x: (N, C, H, W); w: (K, C/G, R, S); b: (K,), or (0,) for no bias; y: (N, K, P, Q);
    col: (C*R*S, P*Q) scratch. Per sample n and group g (G = group):
    y[n, g's K/G filters] = w[g's filters] @ col[g's C/G channels], then y[n, k] += b[k]."""
    N, C, H, W = x.shape
    K, Cg, R, S = w.shape
    P, Q = y.shape[2], y.shape[3]
    CgRS = Cg * R * S
    Kg = K // group
    w2 = w.reshape((K, CgRS))
    pointwise = _is_pointwise(R, S, stride_h, stride_w, pad_h, pad_w)
    for n in range(N):
        if pointwise:
            cols = x[n].reshape((C, H * W))
        else:
            im2col(x[n], col, R, S, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, P, Q)
            cols = col
        yn = y[n].reshape((K, P * Q))
        for g in range(group):
            gemm(1.0, w2[g * Kg:(g + 1) * Kg], cols[g * CgRS:(g + 1) * CgRS], 0.0,
                 yn[g * Kg:(g + 1) * Kg])
        if b.size > 0:
            _add_bias(yn, b)


@njit(cache=True, nogil=True)
def conv_backward(x, w, dy, dx, dws, dw_step, dbs, db_step, starts, col, stride_h, stride_w,
                  pad_h, pad_w, dil_h, dil_w, group, need_dx):
    """x: (N, C, H, W); w: (K, C/G, R, S); dy: (N, K, P, Q); dx: like x (any array when not
    need_dx), OVERWRITTEN; col: (C*R*S, P*Q) scratch. Parts, dws and dbs as in
    conv_backward_direct: part i's gradients (laid out like w, and (K,)) are ADDED to, one
    sample of the part at a time in sample order. Per sample n: db += sums of dy[n] over
    (P, Q); dw += dy[n] @ col^T by group (BLAS adding into dw); dx[n] = col2im(w^T @ dy[n])
    by group."""
    N, C, H, W = x.shape
    K, Cg, R, S = w.shape
    P, Q = dy.shape[2], dy.shape[3]
    PQ = P * Q
    CgRS = Cg * R * S
    Kg = K // group
    w2 = w.reshape((K, CgRS))
    pointwise = _is_pointwise(R, S, stride_h, stride_w, pad_h, pad_w)
    if starts[0] != 0 or starts[-1] != N:
        raise ValueError("conv_backward: the parts must cover the samples")
    part = 0
    for n in range(N):
        while n >= starts[part + 1]:
            part += 1
        dw2 = dws[part * dw_step:part * dw_step + K * CgRS].reshape((K, CgRS))
        dyn = dy[n].reshape((K, PQ))
        if dbs.size > 0:
            _add_bias_grad(dyn, dbs[part * db_step:part * db_step + K])
        if pointwise:
            cols = x[n].reshape((C, H * W))
        else:
            im2col(x[n], col, R, S, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, P, Q)
            cols = col
        for g in range(group):
            gemm(1.0, dyn[g * Kg:(g + 1) * Kg], cols[g * CgRS:(g + 1) * CgRS].T, 1.0,
                 dw2[g * Kg:(g + 1) * Kg])
        if need_dx:
            # The column gradient goes straight into dx when the columns are the input itself.
            dcols = dx[n].reshape((C, H * W)) if pointwise else col
            for g in range(group):
                gemm(1.0, w2[g * Kg:(g + 1) * Kg].T, dyn[g * Kg:(g + 1) * Kg], 0.0,
                     dcols[g * CgRS:(g + 1) * CgRS])
            if not pointwise:
                col2im(col, dx[n], R, S, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, P, Q)


# ---------------------------------------------------------------------------------------------
# Deconvolution: the transpose of a convolution, through the im2col path's pieces

@njit(cache=True, nogil=True)
def deconv_forward(x, w, b, y, col, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, group):
    """x: (N, C, H, W); w: (C, K/G, R, S); b: (K,), or (0,) for no bias; y: (N, K, P, Q), the
    output of the convolution whose input gradient this is (P = stride_h*(H - 1) +
    dil_h*(R - 1) + 1 - 2*pad_h); col: (K*R*S, H*W) scratch. Per sample n and group g:
    col[g's K/G channels' rows] = w[g's C/G]^T @ x[n, g's C/G] (BLAS), y[n] = col2im(col),
    then y[n, k] += b[k]: Caffe's Deconvolution forward."""
    N, C, H, W = x.shape
    Cw, Kg, R, S = w.shape
    K, P, Q = y.shape[1], y.shape[2], y.shape[3]
    Cg = C // group
    KgRS = Kg * R * S
    w2 = w.reshape((C, KgRS))
    for n in range(N):
        xn = x[n].reshape((C, H * W))
        for g in range(group):
            gemm(1.0, w2[g * Cg:(g + 1) * Cg].T, xn[g * Cg:(g + 1) * Cg], 0.0,
                 col[g * KgRS:(g + 1) * KgRS])
        col2im(col, y[n], R, S, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, H, W)
        if b.size > 0:
            _add_bias(y[n].reshape((K, P * Q)), b)


@njit(cache=True, nogil=True)
def deconv_backward(x, w, dy, dx, dws, dw_step, dbs, db_step, starts, col, stride_h, stride_w,
                    pad_h, pad_w, dil_h, dil_w, group, need_dx):
    """x: (N, C, H, W); w: (C, K/G, R, S); dy: (N, K, P, Q); dx: like x (any array when not
    need_dx), OVERWRITTEN; col: (K*R*S, H*W) scratch. Parts, dws and dbs as in conv_backward:
    part i's gradients (laid out like w, and (K,)) are ADDED to, one sample of the part at a
    time in sample order. Per sample n: db += sums of dy[n] over (P, Q); col = im2col(dy[n]);
    by group, dw += x[n] @ col^T and dx[n] = w @ col (BLAS): Caffe's Deconvolution backward,
    a convolution's weight gradient and forward pass on dy."""
    N, C, H, W = x.shape
    Cw, Kg, R, S = w.shape
    K, P, Q = dy.shape[1], dy.shape[2], dy.shape[3]
    Cg = C // group
    KgRS = Kg * R * S
    w2 = w.reshape((C, KgRS))
    if starts[0] != 0 or starts[-1] != N:
        raise ValueError("deconv_backward: the parts must cover the samples")
    part = 0
    for n in range(N):
        while n >= starts[part + 1]:
            part += 1
        dw2 = dws[part * dw_step:part * dw_step + C * KgRS].reshape((C, KgRS))
        if dbs.size > 0:
            _add_bias_grad(dy[n].reshape((K, P * Q)), dbs[part * db_step:part * db_step + K])
        im2col(dy[n], col, R, S, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, H, W)
        xn = x[n].reshape((C, H * W))
        for g in range(group):
            gemm(1.0, xn[g * Cg:(g + 1) * Cg], col[g * KgRS:(g + 1) * KgRS].T, 1.0,
                 dw2[g * Cg:(g + 1) * Cg])
        if need_dx:
            dxn = dx[n].reshape((C, H * W))
            for g in range(group):
                gemm(1.0, w2[g * Cg:(g + 1) * Cg], col[g * KgRS:(g + 1) * KgRS], 0.0,
                     dxn[g * Cg:(g + 1) * Cg])


# ---------------------------------------------------------------------------------------------
# Depthwise path: one input channel per group (MobileNet's group = channels)
#
# The other paths multiply blocks of channels; with one input channel per group their tiles
# hold a single row, and a depthwise layer ran 3 to 100 times slower than PyTorch's
# (bench/depthwise.py). Here each channel's plane is first copied, zero-padded, into scratch
# ("plane") as stride_h x stride_w sub-planes, Hq x Wq each (space to depth: sub-plane
# (a, c) holds the padded plane's rows a, a + stride_h, ... and columns c, c + stride_w, ...).
# Tap (r, s) of every output (p, q) then reads sub-plane (r*dil_h % stride_h,
# s*dil_w % stride_w) at (p + r*dil_h // stride_h, q + s*dil_w // stride_w): with the output
# kept Wq wide ("wide"; the columns past Q are dropped when it is copied out), a tap is one
# loop out[j] += w * sub[j + offset] over the flat output, for any stride. The loops run in
# blocks of BLOCK outputs that stay in the L1 cache while every tap adds to them. The input
# gradient runs the same loops the other way, each tap adding w * dy (kept Wq wide, zero past
# Q) into the padded input gradient's sub-planes, whose inside is then copied out.
#
# Determinism. Each output element is one chain over its taps in (r, s) order from 0; each
# input-gradient element adds its terms over the group's output channels, the blocks and the
# taps in that order: the bits follow the layer's shape alone. Zeros (the padding, dy past
# column Q) enter these sums and leave them as they are (x + 0 = x; only an infinite operand
# would make a NaN of them). The weight gradient of one sample and tap sums its positions in
# partial sums, one per position of a block (_lanes), added in a fixed tree at the end: the
# same bits for any vector width. A part's gradient adds its samples' in order.

BLOCK = 1024   # outputs per block (a power of two), and the most partial sums


@njit(cache=True, nogil=True)
def _depthwise_dims(H, W, R, S, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w):
    """(P, Q, Hq, Wq): the output, and the sub-planes of the padded input."""
    Hp, Wp = H + 2 * pad_h, W + 2 * pad_w
    P = (Hp - dil_h * (R - 1) - 1) // stride_h + 1
    Q = (Wp - dil_w * (S - 1) - 1) // stride_w + 1
    return P, Q, (Hp + stride_h - 1) // stride_h, (Wp + stride_w - 1) // stride_w


@njit(cache=True, nogil=True)
def _lanes(n):
    """The partial sums of a dot product over n positions: the least power of two >= n, at
    most BLOCK (then position i goes to lane i mod BLOCK)."""
    lanes = 1
    while lanes < n and lanes < BLOCK:
        lanes *= 2
    return lanes


@njit(cache=True, nogil=True)
def depthwise_sizes(H, W, R, S, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w):
    """Elements of the depthwise path's scratch (plane, wide, acc): the sub-planes, with
    room for the last tap's reads past them; one output (or dy) plane Wq wide; the weight
    gradient's partial sums for every tap."""
    P, Q, Hq, Wq = _depthwise_dims(H, W, R, S, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w)
    plane = stride_h * stride_w * Hq * Wq + dil_w * (S - 1) // stride_w + 1
    return plane, P * Wq, R * S * _lanes(P * Wq)


@njit(cache=True, nogil=True)
def _to_depth(src, s0, H, W, dst, size, sh, sw, Hq, Wq, top, left):
    """dst[:size] = 0, then the H x W plane src[s0:] placed at (top, left) of the padded
    plane, stored as sh x sw sub-planes Hq x Wq (see above): padded (h', w') goes to
    sub-plane (h' % sh, w' % sw), row h' // sh, column w' // sw. What falls outside is
    dropped (top and left may be negative). Offsets are unsigned (np.uintp), as in im2col: a
    signed index costs a wrap-around test per element that keeps a loop from being
    vectorised."""
    for i in range(size):
        dst[np.uintp(i)] = 0
    h_lo, h_hi = max(0, -top), min(H, sh * Hq - top)
    w_lo, w_hi = max(0, -left), min(W, sw * Wq - left)
    step = np.uintp(sw)
    if sh == 1 and sw == 1:   # one plane: row copies, no divisions (each costs ~25 cycles)
        for h in range(h_lo, h_hi):
            d = np.uintp((h + top) * Wq + left + w_lo)
            t = np.uintp(s0 + h * W + w_lo)
            for i in range(w_hi - w_lo):
                dst[d + np.uintp(i)] = src[t + np.uintp(i)]
        return
    for h in range(h_lo, h_hi):
        hp = h + top
        t0 = s0 + h * W - left
        for c in range(sw):
            # The columns j*sw + c whose source w = j*sw + c - left lies in [w_lo, w_hi).
            j_lo = (w_lo + left - c + sw - 1) // sw
            j_hi = (w_hi + left - c + sw - 1) // sw
            if j_hi <= j_lo:
                continue
            d = np.uintp((((hp % sh) * sw + c) * Hq + hp // sh) * Wq + j_lo)
            t = np.uintp(t0 + j_lo * sw + c)
            for i in range(j_hi - j_lo):
                dst[d + np.uintp(i)] = src[t + np.uintp(i) * step]


@njit(cache=True, nogil=True)
def _from_depth(dst, d0, H, W, src, sh, sw, Hq, Wq, top, left):
    """The inverse of _to_depth for the H x W plane at (top, left): dst[d0 + h*W + w] = the
    sub-planes' element of padded (h + top, w + left)."""
    step = np.uintp(sw)
    if sh == 1 and sw == 1:
        _copy_rows(dst, d0, W, src, top * Wq + left, Wq, H, W, dst.dtype.type(0))
        return
    for h in range(H):
        hp = h + top
        for c in range(sw):
            j_lo = (left - c + sw - 1) // sw
            j_hi = (W + left - c + sw - 1) // sw
            if j_hi <= j_lo:
                continue
            t = np.uintp((((hp % sh) * sw + c) * Hq + hp // sh) * Wq + j_lo)
            d = np.uintp(d0 + h * W + j_lo * sw + c - left)
            for i in range(j_hi - j_lo):
                dst[d + np.uintp(i) * step] = src[t + np.uintp(i)]


@njit(cache=True, nogil=True)
def _copy_rows(dst, d0, dst_row, src, s0, src_row, rows, cols, add):
    """dst[d0 + p*dst_row + q] = src[s0 + p*src_row + q] + add for p < rows, q < cols."""
    for p in range(rows):
        d, t = np.uintp(d0 + p * dst_row), np.uintp(s0 + p * src_row)
        for q in range(cols):
            dst[d + np.uintp(q)] = src[t + np.uintp(q)] + add


@njit(cache=True, nogil=True, fastmath={"contract"})
def _tap(out, o0, src, s0, wv, L):
    """out[o0 + i] += wv * src[s0 + i] for i < L: one tap over a run."""
    d, t = np.uintp(o0), np.uintp(s0)
    for i in range(L):
        out[d + np.uintp(i)] += wv * src[t + np.uintp(i)]


@njit(cache=True, nogil=True, fastmath={"contract"})
def _taps(out, o0, src, s0, s1, s2, w0, w1, w2, count, L):
    """count (1 to 3) taps over a run in one pass: out[o0 + i] += w0 * src[s0 + i], then
    w1 * src[s1 + i], then w2 * src[s2 + i], each element's additions in that order, as
    count calls of _tap would make them (one load and store of out for all)."""
    d, t0, t1, t2 = np.uintp(o0), np.uintp(s0), np.uintp(s1), np.uintp(s2)
    if count == 1:
        _tap(out, o0, src, s0, w0, L)
    elif count == 2:
        for i in range(L):
            u = np.uintp(i)
            v = out[d + u]
            v += w0 * src[t0 + u]
            v += w1 * src[t1 + u]
            out[d + u] = v
    else:
        for i in range(L):
            u = np.uintp(i)
            v = out[d + u]
            v += w0 * src[t0 + u]
            v += w1 * src[t1 + u]
            v += w2 * src[t2 + u]
            out[d + u] = v


@njit(cache=True, nogil=True, fastmath={"contract"})
def _mul_add(out, o0, a, i0, b, j0, L):
    """out[o0 + i] += a[i0 + i] * b[j0 + i] for i < L: partial sums of a dot product, one
    per position (no chain across positions, so the loop runs at the vectors' throughput)."""
    d, ta, tb = np.uintp(o0), np.uintp(i0), np.uintp(j0)
    for i in range(L):
        out[d + np.uintp(i)] += a[ta + np.uintp(i)] * b[tb + np.uintp(i)]


@njit(cache=True, nogil=True)
def _lanes_total(acc, a0, lanes):
    """The sum of acc[a0:a0 + lanes] (a power of two) in a fixed tree: halves added lane by
    lane, the lanes' values overwritten."""
    step = lanes // 2
    while step > 0:
        d, t = np.uintp(a0), np.uintp(a0 + step)
        for l in range(step):
            acc[d + np.uintp(l)] += acc[t + np.uintp(l)]
        step //= 2
    return acc[a0]


@njit(cache=True, nogil=True)
def _tap_offsets(offs, R, S, stride_h, stride_w, dil_h, dil_w, Hq, Wq):
    """offs[r*S + s] = where tap (r, s) of output 0 reads in the sub-planes (worked out once
    per call: integer divisions are slow)."""
    for r in range(R):
        for s in range(S):
            a, c = r * dil_h, s * dil_w
            offs[r * S + s] = ((((a % stride_h) * stride_w + c % stride_w) * Hq + a // stride_h)
                               * Wq + c // stride_w)


@njit(cache=True, nogil=True)
def depthwise_forward(x, w, b, y, plane, wide, offs, stride_h, stride_w, pad_h, pad_w, dil_h,
                      dil_w):
    """x: (N, C, H, W); w: (K, 1, R, S), K a multiple of C (output channel k reads input
    channel k // (K/C)); b: (K,), or (0,) for no bias; y: (N, K, P, Q), overwritten; plane,
    wide: flat scratch (depthwise_sizes); offs: (R*S,) integer scratch.
    y[n, k, p, q] = (sum over (r, s) in order of w[k, 0, r, s] * x[n, k // M,
    p*stride_h + r*dil_h - pad_h, q*stride_w + s*dil_w - pad_w], 0 outside x) + b[k]."""
    N, C, H, W = x.shape
    K, _, R, S = w.shape
    M = K // C
    P, Q, Hq, Wq = _depthwise_dims(H, W, R, S, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w)
    sh, sw = stride_h, stride_w
    xf, yf, wf = x.reshape(N * C * H * W), y.reshape(N * K * P * Q), w.reshape(K * R * S)
    size = sh * sw * Hq * Wq + dil_w * (S - 1) // sw + 1
    L = P * Wq
    zero = y.dtype.type(0)
    _tap_offsets(offs, R, S, sh, sw, dil_h, dil_w, Hq, Wq)
    for n in range(N):
        for g in range(C):
            _to_depth(xf, (n * C + g) * H * W, H, W, plane, size, sh, sw, Hq, Wq, pad_h, pad_w)
            for k in range(g * M, (g + 1) * M):
                for j0 in range(0, L, BLOCK):
                    jn = min(BLOCK, L - j0)
                    for i in range(j0, j0 + jn):
                        wide[i] = 0
                    for r in range(R):
                        # The row's taps three at a time, in order.
                        for s in range(0, S, 3):
                            count = min(3, S - s)
                            s1, s2 = min(s + 1, S - 1), min(s + 2, S - 1)
                            wr = (k * R + r) * S
                            _taps(wide, j0, plane, j0 + offs[r * S + s], j0 + offs[r * S + s1],
                                  j0 + offs[r * S + s2], wf[wr + s], wf[wr + s1], wf[wr + s2],
                                  count, jn)
                _copy_rows(yf, (n * K + k) * P * Q, Q, wide, 0, Wq, P, Q,
                           b[k] if b.size > 0 else zero)


@njit(cache=True, nogil=True)
def depthwise_backward(x, w, dy, dx, dws, dw_step, dbs, db_step, starts, plane, wide, acc, offs,
                       stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, need_dx):
    """x, w, dy as in depthwise_forward (dy: (N, K, P, Q)); dx: like x (any array when not
    need_dx), OVERWRITTEN; parts, dws and dbs as in conv_backward (part i's gradients, laid out
    like w and (K,), are ADDED to); plane, wide, acc: scratch (depthwise_sizes); offs: (R*S,)
    integer scratch.
    Per sample of a part, in order: db[k] += the float64 sum of dy[n, k] over positions;
    dw[k, 0, r, s] += the sample's sum over positions of dy * x at tap (r, s): partial sums
    by position of dy kept Wq wide (zero past column Q), added in a fixed tree. dx: each
    output's terms w[k, 0, r, s] * dy[n, k, p, q] added where tap (r, s) read, in the order
    the module's notes give."""
    N, C, H, W = x.shape
    K, _, R, S = w.shape
    M = K // C
    P, Q, Hq, Wq = _depthwise_dims(H, W, R, S, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w)
    sh, sw = stride_h, stride_w
    xf, dyf, wf = x.reshape(N * C * H * W), dy.reshape(N * K * P * Q), w.reshape(K * R * S)
    size = sh * sw * Hq * Wq + dil_w * (S - 1) // sw + 1
    L = P * Wq
    lanes = _lanes(L)
    if starts[0] != 0 or starts[-1] != N:
        raise ValueError("depthwise_backward: the parts must cover the samples")
    _tap_offsets(offs, R, S, sh, sw, dil_h, dil_w, Hq, Wq)
    part = 0
    for n in range(N):
        while n >= starts[part + 1]:
            part += 1
        for g in range(C):
            _to_depth(xf, (n * C + g) * H * W, H, W, plane, size, sh, sw, Hq, Wq, pad_h, pad_w)
            for k in range(g * M, (g + 1) * M):
                d0 = (n * K + k) * P * Q
                if dbs.size > 0:
                    t = 0.0
                    for i in range(P * Q):
                        t += dyf[d0 + i]
                    dbs[part * db_step + k] += t
                _to_depth(dyf, d0, P, Q, wide, L, 1, 1, P, Wq, 0, 0)
                for i in range(R * S * lanes):
                    acc[i] = 0
                for j0 in range(0, L, lanes):
                    jn = min(lanes, L - j0)
                    for r in range(R):
                        for s in range(S):
                            _mul_add(acc, (r * S + s) * lanes, wide, j0, plane,
                                     j0 + offs[r * S + s], jn)
                dw0 = part * dw_step + k * R * S
                for t in range(R * S):
                    dws[dw0 + t] += _lanes_total(acc, t * lanes, lanes)
    if not need_dx:
        return
    dxf = dx.reshape(N * C * H * W)
    for n in range(N):
        for g in range(C):
            for i in range(size):
                plane[i] = 0
            for k in range(g * M, (g + 1) * M):
                _to_depth(dyf, (n * K + k) * P * Q, P, Q, wide, L, 1, 1, P, Wq, 0, 0)
                for j0 in range(0, L, BLOCK):
                    jn = min(BLOCK, L - j0)
                    for r in range(R):
                        for s in range(S):
                            _tap(plane, j0 + offs[r * S + s], wide, j0,
                                 wf[(k * R + r) * S + s], jn)
            _from_depth(dxf, (n * C + g) * H * W, H, W, plane, sh, sw, Hq, Wq, pad_h, pad_w)
