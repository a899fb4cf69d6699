"""Views of the JAX row-major (B, S, H, D) tensors in the mode orders the kernels tile."""

import cutlass.cute as cute


def seq_major(t: cute.Tensor, d: int) -> cute.Tensor:
    """(B, S, H, D) row-major -> (S, D, H, B) view with the head dim's extent made static."""
    layout = cute.make_layout((t.shape[1], d, t.shape[2], t.shape[0]),
                              stride=(t.stride[1], 1, t.stride[2], t.stride[0]))
    return cute.make_tensor(t.iterator, layout)


def dim_major(t: cute.Tensor, d: int) -> cute.Tensor:
    """(B, S, H, D) row-major -> (D, S, H, B) view (e.g. V as the MN-major B operand of P·V)."""
    layout = cute.make_layout((d, t.shape[1], t.shape[2], t.shape[0]),
                              stride=(1, t.stride[1], t.stride[2], t.stride[0]))
    return cute.make_tensor(t.iterator, layout)
