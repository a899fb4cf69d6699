"""Register-fragment views of Hopper (sm_90) warpgroup-MMA accumulators.

A WGMMA accumulator fragment of one thread has the layout ``((2, 2, V), MMA_M, MMA_N)``: two
adjacent columns, two rows 8 apart, and V groups of 8 columns. Softmax wants it as a
(rows, columns) matrix; the P·V GEMM wants the same registers, converted to 16 bits, as its
register A operand ``((2, 2, 2), MMA_M, MMA_K)`` with K chunks of 16 columns.
"""

import cutlass.cute as cute


def acc_layout_mn(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), M, N) accumulator layout -> ((2, M), (2, V, N)): rows first, then columns."""
    compact = cute.make_layout(acc_layout.shape)  # column-major over the fragment's own shape
    sh, st = compact.shape, compact.stride
    rows_shape, rows_stride = (sh[0][1], sh[1]), (st[0][1], st[1])
    cols_shape, cols_stride = (sh[0][0], sh[0][2], sh[2]), (st[0][0], st[0][2], st[2])
    view = cute.make_layout((rows_shape, cols_shape), stride=(rows_stride, cols_stride))
    return cute.composition(acc_layout, view)


def acc_view_mn(acc: cute.Tensor) -> cute.Tensor:
    """The (rows, columns) view of an accumulator fragment (same registers)."""
    return cute.make_tensor(acc.iterator, acc_layout_mn(acc.layout))


def acc_layout_as_a_operand(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), M, N) accumulator layout -> ((2, 2, 2), M, (V // 2, N)): the register-A view.

    V must be even (the tile's N is a multiple of 16): each K=16 chunk of the A operand is two
    8-column groups of the accumulator.
    """
    sh, st = acc_layout.shape, acc_layout.stride
    v = sh[0][2]
    assert v % 2 == 0, "accumulator N must be a multiple of 16 to feed a K=16 WGMMA"
    shape = ((sh[0][0], sh[0][1], 2), sh[1], (v // 2, sh[2]))
    stride = ((st[0][0], st[0][1], st[0][2]), st[1], (st[0][2] * 2, st[2]))
    return cute.make_layout(shape, stride=stride)


def acc_view_as_a_operand(acc: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(acc.iterator, acc_layout_as_a_operand(acc.layout))


def transpose_mn(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a (shared-memory) tensor: (A, B, ...) -> (B, A, ...)."""
    r = cute.rank(t)
    shape = (t.shape[1], t.shape[0], *[t.shape[i] for i in range(2, r)])
    order = (1, 0, *range(2, r))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def select_modes(t: cute.Tensor, modes) -> cute.Tensor:
    """A view of t with its modes reordered/selected (no data movement)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=list(modes)))
