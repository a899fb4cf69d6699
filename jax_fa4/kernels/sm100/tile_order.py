"""Persistent tile order of the sm100 forward: one arithmetic for the kernel and for the tests.

The work tiles are (m_block, head, batch). A persistent CTA ``c`` of a grid of ``G`` CTAs
(``G = min(num_sms, num_tiles)``, the SM count coming from the config, never from the device)
processes the linear indices c, c + G, c + 2G, … and maps each through :func:`tile_coords`.

* Dense (no causal / local mask): m_block varies fastest, so CTAs running at the same time work
  on the same (head, batch) and share its K/V in L2.
* Causal / local (``heavy_first``): m_block is the *slowest* index and runs from the last block
  down. Under a bottom-right causal mask the work of a tile grows with m_block, so every wave of
  G tiles takes the heaviest tiles left (longest-processing-time-first; each CTA's own sequence is
  non-increasing in work).

The functions only use ``+ - * // %`` on their arguments, so they run unchanged on Python ints
(tests) and on CuTe-DSL ``Int32`` values (kernel).
"""

from __future__ import annotations


def num_tiles(num_m_blocks, num_heads, num_batch):
    return num_m_blocks * num_heads * num_batch


def grid_size(total_tiles: int, num_sms: int) -> int:
    """Persistent CTAs to launch (host side; at least 1)."""
    return max(1, min(num_sms, total_tiles))


def tile_coords(idx, num_m_blocks, num_heads, num_batch, heavy_first: bool):
    """Linear work index in [0, num_tiles) -> (m_block, head, batch)."""
    if heavy_first:
        # idx = rank · (H·B) + batch · H + head, m_block = M − 1 − rank
        heads_batch = num_heads * num_batch
        rank = idx // heads_batch
        rest = idx - rank * heads_batch
        batch = rest // num_heads
        return num_m_blocks - 1 - rank, rest - batch * num_heads, batch
    # idx = (batch · H + head) · M + m_block
    hb = idx // num_m_blocks
    batch = hb // num_heads
    return idx - hb * num_m_blocks, hb - batch * num_heads, batch


def cta_work(cta: int, grid: int, total_tiles: int):
    """The linear indices persistent CTA ``cta`` processes, in order (Python model of the loop)."""
    return range(cta, total_tiles, grid)
