"""SIMD building blocks for Numba kernels, written with explicit 64-byte vectors (16 float32 or
8 float64 lanes):
- `tile`, a register-tiled multiply-accumulate (the inner loop of a matrix product), and
  `folded_tile`, which adds tiles of partial sums to its products before it stores them;
- `dot_tile`, a register tile of dot products along contiguous rows, and `lane_tile`, the
  same kept in lanes and continued across calls (a convolution's weight gradient);
- two data movers, `shifted_copy` (a copy of rows with zero fill) and `transpose_block`;
- `shifted_row_sum`, rows added into rows at several shifts (a column matrix into the input
  gradient);
- max pooling's passes: `stride2_row_max` (along each row for stride 2, or over the rows of
  whole windows) and `column_max` (down the rows);
- `lane_sums` and `product_and_plain_lane_sums`, sums of rows in 8 float64 lanes (BatchNorm's
  and Scale's sums).
No packing, no blocking for caches, no threads: callers lay their operands out so that these
loops stream them.

Numba's own vectorised loops use 256-bit registers on CPUs that LLVM tunes for "prefer 256-bit"
(most AVX-512 Xeons), half the arithmetic width. Vectors written out as LLVM vector types are
kept at 512 bits where the CPU has them (and split into narrower ones, with the same results,
where it does not). The accumulators live in registers across the whole reduction, and every
product is a fused multiply-add: one rounding per term, each output summed in reduction order,
so the result depends only on the operands and the loop bounds.

    tile(T, KV, out, out_off, out_ts, t_valid, v_valid, accumulate,
         a, a_off, a_ts, a_gstep, a_step, b, b_off, b_gstep, b_step, nseg, nstep)

For t < T and KV vectors v of V lanes (V = lanes(itemsize)), over nseg segments g of nstep
steps i, in that order:
    acc[t][v] = sum of a[a_off + g*a_gstep + i*a_step + t*a_ts]
                       * b[b_off + g*b_gstep + i*b_step + v*V : +V]
    out[out_off + t*out_ts + v*V : +V] = acc[t][v]       (overwrites)
storing only rows t < t_valid and, along the vectors, elements v*V + lane < v_valid, so a
tile may hang over the end of its output (its operands must still be readable there). With
`accumulate`, acc starts from those elements of out instead of 0: a reduction cut into pieces
(to keep each piece's operands in cache) continues the same chain, with the same result.
(T, KV) is one of SHAPES, chosen at run time (`choose`; any other pair stores nothing), or
any shape given as two constants, which compiles that loop alone. a, b and out are 1-d arrays
of one float dtype. Nothing is bounds-checked: the caller guarantees every index lies in its
array. Pass a_ts as the constant 1 where the T operands lie side by side: they are then
constant displacements from one address. Every call site compiles every shape of SHAPES: wrap
`tile` in an @njit function where several sites share it.

Numba caches compiled kernels per source file and does not notice when a function they call
from another file changes: after editing this module, delete the callers' cache files
(kernels/__pycache__/*.nbi, *.nbc).
"""
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

# Bytes per SIMD vector: the lanes per vector are this over the element size.
VECTOR_BYTES = 64

# The (T, KV) tile shapes compiled into every call: at most 24 accumulators, which with KV
# operand vectors and a broadcast fits the 32 vector registers of AVX-512. (Each shape costs
# compile time at every call site; shapes with one vector were slower everywhere measured.)
SHAPES = ((12, 2), (8, 2), (6, 2), (8, 3), (6, 4), (3, 4))
# The largest T of a shape: how many rows a tile may run past the end of what it covers.
T_MAX = max(T for T, _ in SHAPES)
# Their measured speeds, relative (multiply-adds per second on a Xeon with AVX-512, operands
# streaming from L2): fewer accumulators hide less latency and load more operands per
# multiply-add. SPEEDS_UNIT where the T broadcast operands lie side by side (a_ts = 1: the
# convolution forward pass and input gradient, InnerProduct), measured in convolution
# kernels; SPEEDS_STRIDED where they lie a run-time stride apart (the convolution weight
# gradient), measured in place on the shipped nets' layers by `python bench/tile_speeds.py`.
# There, 4 vectors of output channels read the broadcast operands half as often as 2; (8, 3)
# pads 50 % more than (8, 2) on every one of those layers, so it has no fair figure and is
# taken as (8, 2).
SPEEDS_UNIT = (0.93, 1.00, 0.90, 0.97, 0.97, 0.75)
SPEEDS_STRIDED = (1.00, 1.00, 0.99, 1.00, 1.10, 1.05)


@njit(cache=True, nogil=True)
def lanes(itemsize):
    """Lanes per vector for elements of `itemsize` bytes (16 for float32, 8 for float64)."""
    return VECTOR_BYTES // itemsize


@njit(cache=True, nogil=True)
def choose(nt, nv, V, unit):
    """The tile shape (T, KV) of SHAPES that covers nt outputs along T and nv along the vectors
    (V lanes each) in the least estimated time: the multiply-adds of the padded tiles over the
    shape's speed (SPEEDS_UNIT where a_ts will be 1, SPEEDS_STRIDED otherwise)."""
    return choose_from(nt, nv, V, SHAPES, SPEEDS_UNIT if unit else SPEEDS_STRIDED)


@njit(cache=True, nogil=True)
def choose_from(nt, nv, V, shapes, speeds):
    """choose among `shapes`, of relative speeds `speeds`: for a kernel that also compiles
    shapes of its own (given to tile as constants)."""
    best_t, best_kv, best = 0, 0, -1.0
    for i in range(len(shapes)):
        T, KV = shapes[i]
        speed = speeds[i]
        work = ((nt + T - 1) // T * T) * ((nv + KV * V - 1) // (KV * V) * KV * V)
        cost = work / speed
        if best < 0 or cost < best:
            best_t, best_kv, best = T, KV, cost
    return best_t, best_kv


def _masked_memory(builder, vty, width, bits, kind="f"):
    """LLVM's masked load and store of vectors vty (width lanes of <kind><bits>: f32, f64,
    i32), for codegen: load(pointer, align, mask, passthrough) and store(value, pointer,
    align, mask)."""
    i32 = ir.IntType(32)
    mask_ty = ir.VectorType(ir.IntType(1), width)
    load = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vty, [vty.as_pointer(), i32, mask_ty, vty]),
        f"llvm.masked.load.v{width}{kind}{bits}.p0")
    store = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [vty, vty.as_pointer(), i32, mask_ty]),
        f"llvm.masked.store.v{width}{kind}{bits}.p0")
    return load, store


def _float_dtype(*arrays):
    """For typing: the dtype the arrays share, float32 or float64; None (no such intrinsic)
    unless all are arrays of one of those."""
    if not all(isinstance(x, types.Array) for x in arrays):
        return None
    dtype = arrays[0].dtype
    if dtype not in (types.float32, types.float64) or any(x.dtype != dtype for x in arrays):
        return None
    return dtype


def _vectors(context, dtype):
    """For codegen: (width, vty, i32, i32v, intp, bits): the lanes of dtype's 64-byte vectors,
    the vector type, 32-bit integers and vectors of them, the index type, dtype's bits."""
    fty = context.get_value_type(dtype)
    width = VECTOR_BYTES // context.get_abi_sizeof(fty)
    i32 = ir.IntType(32)
    return (width, ir.VectorType(fty, width), i32, ir.VectorType(i32, width),
            context.get_value_type(types.intp), "32" if dtype == types.float32 else "64")


def _pointers(context, builder, signature, args, *which):
    """For codegen: the data pointers of the array arguments at positions `which`."""
    return [cgutils.create_struct_proxy(signature.args[i])(context, builder, args[i]).data
            for i in which]


def _casts(context, builder, signature, args, *which, to=types.intp):
    """For codegen: the scalar arguments at positions `which`, cast to `to`."""
    return [context.cast(builder, args[i], signature.args[i], to) for i in which]


def _splat32(builder, value, width):
    """For codegen: value (an index) in every lane of a vector of 32-bit integers; lane
    arithmetic in 32 bits does half the work of 64 (a copy or a row is shorter than 2**31)."""
    i32 = ir.IntType(32)
    i32v = ir.VectorType(i32, width)
    one = builder.insert_element(ir.Constant(i32v, ir.Undefined), builder.trunc(value, i32),
                                 ir.Constant(i32, 0))
    return builder.shuffle_vector(one, ir.Constant(i32v, ir.Undefined),
                                  ir.Constant(i32v, [0] * width))


def _lanes_below(builder, count, width):
    """For codegen: the mask of the vector lanes below count (an index)."""
    lanes_ = ir.Constant(ir.VectorType(ir.IntType(32), width), list(range(width)))
    return builder.icmp_signed("<", lanes_, _splat32(builder, count, width))


def _fma(builder, vty, width, bits):
    """For codegen: LLVM's fused multiply-add of vectors vty (width lanes of f<bits>)."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(vty, [vty] * 3),
                                          f"llvm.fma.v{width}f{bits}")


def _clamped_rows(builder, off, step, valid, count):
    """For codegen: the starts off + r*step of rows r < count (indices), rows past `valid`
    at the last valid one (read, never used)."""
    intp = off.type
    last = builder.sub(valid, ir.Constant(intp, 1))
    return [builder.add(off, builder.mul(builder.select(
        builder.icmp_signed("<", ir.Constant(intp, r), valid), ir.Constant(intp, r), last),
        step)) for r in range(count)]


def _along(builder, n, width, masked_load, step):
    """For codegen: step(c, load) for c = 0, width, 2*width, ... below n (an index), the
    vectors past n's last whole one read by a masked load (lanes past n read as 0.0)."""
    intp, i32 = n.type, ir.IntType(32)
    whole = builder.udiv(n, ir.Constant(intp, width))
    with cgutils.for_range(builder, whole) as loop:
        step(builder.mul(loop.index, ir.Constant(intp, width)),
             lambda p: builder.load(p, align=1))
    tail = builder.mul(whole, ir.Constant(intp, width))
    with builder.if_then(builder.icmp_signed("<", tail, n)):
        mask = _lanes_below(builder, builder.sub(n, tail), width)
        zero = ir.Constant(masked_load.function_type.return_type, None)
        step(tail, lambda p: builder.call(masked_load, [p, ir.Constant(i32, 1), mask, zero]))


@intrinsic(prefer_literal=True)   # constants arrive as such: a shape outside SHAPES
def tile(typingctx, T, KV, out, out_off, out_ts, t_valid, v_valid, accumulate, a, a_off, a_ts,
         a_gstep, a_step, b, b_off, b_gstep, b_step, nseg, nstep):
    dtype = _float_dtype(out, a, b)
    if dtype is None:
        return None
    sig = types.void(T, KV, out, out_off, out_ts, t_valid, v_valid, accumulate, a, a_off, a_ts,
                     a_gstep, a_step, b, b_off, b_gstep, b_step, nseg, nstep)
    return sig, _tile_codegen(dtype, fold=False)


@intrinsic
def folded_tile(typingctx, T, KV, out, out_off, out_ts, t_valid, v_valid, a, a_off, a_ts,
                a_gstep, a_step, b, b_off, b_gstep, b_step, nseg, nstep, s, s_off, s_ts,
                s_step, nfold):
    """tile (never accumulating) that, before it stores, adds nfold tiles of partial sums to
    its products, one after another: for i < nfold,
        acc[t][v] = s[s_off + i*s_step + t*s_ts + v*V : +V] + acc[t][v]
    (full tiles: s must be readable over all T rows and KV vectors of each). A sum of many
    small products then never stores the intermediate ones (outer_tree_sum's carries)."""
    dtype = _float_dtype(out, a, b, s)
    if dtype is None:
        return None
    sig = types.void(T, KV, out, out_off, out_ts, t_valid, v_valid, a, a_off, a_ts, a_gstep,
                     a_step, b, b_off, b_gstep, b_step, nseg, nstep, s, s_off, s_ts, s_step,
                     nfold)
    return sig, _tile_codegen(dtype, fold=True)


def _tile_codegen(dtype, fold):
    """The code of tile (fold False) or folded_tile, whose arguments are tile's without
    `accumulate`, then s, s_off, s_ts, s_step and nfold."""

    def codegen(context, builder, signature, args):
        if fold:  # the argument positions of tile's, with accumulate False
            args = list(args[:7]) + [ir.Constant(ir.IntType(1), 0)] + list(args[7:])
            signature = types.void(*signature.args[:7], types.boolean, *signature.args[7:])
        tys = signature.args
        width, vty, i32, i32v, intp, bits = _vectors(context, dtype)

        def index(i):
            if isinstance(tys[i], types.IntegerLiteral):
                return ir.Constant(intp, tys[i].literal_value)
            return _casts(context, builder, signature, args, i)[0]

        out_p, a_p, b_p = _pointers(context, builder, signature, args, 2, 8, 13)
        n_t, n_kv = index(0), index(1)
        out_off_, out_ts_, t_valid_, v_valid_ = index(3), index(4), index(5), index(6)
        accumulate_, = _casts(context, builder, signature, args, 7, to=types.boolean)
        a_off_, a_ts_, a_gstep_, a_step_ = index(9), index(10), index(11), index(12)
        b_off_, b_gstep_, b_step_ = index(14), index(15), index(16)
        nseg_, nstep_ = index(17), index(18)
        if fold:
            s_p, = _pointers(context, builder, signature, args, 19)
            s_off_, s_ts_, s_step_, nfold_ = index(20), index(21), index(22), index(23)
        fma = _fma(builder, vty, width, bits)
        masked_load, masked_store = _masked_memory(builder, vty, width, bits)

        def vector_at(base, offset):
            # Unaligned: operands start anywhere in their arrays.
            return builder.bitcast(builder.gep(base, [offset]), vty.as_pointer())

        def broadcast(scalar):
            one = builder.insert_element(ir.Constant(vty, ir.Undefined), scalar,
                                         ir.Constant(i32, 0))
            return builder.shuffle_vector(one, ir.Constant(vty, ir.Undefined),
                                          ir.Constant(i32v, [0] * width))

        def emit(n_t, n_v):
            """The loop for one tile shape, at the builder's position."""
            valid = _splat32(builder, v_valid_, width)
            masks = [builder.icmp_signed(
                "<", ir.Constant(i32v, [v * width + i for i in range(width)]), valid)
                for v in range(n_v)]
            zero = ir.Constant(vty, None)

            def target(t, v):
                o_t = builder.add(out_off_, builder.mul(ir.Constant(intp, t), out_ts_))
                return vector_at(out_p, builder.add(o_t, ir.Constant(intp, v * width)))

            # Allocas go to the entry block, where LLVM promotes them to registers.
            acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(n_v)]
                   for _ in range(n_t)]
            for t in range(n_t):
                for v in range(n_v):
                    builder.store(zero, acc[t][v])
            with builder.if_then(accumulate_):
                for t in range(n_t):
                    with builder.if_then(builder.icmp_signed("<", ir.Constant(intp, t),
                                                             t_valid_)):
                        for v in range(n_v):
                            builder.store(builder.call(masked_load, [
                                target(t, v), ir.Constant(i32, 1), masks[v], zero]), acc[t][v])
            a_t = [builder.mul(ir.Constant(intp, t), a_ts_) for t in range(n_t)]
            with cgutils.for_range(builder, nseg_) as seg:
                a_g = builder.add(a_off_, builder.mul(seg.index, a_gstep_))
                b_g = builder.add(b_off_, builder.mul(seg.index, b_gstep_))
                with cgutils.for_range(builder, nstep_) as step:
                    a_i = builder.add(a_g, builder.mul(step.index, a_step_))
                    b_i = builder.add(b_g, builder.mul(step.index, b_step_))
                    bv = []
                    for v in range(n_v):
                        at = builder.add(b_i, ir.Constant(intp, v * width))
                        bv.append(builder.load(vector_at(b_p, at), align=1))
                    for t in range(n_t):
                        s = broadcast(builder.load(builder.gep(a_p, [builder.add(a_i, a_t[t])])))
                        for v in range(n_v):
                            builder.store(builder.call(fma, [s, bv[v], builder.load(acc[t][v])]),
                                          acc[t][v])
            if fold:
                with cgutils.for_range(builder, nfold_) as level:
                    s_i = builder.add(s_off_, builder.mul(level.index, s_step_))
                    for t in range(n_t):
                        s_t = builder.add(s_i, builder.mul(ir.Constant(intp, t), s_ts_))
                        for v in range(n_v):
                            at = vector_at(s_p, builder.add(s_t, ir.Constant(intp, v * width)))
                            builder.store(builder.fadd(builder.load(at, align=1),
                                                       builder.load(acc[t][v])), acc[t][v])
            for t in range(n_t):
                with builder.if_then(builder.icmp_signed("<", ir.Constant(intp, t), t_valid_)):
                    for v in range(n_v):
                        builder.call(masked_store, [builder.load(acc[t][v]), target(t, v),
                                                    ir.Constant(i32, 1), masks[v]])

        if isinstance(tys[0], types.IntegerLiteral) and isinstance(tys[1], types.IntegerLiteral):
            # A shape given as constants: that one loop alone, which need not be in SHAPES.
            emit(tys[0].literal_value, tys[1].literal_value)
            return context.get_dummy_value()
        # One case per shape, on T * 8 + KV; an unknown shape does nothing (`choose` never
        # returns one).
        key = builder.add(builder.mul(n_t, ir.Constant(intp, 8)), n_kv)
        done = builder.append_basic_block("tile.done")
        switch = builder.switch(key, done)
        for shape_t, shape_kv in SHAPES:
            case = builder.append_basic_block(f"tile.{shape_t}x{shape_kv}")
            switch.add_case(ir.Constant(intp, shape_t * 8 + shape_kv), case)
            builder.position_at_end(case)
            emit(shape_t, shape_kv)
            builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return codegen


# dot_tile's register tile: DOT_M rows of a by DOT_K of w, one accumulator vector for each of
# the 24 pairs, with the DOT_M operand vectors and one of w: 29 of AVX-512's 32 registers.
DOT_M, DOT_K = 4, 6


@intrinsic
def dot_tile(typingctx, out, out_off, out_ms, m_valid, k_valid, a, a_off, a_ms, w, w_off, w_ks,
             n):
    """The dot products of DOT_M rows of a with DOT_K rows of w, each row n elements long:
        out[out_off + i*out_ms + j] = <a[a_off + i*a_ms : +n], w[w_off + j*w_ks : +n]>
    stored for i < m_valid and j < k_valid; rows past those repeat the last valid row (read,
    never stored). Each dot product is the same V chains of fused multiply-adds, from 0, one
    per lane l over the elements c = l, l + V, l + 2V, ... in order (masked loads past n), then
    summed across lanes in a fixed tree (lanes l and l + V/2 first): its bits depend on the
    two rows alone, never on the tile around it."""
    dtype = _float_dtype(out, a, w)
    if dtype is None:
        return None
    sig = types.void(out, out_off, out_ms, m_valid, k_valid, a, a_off, a_ms, w, w_off, w_ks, n)

    def codegen(context, builder, signature, args):
        width, vty, i32, i32v, intp, bits = _vectors(context, dtype)
        masked_load, _ = _masked_memory(builder, vty, width, bits)
        out_p, a_p, w_p = _pointers(context, builder, signature, args, 0, 5, 8)
        out_off_, out_ms_, m_valid_, k_valid_, a_off_, a_ms_, w_off_, w_ks_, n_ = _casts(
            context, builder, signature, args, 1, 2, 3, 4, 6, 7, 9, 10, 11)
        fma = _fma(builder, vty, width, bits)
        zero = ir.Constant(vty, None)

        a_rows = _clamped_rows(builder, a_off_, a_ms_, m_valid_, DOT_M)
        w_rows = _clamped_rows(builder, w_off_, w_ks_, k_valid_, DOT_K)
        acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(DOT_K)]
               for _ in range(DOT_M)]
        for i in range(DOT_M):
            for j in range(DOT_K):
                builder.store(zero, acc[i][j])

        def at(base, row, c):
            return builder.bitcast(builder.gep(base, [builder.add(row, c)]), vty.as_pointer())

        def step(c, load):
            av = [load(at(a_p, a_rows[i], c)) for i in range(DOT_M)]
            for j in range(DOT_K):
                wv = load(at(w_p, w_rows[j], c))
                for i in range(DOT_M):
                    builder.store(builder.call(fma, [av[i], wv, builder.load(acc[i][j])]),
                                  acc[i][j])

        _along(builder, n_, width, masked_load, step)

        def lane_sum(v):
            half = width // 2
            while half >= 1:
                low = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, half),
                                                               list(range(half))))
                high = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, half),
                                                                list(range(half, 2 * half))))
                v = builder.fadd(low, high)
                half //= 2
            return builder.extract_element(v, ir.Constant(i32, 0))

        for i in range(DOT_M):
            with builder.if_then(builder.icmp_signed("<", ir.Constant(intp, i), m_valid_)):
                o_i = builder.add(out_off_, builder.mul(ir.Constant(intp, i), out_ms_))
                for j in range(DOT_K):
                    with builder.if_then(builder.icmp_signed("<", ir.Constant(intp, j),
                                                             k_valid_)):
                        builder.store(lane_sum(builder.load(acc[i][j])),
                                      builder.gep(out_p, [builder.add(o_i, ir.Constant(intp, j))]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def shifted_copy(typingctx, out, out_off, src, src_off, period, lo, hi, n):
    """out[out_off + i] = src[src_off + i] where lo <= i % period < hi, else 0, for i < n: rows
    of `period` elements copied with zero fill at both ends of every row (one row: period >= n),
    in vectors with masked loads (src is read only where the copy takes it) and stores."""
    dtype = _float_dtype(out, src)
    if dtype is None:
        return None
    sig = types.void(out, out_off, src, src_off, period, lo, hi, n)

    def codegen(context, builder, signature, args):
        width, vty, i32, i32v, intp, bits = _vectors(context, dtype)
        masked_load, masked_store = _masked_memory(builder, vty, width, bits)
        out_p, src_p = _pointers(context, builder, signature, args, 0, 2)
        out_off_, src_off_, period_, lo_, hi_, n_ = _casts(context, builder, signature, args,
                                                           1, 3, 4, 5, 6, 7)

        def splat(value):
            return _splat32(builder, value, width)

        def wrap(col):
            # col < 2 * period -> col % period
            return builder.select(builder.icmp_signed(">=", col, period_v),
                                  builder.sub(col, period_v), col)

        lane = ir.Constant(i32v, list(range(width)))
        lo_v, hi_v, period_v = splat(lo_), splat(hi_), splat(period_)
        # Each lane's i % period, kept from vector to vector by adding width % period and
        # wrapping once: no division per vector. The first vector takes (width - 1) // period
        # wraps. One row (period >= n) needs no division at all: it wraps past n only.
        step = cgutils.alloca_once_value(builder, ir.Constant(intp, width))
        wraps = cgutils.alloca_once_value(builder, ir.Constant(intp, 0))
        with builder.if_then(builder.icmp_signed("<", period_, n_)):
            builder.store(builder.srem(ir.Constant(intp, width), period_), step)
            builder.store(builder.sdiv(ir.Constant(intp, width - 1), period_), wraps)
        step_v = splat(builder.load(step))
        col = cgutils.alloca_once_value(builder, lane)
        with cgutils.for_range(builder, builder.load(wraps)):
            builder.store(wrap(builder.load(col)), col)
        count = builder.udiv(builder.add(n_, ir.Constant(intp, width - 1)),
                             ir.Constant(intp, width))
        with cgutils.for_range(builder, count) as loop:
            i0 = builder.mul(loop.index, ir.Constant(intp, width))
            before_n = _lanes_below(builder, builder.sub(n_, i0), width)
            col_v = builder.load(col)
            builder.store(wrap(builder.add(col_v, step_v)), col)
            inside = builder.and_(builder.and_(builder.icmp_signed(">=", col_v, lo_v),
                                               builder.icmp_signed("<", col_v, hi_v)),
                                  before_n)
            src_at = builder.bitcast(builder.gep(src_p, [builder.add(src_off_, i0)]),
                                     vty.as_pointer())
            value = builder.call(masked_load, [src_at, ir.Constant(i32, 1), inside,
                                               ir.Constant(vty, None)])
            out_at = builder.bitcast(builder.gep(out_p, [builder.add(out_off_, i0)]),
                                     vty.as_pointer())
            builder.call(masked_store, [value, out_at, ir.Constant(i32, 1), before_n])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def transpose_block(typingctx, dst, dst_off, dst_ld, src, src_off, src_ld, rows, cols, sums,
                    sums_off, add):
    """dst[dst_off + j*dst_ld + i] = src[src_off + i*src_ld + j] for i < rows, j < cols, both
    at most V (a lane count): one V x V block through vector registers (log2(V) rounds of
    interleaving rows i and i + V/2), with masked loads and stores at the edges. With `add`,
    also sums[sums_off + i] += src[src_off + i*src_ld + j] for j = 0, 1, ... in that order."""
    dtype = _float_dtype(dst, src, sums)
    if dtype is None:
        return None
    sig = types.void(dst, dst_off, dst_ld, src, src_off, src_ld, rows, cols, sums, sums_off, add)

    def codegen(context, builder, signature, args):
        width, vty, i32, i32v, intp, bits = _vectors(context, dtype)
        masked_load, masked_store = _masked_memory(builder, vty, width, bits)
        dst_p, src_p, sums_p = _pointers(context, builder, signature, args, 0, 3, 8)
        dst_off_, dst_ld_, src_off_, src_ld_, rows_, cols_, sums_off_ = _casts(
            context, builder, signature, args, 1, 2, 4, 5, 6, 7, 9)
        add_, = _casts(context, builder, signature, args, 10, to=types.boolean)

        zero = ir.Constant(vty, None)
        load_mask = _lanes_below(builder, cols_, width)
        store_mask = _lanes_below(builder, rows_, width)
        rows_v = []
        for i in range(width):
            slot = cgutils.alloca_once_value(builder, zero)
            with builder.if_then(builder.icmp_signed("<", ir.Constant(intp, i), rows_)):
                at = builder.add(src_off_, builder.mul(ir.Constant(intp, i), src_ld_))
                ptr = builder.bitcast(builder.gep(src_p, [at]), vty.as_pointer())
                builder.store(builder.call(masked_load, [ptr, ir.Constant(i32, 1), load_mask,
                                                         zero]), slot)
            rows_v.append(builder.load(slot))
        half = width // 2
        low = ir.Constant(i32v, [k // 2 + (width if k % 2 else 0) for k in range(width)])
        high = ir.Constant(i32v, [half + k // 2 + (width if k % 2 else 0) for k in range(width)])
        for _ in range(width.bit_length() - 1):
            new = []
            for i in range(half):
                new.append(builder.shuffle_vector(rows_v[i], rows_v[i + half], low))
                new.append(builder.shuffle_vector(rows_v[i], rows_v[i + half], high))
            rows_v = new
        for j in range(width):
            with builder.if_then(builder.icmp_signed("<", ir.Constant(intp, j), cols_)):
                at = builder.add(dst_off_, builder.mul(ir.Constant(intp, j), dst_ld_))
                ptr = builder.bitcast(builder.gep(dst_p, [at]), vty.as_pointer())
                builder.call(masked_store, [rows_v[j], ptr, ir.Constant(i32, 1), store_mask])
        with builder.if_then(add_):
            ptr = builder.bitcast(builder.gep(sums_p, [sums_off_]), vty.as_pointer())
            total = cgutils.alloca_once_value(builder, zero)
            builder.store(builder.call(masked_load, [ptr, ir.Constant(i32, 1), store_mask, zero]),
                          total)
            for j in range(width):
                with builder.if_then(builder.icmp_signed("<", ir.Constant(intp, j), cols_)):
                    builder.store(builder.fadd(builder.load(total), rows_v[j]), total)
            builder.call(masked_store, [builder.load(total), ptr, ir.Constant(i32, 1), store_mask])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def column_max(typingctx, y, a, out, rmax, rarg, first, Q, R):
    """For q < Q: y[out + q] = the first max of rmax[first + i*Q + q] over i < R (a later row
    must be strictly greater; NaN never is) and a[out + q] = rarg at the same row, in vectors
    with a masked tail: the second pass of max pooling, one output row at a time. y and rmax
    are of one float dtype, a and rarg int32."""
    dtype = _float_dtype(y, rmax)
    if dtype is None or not all(isinstance(x, types.Array) and x.dtype == types.int32
                                for x in (a, rarg)):
        return None
    sig = types.void(y, a, out, rmax, rarg, first, Q, R)

    def codegen(context, builder, signature, args):
        width, vty, i32, i32v, intp, bits = _vectors(context, dtype)
        load_f, store_f = _masked_memory(builder, vty, width, bits)
        load_i, store_i = _masked_memory(builder, i32v, width, "32", "i")
        y_p, a_p, rmax_p, rarg_p = _pointers(context, builder, signature, args, 0, 1, 3, 4)
        out_, first_, q_, r_ = _casts(context, builder, signature, args, 2, 5, 6, 7)
        one = ir.Constant(i32, 1)

        def at(p, vt, off):
            return builder.bitcast(builder.gep(p, [off]), vt.as_pointer())

        count = builder.udiv(builder.add(q_, ir.Constant(intp, width - 1)),
                             ir.Constant(intp, width))
        with cgutils.for_range(builder, count) as loop:
            v0 = builder.mul(loop.index, ir.Constant(intp, width))
            mask = _lanes_below(builder, builder.sub(q_, v0), width)
            row0 = builder.add(first_, v0)
            best = cgutils.alloca_once_value(builder, builder.call(
                load_f, [at(rmax_p, vty, row0), one, mask, ir.Constant(vty, None)]))
            where = cgutils.alloca_once_value(builder, builder.call(
                load_i, [at(rarg_p, i32v, row0), one, mask, ir.Constant(i32v, None)]))
            with cgutils.for_range(builder, builder.sub(r_, ir.Constant(intp, 1))) as row:
                off = builder.add(row0, builder.mul(builder.add(row.index,
                                                                ir.Constant(intp, 1)), q_))
                v = builder.call(load_f, [at(rmax_p, vty, off), one, mask,
                                          ir.Constant(vty, None)])
                greater = builder.fcmp_ordered(">", v, builder.load(best))
                builder.store(builder.select(greater, v, builder.load(best)), best)
                w = builder.call(load_i, [at(rarg_p, i32v, off), one, mask,
                                          ir.Constant(i32v, None)])
                builder.store(builder.select(greater, w, builder.load(where)), where)
            target = builder.add(out_, v0)
            builder.call(store_f, [builder.load(best), at(y_p, vty, target), one, mask])
            builder.call(store_i, [builder.load(where), at(a_p, i32v, target), one, mask])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def stride2_row_max(typingctx, x, row, W, w_first, Q, S, rmax, rarg, out, arg_base, lowest,
                    rows, R, row_step):
    """For each of `rows` output rows h, whose windows cover the R image rows of W cells at
    x[row + h*row_step + i*W] (i < R), and q < Q: rmax[out + h*Q + q] = the first max, in
    row-major order, over i < R and j < S of the cells w = w_first + 2q + j that lie in
    [0, W) (a later cell must be strictly greater than the max so far, which starts at
    `lowest`; NaN never is), and rarg[out + h*Q + q] = arg_base + h*row_step + i*W + w at that
    cell, or at the window's first cell where none beats `lowest`. With R = 1 and
    row_step = W: the row pass of max pooling with stride 2, the windows clipped by the
    row's edges; with R = 2, S = 2 and row_step = 2W: the whole of 2 x 2 pooling with stride
    2 (its windows do not overlap, so a second pass would save no work). Each vector of V
    outputs reads two vectors of cells per window cell column j, masked to the row, and takes
    the even ones with one shuffle: strided reads without a loop per window. x and rmax are
    of one float dtype, rarg int32."""
    dtype = _float_dtype(x, rmax)
    if dtype is None or not (isinstance(rarg, types.Array) and rarg.dtype == types.int32):
        return None
    sig = types.void(x, row, W, w_first, Q, S, rmax, rarg, out, arg_base, lowest, rows, R,
                     row_step)

    def codegen(context, builder, signature, args):
        width, vty, i32, i32v, intp, bits = _vectors(context, dtype)
        load_f, store_f = _masked_memory(builder, vty, width, bits)
        _, store_i = _masked_memory(builder, i32v, width, "32", "i")
        x_p, rmax_p, rarg_p = _pointers(context, builder, signature, args, 0, 6, 7)
        row0_, w_, w_first_, q_, s_, out0_, arg0_, rows_, r_, step_ = _casts(
            context, builder, signature, args, 1, 2, 3, 4, 5, 8, 9, 11, 12, 13)
        low = context.cast(builder, args[10], signature.args[10], dtype)
        low_v = builder.shuffle_vector(
            builder.insert_element(ir.Constant(vty, ir.Undefined), low, ir.Constant(i32, 0)),
            ir.Constant(vty, ir.Undefined), ir.Constant(i32v, [0] * width))
        lane = ir.Constant(i32v, list(range(width)))
        evens = ir.Constant(i32v, [2 * i for i in range(width)])
        one = ir.Constant(i32, 1)
        zero_v = ir.Constant(i32v, None)

        def at(p, vt, off):
            return builder.bitcast(builder.gep(p, [off]), vt.as_pointer())

        def cells(row, c0):
            """The cells c0 + i for i < V of the row at x[row], `lowest` outside [0, W)."""
            c = _splat32(builder, c0, width)
            w = builder.add(c, lane)
            inside = builder.and_(builder.icmp_signed(">=", w, zero_v),
                                  builder.icmp_signed("<", w, _splat32(builder, w_, width)))
            return builder.call(load_f, [at(x_p, vty, builder.add(row, c0)), one, inside,
                                         low_v])

        with cgutils.for_range(builder, rows_) as h:
            top_ = builder.add(row0_, builder.mul(h.index, step_))
            out_ = builder.add(out0_, builder.mul(h.index, q_))
            arg_base_ = builder.add(arg0_, builder.mul(h.index, step_))
            count = builder.udiv(builder.add(q_, ir.Constant(intp, width - 1)),
                                 ir.Constant(intp, width))
            with cgutils.for_range(builder, count) as loop:
                q0 = builder.mul(loop.index, ir.Constant(intp, width))
                first = builder.add(w_first_, builder.add(q0, q0))   # window q0's first cell
                # Each lane's window starts at first + 2i; clipped at 0, that is its first cell.
                start = builder.add(_splat32(builder, first, width), evens)
                best = cgutils.alloca_once_value(builder, low_v)
                where = cgutils.alloca_once_value(builder, builder.select(
                    builder.icmp_signed("<", start, zero_v), zero_v, start))
                with cgutils.for_range(builder, r_) as i:
                    row_ = builder.add(top_, builder.mul(i.index, w_))
                    down = _splat32(builder, builder.mul(i.index, w_), width)
                    with cgutils.for_range(builder, s_) as j:
                        c0 = builder.add(first, j.index)
                        pair = builder.shuffle_vector(cells(row_, c0), cells(row_, builder.add(
                            c0, ir.Constant(intp, width))), evens)
                        greater = builder.fcmp_ordered(">", pair, builder.load(best))
                        builder.store(builder.select(greater, pair, builder.load(best)), best)
                        w = builder.add(builder.add(start, _splat32(builder, j.index, width)),
                                        down)
                        builder.store(builder.select(greater, w, builder.load(where)), where)
                mask = _lanes_below(builder, builder.sub(q_, q0), width)
                target = builder.add(out_, q0)
                builder.call(store_f, [builder.load(best), at(rmax_p, vty, target), one, mask])
                arg = builder.add(builder.load(where), _splat32(builder, arg_base_, width))
                builder.call(store_i, [arg, at(rarg_p, i32v, target), one, mask])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic(prefer_literal=True)
def lane_tile(typingctx, M, N, out, out_off, out_ms, out_ns, a, a_off, a_ms, m_valid, b, b_off,
              b_ns, n_valid, n):
    """Partial dot products of M rows of a with N rows of b (M, N constants), each row n
    elements long, kept in V lanes: for i < M, j < N,
        out[out_off + i*out_ms + j*out_ns : +V] += lane l: a[a_off + i*a_ms + c]
                                                   * b[b_off + j*b_ns + c], c = l, l + V, ...
    one chain of fused multiply-adds per lane, continuing from out's value, c in order
    (masked loads past n add nothing). Rows past m_valid (n_valid) repeat the last valid row
    and are read, never used; all M*N vectors of out are stored. Summing a lane vector is the
    caller's (in a fixed tree): a reduction over many calls keeps its V chains per output
    until the end. The M + N operand vectors and M*N accumulators should fit the 32
    registers."""
    dtype = _float_dtype(out, a, b)
    if (dtype is None or not isinstance(M, types.IntegerLiteral)
            or not isinstance(N, types.IntegerLiteral)):
        return None
    sig = types.void(M, N, out, out_off, out_ms, out_ns, a, a_off, a_ms, m_valid, b, b_off, b_ns,
                     n_valid, n)

    def codegen(context, builder, signature, args):
        width, vty, i32, i32v, intp, bits = _vectors(context, dtype)
        masked_load, _ = _masked_memory(builder, vty, width, bits)
        out_p, a_p, b_p = _pointers(context, builder, signature, args, 2, 6, 10)
        out_off_, out_ms_, out_ns_, a_off_, a_ms_, m_valid_, b_off_, b_ns_, n_valid_, n_ = \
            _casts(context, builder, signature, args, 3, 4, 5, 7, 8, 9, 11, 12, 13, 14)
        n_m, n_n = M.literal_value, N.literal_value
        fma = _fma(builder, vty, width, bits)
        zero = ir.Constant(vty, None)

        def at(base, offset):
            return builder.bitcast(builder.gep(base, [offset]), vty.as_pointer())

        a_rows = _clamped_rows(builder, a_off_, a_ms_, m_valid_, n_m)
        b_rows = _clamped_rows(builder, b_off_, b_ns_, n_valid_, n_n)
        targets = [[at(out_p, builder.add(out_off_, builder.add(
            builder.mul(ir.Constant(intp, i), out_ms_), builder.mul(ir.Constant(intp, j),
                                                                    out_ns_))))
            for j in range(n_n)] for i in range(n_m)]
        acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(n_n)]
               for _ in range(n_m)]
        for i in range(n_m):
            for j in range(n_n):
                builder.store(builder.load(targets[i][j], align=1), acc[i][j])

        def step(c, load):
            av = [load(at(a_p, builder.add(a_rows[i], c))) for i in range(n_m)]
            for j in range(n_n):
                bv = load(at(b_p, builder.add(b_rows[j], c)))
                for i in range(n_m):
                    builder.store(builder.call(fma, [av[i], bv, builder.load(acc[i][j])]),
                                  acc[i][j])

        _along(builder, n_, width, masked_load, step)
        for i in range(n_m):
            for j in range(n_n):
                builder.store(builder.load(acc[i][j]), targets[i][j], align=1)
        return context.get_dummy_value()

    return sig, codegen


# Rows that shifted_row_sum adds at a time: independent chains that hide the adds' latency.
ROW_SUM_ROWS = 8


@intrinsic
def shifted_row_sum(typingctx, out, out_off, W, src, src_off, src_step, S, dil, pad, Q, rows):
    """For each of `rows` rows i, w < W, and s = 0, 1, ..., S - 1 in that order:
    out[out_off + i*W + w] += src[src_off + s*src_step + i*Q + q] where q = w - (s*dil - pad)
    lies in [0, Q); one rounding per add, as a loop over s, then w, would give: rows of the
    input gradient gathered from the rows of a column matrix (tap s shifts its row by
    s*dil - pad). ROW_SUM_ROWS rows at a time, in vectors along the row. out and src are of
    one float dtype."""
    dtype = _float_dtype(out, src)
    if dtype is None:
        return None
    sig = types.void(out, out_off, W, src, src_off, src_step, S, dil, pad, Q, rows)

    def codegen(context, builder, signature, args):
        width, vty, i32, i32v, intp, bits = _vectors(context, dtype)
        load_f, store_f = _masked_memory(builder, vty, width, bits)
        out_p, src_p = _pointers(context, builder, signature, args, 0, 3)
        out_off_, w_, src_off_, step_, s_, dil_, pad_, q_, rows_ = _casts(
            context, builder, signature, args, 1, 2, 4, 5, 6, 7, 8, 9, 10)
        lane = ir.Constant(i32v, list(range(width)))
        one = ir.Constant(i32, 1)
        zero_f = ir.Constant(vty, None)
        zero_i = ir.Constant(i32v, None)
        n = ROW_SUM_ROWS

        def at(p, off):
            return builder.bitcast(builder.gep(p, [off]), vty.as_pointer())

        groups = builder.udiv(builder.add(rows_, ir.Constant(intp, n - 1)), ir.Constant(intp, n))
        count = builder.udiv(builder.add(w_, ir.Constant(intp, width - 1)),
                             ir.Constant(intp, width))
        with cgutils.for_range(builder, groups) as group:
            i0 = builder.mul(group.index, ir.Constant(intp, n))
            with cgutils.for_range(builder, count) as loop:
                w0 = builder.mul(loop.index, ir.Constant(intp, width))
                cols = builder.add(_splat32(builder, w0, width), lane)
                in_row = _lanes_below(builder, builder.sub(w_, w0), width)
                # Rows past `rows` take no lanes.
                masks, targets, acc = [], [], []
                for k in range(n):
                    i = builder.add(i0, ir.Constant(intp, k))
                    live = builder.icmp_signed("<", i, rows_)
                    masks.append(builder.and_(in_row, builder.select(
                        live, ir.Constant(ir.VectorType(ir.IntType(1), width), [1] * width),
                        ir.Constant(ir.VectorType(ir.IntType(1), width), [0] * width))))
                    targets.append(at(out_p, builder.add(out_off_, builder.add(
                        builder.mul(i, w_), w0))))
                    acc.append(cgutils.alloca_once_value(builder, builder.call(
                        load_f, [targets[k], one, masks[k], zero_f])))
                with cgutils.for_range(builder, s_) as s:
                    shift = builder.sub(builder.mul(s.index, dil_), pad_)
                    q = builder.sub(cols, _splat32(builder, shift, width))
                    valid = builder.and_(builder.icmp_signed(">=", q, zero_i),
                                         builder.icmp_signed("<", q, _splat32(builder, q_,
                                                                              width)))
                    # src's element for lane 0 (q = w0 - shift), which may lie outside the
                    # row: only the valid lanes are read.
                    first = builder.add(builder.add(src_off_, builder.mul(s.index, step_)),
                                        builder.sub(w0, shift))
                    for k in range(n):
                        take = builder.and_(valid, masks[k])
                        row = builder.add(first, builder.mul(builder.add(
                            i0, ir.Constant(intp, k)), q_))
                        v = builder.call(load_f, [at(src_p, row), one, take, zero_f])
                        old = builder.load(acc[k])
                        builder.store(builder.select(take, builder.fadd(old, v), old), acc[k])
                for k in range(n):
                    builder.call(store_f, [builder.load(acc[k]), targets[k], one, masks[k]])
        return context.get_dummy_value()

    return sig, codegen


# -- sums in 8 float64 lanes --------------------------------------------------------------
# What lane_sums adds up of rows a and b (and a value m): their elements, their products, or
# the squares of the elements' differences from m (kernels/batchnorm.py's plain_sum,
# product_sum, centred_square_sum).
SUM_PLAIN, SUM_PRODUCT, SUM_CENTRED_SQUARE = 0, 1, 2
SUM_LANES = 8


def _lane_sums_codegen(dtype, kinds):
    """Codegen of a pass over rows a and b (1-d, contiguous) adding each kind of term in
    `kinds` into 8 float64 lanes (element j into lane j % 8, in order), then each set of
    lanes in the tree ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). Terms in the rows'
    dtype before they are widened: a, a * b, or a - m (squared in float64). Lanes past a
    row's end add +0.0, which leaves a sum that started from +0.0 as it is."""
    def codegen(context, builder, signature, args):
        f64 = ir.DoubleType()
        fty = context.get_value_type(dtype)
        in_ty, acc_ty = ir.VectorType(fty, SUM_LANES), ir.VectorType(f64, SUM_LANES)
        bits = "32" if dtype == types.float32 else "64"
        masked_load, _ = _masked_memory(builder, in_ty, SUM_LANES, bits)
        a_arr = cgutils.create_struct_proxy(signature.args[0])(context, builder, args[0])
        b_arr = cgutils.create_struct_proxy(signature.args[1])(context, builder, args[1])
        intp = context.get_value_type(types.intp)
        n = a_arr.nitems
        m = context.cast(builder, args[2], signature.args[2], dtype)
        i32 = ir.IntType(32)
        m_v = builder.shuffle_vector(
            builder.insert_element(ir.Constant(in_ty, ir.Undefined), m, ir.Constant(i32, 0)),
            ir.Constant(in_ty, ir.Undefined),
            ir.Constant(ir.VectorType(i32, SUM_LANES), [0] * SUM_LANES))
        zero_in, zero_acc = ir.Constant(in_ty, None), ir.Constant(acc_ty, None)
        accs = [cgutils.alloca_once_value(builder, zero_acc) for _ in kinds]
        count = builder.udiv(builder.add(n, ir.Constant(intp, SUM_LANES - 1)),
                             ir.Constant(intp, SUM_LANES))
        align = ir.Constant(ir.IntType(32), 1)
        with cgutils.for_range(builder, count) as loop:
            i0 = builder.mul(loop.index, ir.Constant(intp, SUM_LANES))
            mask = _lanes_below(builder, builder.sub(n, i0), SUM_LANES)
            a_v = builder.call(masked_load, [builder.bitcast(builder.gep(a_arr.data, [i0]),
                                                             in_ty.as_pointer()),
                                             align, mask, zero_in])
            b_v = builder.call(masked_load, [builder.bitcast(builder.gep(b_arr.data, [i0]),
                                                             in_ty.as_pointer()),
                                             align, mask, zero_in]) \
                if SUM_PRODUCT in kinds else None
            for kind, acc in zip(kinds, accs):
                if kind == SUM_PLAIN:
                    term = a_v
                elif kind == SUM_PRODUCT:
                    term = builder.fmul(a_v, b_v)
                else:
                    term = builder.fsub(a_v, m_v)
                if dtype == types.float32:
                    term = builder.fpext(term, acc_ty)
                if kind == SUM_CENTRED_SQUARE:
                    term = builder.select(mask, builder.fmul(term, term), zero_acc)
                builder.store(builder.fadd(builder.load(acc), term), acc)
        totals = []
        for acc in accs:
            v = builder.load(acc)
            lane = [builder.extract_element(v, ir.Constant(ir.IntType(32), i))
                    for i in range(SUM_LANES)]
            totals.append(builder.fadd(
                builder.fadd(builder.fadd(lane[0], lane[1]), builder.fadd(lane[2], lane[3])),
                builder.fadd(builder.fadd(lane[4], lane[5]), builder.fadd(lane[6], lane[7]))))
        if len(totals) == 1:
            return totals[0]
        return context.make_tuple(builder, signature.return_type, totals)
    return codegen


def _rows_dtype(a, b):
    """For typing: the float dtype of two 1-d contiguous rows, or None."""
    dtype = _float_dtype(a, b)
    if dtype is None or a.ndim != 1 or b.ndim != 1 or a.layout != "C" or b.layout != "C":
        return None
    return dtype


@intrinsic(prefer_literal=True)
def lane_sums(typingctx, a, b, m, kind):
    """The float64 sum over rows a, b (1-d, contiguous, one float dtype; b read for
    SUM_PRODUCT only) of the terms `kind` (a constant: SUM_PLAIN, SUM_PRODUCT,
    SUM_CENTRED_SQUARE; m, a scalar, for the last), in SUM_LANES interleaved float64 partial
    sums, one vector (see _lane_sums_codegen)."""
    dtype = _rows_dtype(a, b)
    if dtype is None or not isinstance(kind, types.IntegerLiteral):
        return None
    sig = types.float64(a, b, types.unliteral(m), kind)
    return sig, _lane_sums_codegen(dtype, [kind.literal_value])


@intrinsic
def product_and_plain_lane_sums(typingctx, a, b):
    """(lane_sums(a, b, 0, SUM_PRODUCT), lane_sums(a, b, 0, SUM_PLAIN)) in one pass, the
    same bits: two vectors of lanes, which the CPU adds side by side."""
    dtype = _rows_dtype(a, b)
    if dtype is None:
        return None
    sig = types.UniTuple(types.float64, 2)(a, b)

    def codegen(context, builder, signature, args):
        # m is unused by these kinds: a zero of the rows' dtype stands in.
        zero = context.get_constant(dtype, 0)
        inner = _lane_sums_codegen(dtype, [SUM_PRODUCT, SUM_PLAIN])
        return inner(context, builder, types.UniTuple(types.float64, 2)(a, b, dtype),
                     [args[0], args[1], zero])
    return sig, codegen
