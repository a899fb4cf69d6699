"""Views of the JAX row-major (B, S, H, D) tensors in the mode orders the kernels tile, and of
one sequence of them."""

import cutlass.cute as cute
from cutlass import const_expr


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


def sequence(mX: cute.Tensor, head, batch, offset=None, seq_mode: int = 0) -> cute.Tensor:
    """One head of one sequence of a (S, D, H, B) tensor (``seq_mode`` 0) or a (D, S, H, B) one
    (1): ``mX[:, :, head, batch]``, or (varlen, packed as one batch entry) the rows from
    ``offset`` on."""
    if const_expr(offset is None):
        return mX[None, None, head, batch]
    coord = (offset, 0) if seq_mode == 0 else (0, offset)
    return cute.domain_offset(coord, mX[None, None, head, 0])
