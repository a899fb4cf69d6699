"""The shared tile geometry (jax_fa4/kernels/common/geometry.py) on Python ints: the rules every
attention kernel computes with, each checked against its definition. (The block ranges and
masks are checked against brute force in test_sm90_fwd_compile.py and test_sm90_bwd_compile.py.)
"""

from __future__ import annotations

import itertools

import pytest

from jax_fa4.kernels.common.geometry import (BwdBlocks, FwdBlocks, packed_span, paged_keys,
                                             resolve_windows, varlen_sequence)


@pytest.mark.parametrize("wl,wr", [(-1, -1), (-7, 0), (0, 0), (3, 5), (40, 2), (2, 41), (41, 41)])
def test_windows_clamp_unbounded_and_oversize_sides_to_the_sequence(wl, wr):
    sq, sk = 33, 40
    got = resolve_windows((0.5, 0.0, wl, wr), sq, sk, is_local=True)
    assert got == (sk if wl < 0 or wl > sk else wl, sq if wr < 0 or wr > sq else wr)
    assert resolve_windows((0.5, 0.0, wl, wr), sq, sk, is_local=False) == (0, 0)


def test_varlen_sequences_and_the_padding_slice():
    cu_q, cu_k = [0, 5, 5, 12], [0, 9, 10, 30]
    for b in range(3):
        assert packed_span(cu_q, b) == (cu_q[b], cu_q[b + 1] - cu_q[b])
        assert varlen_sequence(cu_q, cu_k, b, 3) == (cu_q[b], cu_k[b], cu_q[b + 1] - cu_q[b],
                                                     cu_k[b + 1] - cu_k[b])
    # the last grid slice zeroes padding rows: the last sequence's offsets, no rows, no keys
    assert varlen_sequence(cu_q, cu_k, 3, 3) == (5, 10, 0, 0)


@pytest.mark.parametrize("used,want", [(0, 0), (17, 17), (256, 256), (300, 256), (-3, 0)])
def test_paged_key_count_is_clipped_to_the_page_table_row(used, want):
    assert paged_keys([5, used], 1, 2 * 128) == want


def test_a_varlen_tile_past_its_sequence_visits_no_key_block():
    for kind, m in itertools.product(("none", "causal", "local"), range(4)):
        blocks = FwdBlocks(128, 128, kind == "causal", kind == "local", 200, 700, 700, 200)
        lo, hi = blocks.n_block_range(m, past_end_empty=True)
        if m * 128 >= 200:
            assert hi <= lo, (kind, m)
        else:
            assert (lo, hi) == blocks.n_block_range(m) and hi > lo, (kind, m)


@pytest.mark.parametrize("window", [(None, None), (None, 0), (None, 5), (70, 3), (0, 0),
                                    (300, None), (1000, 1000)], ids=str)
def test_the_sm90_work_order_counts_the_kernels_query_block_range(window):
    """backends/sm90.visited_query_blocks (the varlen backward's work order, elementwise on
    int32 arrays under jit) gives, per key block, the length of the range the backward kernel
    computes on its resolved params (BwdBlocks.m_block_range on Python ints)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_fa4.backends import sm90
    from jax_fa4.backends.base import mask_kind
    from jax_fa4.kernels.spec import NUM_PARAMS, PARAM_WINDOW_LEFT, PARAM_WINDOW_RIGHT

    tm, tn = 64, 128
    lens = [(sq, sk) for sq in (1, 63, 64, 200, 513) for sk in (1, 127, 128, 300, 700)]
    rows = [(sq, sk, n) for sq, sk in lens for n in range(-(-sk // tn))]
    len_q, len_k, n_block = (jnp.asarray(c, jnp.int32) for c in zip(*rows))
    got = jax.jit(sm90.visited_query_blocks, static_argnums=(3, 4, 5))(
        len_q, len_k, n_block, tm, tn, window)
    kind = mask_kind(window)
    params = [0.0] * NUM_PARAMS
    params[PARAM_WINDOW_LEFT] = -1 if window[0] is None else window[0]
    params[PARAM_WINDOW_RIGHT] = -1 if window[1] is None else window[1]
    want = []
    for sq, sk, n in rows:
        wl, wr = resolve_windows(params, sq, sk, kind == "local")
        lo, hi = BwdBlocks(tm, tn, kind == "causal", kind == "local", sq, sk, wl,
                           wr).m_block_range(n)
        want.append(max(hi - lo, 0))
    assert np.asarray(got).tolist() == want
    if window in ((None, 0), (70, 3), (0, 0)):  # the band skips query blocks somewhere
        assert any(w < -(-sq // tm) for w, (sq, _, _) in zip(want, rows))
