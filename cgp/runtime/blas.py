"""Direct BLAS matrix products for Numba kernels: `gemm` computes c = alpha * a @ b + beta * c
in place, through the sgemm/dgemm that SciPy ships. No other BLAS routine, no threading here.

Numba's np.dot(a, b, out) always overwrites `out` and copies any operand that is not contiguous;
`gemm` accumulates into c (beta=1: no temporary, no extra pass) and takes transposed views
(`x.T`) as they are, as BLAS's own transpose flags. It is called from @njit code only.

Row-major arrays are column-major arrays transposed, so c = a @ b runs as BLAS's c^T = b^T a^T.
Every operand must be a 2-d view with unit stride along one of its axes (C-ordered rows or
F-ordered columns, e.g. a slice of rows of a contiguous matrix, or its .T); `gemm` raises
ValueError otherwise, and on mismatched shapes. Float32 and float64, all operands of one dtype.

The BLAS entry points are found by name when this module is imported (SciPy's cython_blas,
registered as LLVM symbols "cgp_sgemm"/"cgp_dgemm"), so kernels cached on disk (cache=True)
link to the library of the running process, never to an address from the process that
compiled them. Importing it also loads SciPy's BLAS before the trainer pins BLAS to one thread
(threadpoolctl limits only libraries already loaded).
"""
import llvmlite.binding as llvm
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import get_cython_function_address, intrinsic

llvm.add_symbol("cgp_sgemm", get_cython_function_address("scipy.linalg.cython_blas", "sgemm"))
llvm.add_symbol("cgp_dgemm", get_cython_function_address("scipy.linalg.cython_blas", "dgemm"))


@intrinsic
def _xgemm(typingctx, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """Fortran ?gemm on the data pointers of arrays a, b, c (column-major view): trans_* are
    booleans, sizes and leading dimensions integers (BLAS's 32-bit int), alpha and beta
    scalars of the arrays' dtype."""
    dtype = c.dtype
    if not (isinstance(a, types.Array) and a.dtype == dtype and b.dtype == dtype
            and dtype in (types.float32, types.float64)):
        return None
    name = "cgp_sgemm" if dtype == types.float32 else "cgp_dgemm"
    sig = types.void(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)

    def codegen(context, builder, signature, args):
        (ta, tb, m_, n_, k_, al, a_, lda_, b_, ldb_, be, c_, ldc_) = args
        tys = signature.args
        fty = context.get_value_type(dtype)
        i8, i32 = ir.IntType(8), ir.IntType(32)
        # (transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc): 13 pointers.
        fnty = ir.FunctionType(ir.VoidType(), [
            i8.as_pointer(), i8.as_pointer(), i32.as_pointer(), i32.as_pointer(),
            i32.as_pointer(), fty.as_pointer(), fty.as_pointer(), i32.as_pointer(),
            fty.as_pointer(), i32.as_pointer(), fty.as_pointer(), fty.as_pointer(),
            i32.as_pointer()])
        fn = cgutils.get_or_insert_function(builder.module, fnty, name)

        def flag(value):
            # 'T' (84) when true, 'N' (78) otherwise.
            return builder.select(value, ir.Constant(i8, ord("T")), ir.Constant(i8, ord("N")))

        def int32(value, ty):
            return context.cast(builder, value, ty, types.int32)

        def data(value, ty):
            return builder.bitcast(cgutils.create_struct_proxy(ty)(context, builder, value).data,
                                   fty.as_pointer())

        def slot(value):
            return cgutils.alloca_once_value(builder, value)

        ta_v = flag(context.cast(builder, ta, tys[0], types.boolean))
        tb_v = flag(context.cast(builder, tb, tys[1], types.boolean))
        builder.call(fn, [
            slot(ta_v), slot(tb_v),
            slot(int32(m_, tys[2])), slot(int32(n_, tys[3])), slot(int32(k_, tys[4])),
            slot(context.cast(builder, al, tys[5], dtype)), data(a_, tys[6]),
            slot(int32(lda_, tys[7])), data(b_, tys[8]), slot(int32(ldb_, tys[9])),
            slot(context.cast(builder, be, tys[10], dtype)), data(c_, tys[11]),
            slot(int32(ldc_, tys[12]))])
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def _layout(x):
    """How BLAS sees the 2-d view x (rows, cols): (column_major, ld) with column_major False
    for unit stride along the rows (C order) and ld the leading dimension in elements; a
    view with no unit stride raises. Axes of length 1 have no meaningful stride, so they
    count as unit-strided."""
    rows, cols = x.shape
    item = x.itemsize
    row_step = x.strides[0] // item
    col_step = x.strides[1] // item
    if cols <= 1 or col_step == 1:
        ld = row_step if rows > 1 else cols
        if ld >= cols and (rows <= 1 or x.strides[0] % item == 0):
            return False, max(ld, 1)
    if rows <= 1 or row_step == 1:
        ld = col_step if cols > 1 else rows
        if ld >= rows and (cols <= 1 or x.strides[1] % item == 0):
            return True, max(ld, 1)
    raise ValueError("gemm: an operand has no unit stride along either axis")


@njit(cache=True, nogil=True)
def gemm(alpha, a, b, beta, c):
    """a: (M, L); b: (L, N'); c: (M, N'), all of one float dtype, each with unit stride along
    one axis (a C-ordered view, or the .T of one). c = alpha * a @ b + beta * c in place.
    With beta == 0, c's old content is ignored (NaN included); with beta == 1 the product is
    added to it. Single BLAS call: its summation order depends only on the shapes."""
    M, L = a.shape
    if b.shape[0] != L or c.shape[0] != M or c.shape[1] != b.shape[1]:
        raise ValueError("gemm: shapes do not match: a (M, L) @ b (L, N) into c (M, N)")
    N = b.shape[1]
    if M == 0 or N == 0:
        return
    if L == 0:
        # An empty product: BLAS would accept it, but its leading dimensions are then
        # meaningless; c = beta * c directly.
        for i in range(M):
            for j in range(N):
                c[i, j] = 0 if beta == 0 else beta * c[i, j]
        return
    a_cm, lda = _layout(a)
    b_cm, ldb = _layout(b)
    c_cm, ldc = _layout(c)
    if c_cm:
        # c column-major is BLAS's own layout: c = op(a) op(b), a column-major view taken
        # as is and a row-major one transposed.
        _xgemm(not a_cm, not b_cm, M, N, L, alpha, a, lda, b, ldb, beta, c, ldc)
    else:
        # c row-major is c^T for BLAS: c^T = b^T a^T, a row-major view's BLAS image already
        # being its transpose.
        _xgemm(b_cm, a_cm, N, M, L, alpha, b, ldb, a, lda, beta, c, ldc)
