"""Padding isolation, shared by tests/test_padding_isolation.py (the CPU reference) and
tests/gpu/test_padding_isolation.py (the Hopper kernels).

The promise under test (issue #24): NaN or Inf in storage that a call does not use must not
change any valid output, lse or gradient. That storage is

* varlen: the packed tokens outside ``[cu_seqlens[0], cu_seqlens[-1])`` (padding before the
  first and after the last sequence), in q, k, v and in the cotangents of out and lse;
* paged KV: the cache pages no used page-table entry names (pages in no table, and the pages
  that table entries past a sequence's used pages name) and the slots of a sequence's last used
  page at or past ``seqused_k``.

Each check runs one compiled call on inputs with finite random values everywhere (padding
included) and again with the padding poisoned (NaN, +Inf and -Inf in turn), one input at a time
and all at once, and reports, per scenario and output, how many valid elements became
non-finite or changed. It also checks what the API documents for padding (jax_fa4/api.py):
varlen padding rows give output 0 and lse -inf (even with a sink) and "no gradient", which
tests/gpu/test_varlen.py and these tests read as an exact 0 for dq of padding queries and dk,
dv of padding keys.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from conformance import normal

#: What poisoned padding holds, element by element in turn.
POISON_VALUES = (np.nan, np.inf, -np.inf)

#: varlen scenarios: the inputs whose padding is poisoned (cotangents: dout and dlse).
VARLEN_SCENARIOS = {
    "q": ("q",),
    "k": ("k",),
    "v": ("v",),
    "dout/dlse": ("dout", "dlse"),
    "all": ("q", "k", "v", "dout", "dlse"),
}

#: paged scenarios: (cache, which unused storage) pairs poisoned together.
PAGED_SCENARIOS = {
    "k unused pages": (("k", "pages"),),
    "v unused pages": (("v", "pages"),),
    "k last-page tail": (("k", "tail"),),
    "v last-page tail": (("v", "tail"),),
    "all": (("k", "pages"), ("v", "pages"), ("k", "tail"), ("v", "tail")),
}


def poison(x: jax.Array, padding: np.ndarray) -> jax.Array:
    """``x`` with the entries selected by the boolean ``padding`` (over x's leading axes) set to
    NaN, +Inf and -Inf in turn; same dtype."""
    y = np.array(x, np.float32)
    selected = y[padding]
    y[padding] = np.resize(np.asarray(POISON_VALUES, np.float32), selected.size).reshape(
        selected.shape)
    return jnp.asarray(y, x.dtype)


def _first(bad: np.ndarray) -> str:
    return str(tuple(int(i) for i in np.argwhere(bad)[0])) if bad.any() else "-"


def compare_valid(name: str, got, want, rtol: float = 0.0, atol: float = 0.0) -> str | None:
    """None when ``got`` equals ``want`` (the run with finite padding) element by element, within
    ``|got - want| <= atol + rtol * |want|`` (0, 0: bitwise, -0 == 0; equal infinities match),
    else a line saying how many elements turned non-finite and how many changed."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    both_finite = np.isfinite(got) & np.isfinite(want)
    diff = np.zeros(got.shape, np.float32)
    diff[both_finite] = np.abs(got[both_finite] - want[both_finite])
    if rtol or atol:
        same |= both_finite & (diff <= atol + rtol * np.abs(want))
    turned = ~np.isfinite(got) & np.isfinite(want)
    changed = ~same & ~turned
    if not (turned.any() or changed.any()):
        return None
    parts = []
    if turned.any():
        parts.append(f"{int(turned.sum())} non-finite (NaN {int((np.isnan(got) & turned).sum())}"
                     f", Inf {int((np.isinf(got) & turned).sum())}; first at {_first(turned)})")
    if changed.any():
        parts.append(f"{int(changed.sum())} changed (first at {_first(changed)}, max |diff| "
                     f"{float(diff[changed].max()):.3g}, atol {atol:.3g}, rtol {rtol:.3g})")
    return f"{name}: " + " and ".join(parts) + f" of {got.size} valid elements"


def compare_padding(name: str, got, expected: float) -> str | None:
    """None when every element of ``got`` (a padding slice) is exactly ``expected`` (0 or
    -inf), else a line counting those that are not (and the non-finite ones among them)."""
    got = np.asarray(got, np.float32)
    bad = ~(got == expected)
    if not bad.any():
        return None
    return (f"{name}: {int(bad.sum())} of {got.size} padding elements are not {expected} "
            f"({int(np.isnan(got).sum())} NaN, {int((np.isinf(got) & bad).sum())} Inf; first at "
            f"{_first(bad)})")


def check_finite(name: str, x, allow_neginf: bool = False) -> str | None:
    """None when ``x`` (a valid slice of the run with finite padding) has no NaN / Inf (-inf
    allowed for lse rows without keys), else a line counting them."""
    x = np.asarray(x, np.float32)
    bad = np.isnan(x) | (np.isposinf(x)) | (np.isneginf(x) & (not allow_neginf))
    if not bad.any():
        return None
    return f"{name}: {int(bad.sum())} of {x.size} elements non-finite even with finite padding"


# -- varlen ------------------------------------------------------------------------------------
def varlen_layout(lens_q, lens_k, pad_front: int, pad_back: int):
    """(cu_seqlens_q, cu_seqlens_k) int32 with ``pad_front`` padding tokens before the first
    sequence and ``pad_back`` after the last, and the boolean in-sequence masks of the packed
    query and key tokens."""
    cu_q = (np.concatenate([[0], np.cumsum(lens_q)]) + pad_front).astype(np.int32)
    cu_k = (np.concatenate([[0], np.cumsum(lens_k)]) + pad_front).astype(np.int32)
    in_q = np.zeros(int(cu_q[-1]) + pad_back, bool)
    in_k = np.zeros(int(cu_k[-1]) + pad_back, bool)
    in_q[cu_q[0]:cu_q[-1]] = True
    in_k[cu_k[0]:cu_k[-1]] = True
    return cu_q, cu_k, in_q, in_k


def varlen_inputs(total_q, total_k, h, hkv, d, dv, dtype, seed, with_sink):
    """Finite random q, k, v, sink (or None), dout and dlse (float32) for a packed batch; the
    padding tokens hold random values too (drawn by NumPy: no XLA program per shape)."""
    q, k, v, dout = normal(f"padding varlen {seed}", [(total_q, h, d), (total_k, hkv, d),
                                                      (total_k, hkv, dv), (total_q, h, dv)],
                           dtype)
    (dlse,) = normal(f"padding varlen dlse {seed}", [(h, total_q)], jnp.float32)
    return dict(q=q, k=k, v=v, sink=_sink(h) if with_sink else None, dout=dout, dlse=dlse)


def _sink(h: int) -> jax.Array:
    """The learnable sink of the checks: (h,) float32 from -1 to 2."""
    return jnp.asarray(np.linspace(-1.0, 2.0, h, dtype=np.float32))


def varlen_isolation_failures(attend: Callable, lens_q, lens_k, pad_front: int, pad_back: int,
                              h: int, hkv: int, d: int, dv: int, *, dtype=jnp.float32,
                              with_sink: bool = False, seed: int = 0,
                              tolerances: dict | None = None) -> list[str]:
    """Every violation of padding isolation by a varlen call, one line each (empty: none).

    Args:
      attend: ``attend(q, k, v, sink, cu_seqlens_q, cu_seqlens_k) -> (out, lse)``, a varlen call
        with ``return_lse=True``; differentiated here with ``jax.vjp`` in one jitted program.
      lens_q, lens_k: the sequences' lengths.
      pad_front, pad_back: padding tokens before the first and after the last sequence.
      h, hkv, d, dv: heads and head dims.
      dtype: of q, k, v and dout.
      with_sink: pass a learnable sink (its gradient is checked too).
      seed: of the random inputs.
      tolerances: ``{result name: (rtol, atol as a fraction of max|want|)}`` for results that
        are not reproducible bit for bit (e.g. a dq summed by atomics); default exact.
    """
    cu_q, cu_k, in_q, in_k = varlen_layout(lens_q, lens_k, pad_front, pad_back)
    clean = varlen_inputs(in_q.size, in_k.size, h, hkv, d, dv, dtype, seed, with_sink)
    cu_q_dev, cu_k_dev = jnp.asarray(cu_q), jnp.asarray(cu_k)

    @jax.jit
    def run(q, k, v, sink, dout, dlse):
        f = lambda q, k, v, s: attend(q, k, v, s, cu_q_dev, cu_k_dev)  # noqa: E731
        (out, lse), vjp = jax.vjp(f, q, k, v, sink)
        dq, dk, dv_, dsink = vjp((dout, dlse))
        return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv_, dsink=dsink)

    padding_of = dict(q=~in_q, k=~in_k, v=~in_k, dout=~in_q)
    scenario_inputs = {}
    for scenario, names in VARLEN_SCENARIOS.items():
        inputs = dict(clean)
        for name in names:
            if name == "dlse":  # (H, total_q): the padding columns
                inputs[name] = poison(clean[name].T, ~in_q).T
            else:
                inputs[name] = poison(clean[name], padding_of[name])
        scenario_inputs[scenario] = inputs
    # each result's valid tokens (along its token axis) and what its padding must hold
    layout = dict(out=(in_q, 0, 0.0), lse=(in_q, 1, -np.inf), dq=(in_q, 0, 0.0),
                  dk=(in_k, 0, 0.0), dv=(in_k, 0, 0.0), dsink=None)
    return isolation_failures(run, clean, scenario_inputs, layout, tolerances)


def isolation_failures(run: Callable, clean: dict, scenario_inputs: dict, layout: dict,
                       tolerances: dict | None = None) -> list[str]:
    """Run ``run(**clean)`` and ``run(**inputs)`` for each poisoned scenario; every failure as a
    line (empty: none).

    Args:
      run: the jitted call, returning a dict of named results (None entries are skipped).
      clean: the inputs with finite padding.
      scenario_inputs: ``{scenario name: inputs}`` with the padding poisoned.
      layout: ``{result name: (valid tokens (bool), token axis, padding value) or None}``; None:
        every element is valid. Valid elements must equal the clean run's; padding elements
        must hold the padding value exactly, in every run.
      tolerances: ``{result name: (rtol, atol as a fraction of max|want|)}``; default exact.
    """
    tolerances = tolerances or {}

    def split(name, x):  # (valid part, padding part or None)
        x = np.asarray(x, np.float32)
        if layout.get(name) is None:
            return x, None
        tokens, axis, _ = layout[name]
        return np.compress(tokens, x, axis=axis), np.compress(~tokens, x, axis=axis)

    want = jax.device_get(run(**clean))
    failures = []
    for name, x in want.items():
        if x is None:
            continue
        good, pad = split(name, x)
        failures.append(check_finite(f"finite padding: {name}", good, allow_neginf=name == "lse"))
        if pad is not None:
            failures.append(compare_padding(f"finite padding: {name}", pad, layout[name][2]))
    for scenario, inputs in scenario_inputs.items():
        got = jax.device_get(run(**inputs))
        for name, x in got.items():
            if x is None:
                continue
            good, pad = split(name, x)
            want_good, _ = split(name, want[name])
            rtol, rel_atol = tolerances.get(name, (0.0, 0.0))
            finite_want = want_good[np.isfinite(want_good)]
            atol = rel_atol * float(np.max(np.abs(finite_want), initial=0.0))
            label = f"poisoned {scenario}: {name}"
            failures.append(compare_valid(label, good, want_good, rtol, atol))
            if pad is not None:
                failures.append(compare_padding(label, pad, layout[name][2]))
    return [f for f in failures if f is not None]


# -- paged KV ----------------------------------------------------------------------------------
def paged_layout(b: int, page_size: int, max_pages: int, seqused, extra_pages: int, seed: int):
    """A shuffled page table and the cache's unused storage.

    Each batch entry gets ``max_pages`` distinct pages; the entries past its used pages keep
    their (stale, unused) pages in even rows and hold -1 in odd rows, and ``extra_pages`` pages
    are in no table. Returns ``(table (b, max_pages) int32, seqused (b,) int32, unused_pages
    (num_pages, page_size) bool: every slot of a page no used entry names, tail (num_pages,
    page_size) bool: the slots of a last used page at or past seqused_k)``.
    """
    rng = np.random.default_rng(seed)
    num_pages = b * max_pages + extra_pages
    table = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    seqused = np.asarray(seqused, np.int32)
    used_slots = np.zeros((num_pages, page_size), bool)
    for row, n in enumerate(seqused):
        for j in range(int(n)):
            used_slots[table[row, j // page_size], j % page_size] = True
        if row % 2:
            table[row, -(-int(n) // page_size):] = -1
    page_used = used_slots.any(axis=1)
    unused_pages = np.repeat(~page_used[:, None], page_size, axis=1)
    tail = page_used[:, None] & ~used_slots
    return table, seqused, unused_pages, tail


def paged_isolation_failures(attend: Callable, b: int, sq: int, h: int, hkv: int, d: int,
                             dv: int, page_size: int, max_pages: int, seqused, *,
                             dtype=jnp.float32, with_sink: bool = False, seed: int = 0,
                             extra_pages: int = 3) -> list[str]:
    """Every violation of padding isolation by a paged call, one line each (empty: none).

    Args:
      attend: ``attend(q, k_cache, v_cache, page_table, seqused_k, sink) -> (out, lse)``, a paged
        call with ``return_lse=True`` (jitted here).
      b, sq, h, hkv, d, dv: batch, queries per entry, heads, head dims.
      page_size, max_pages, seqused: the cache's pages and each entry's valid keys.
      dtype: of q and the cache.
      with_sink: pass a learnable sink.
      seed: of the random inputs and the page table.
      extra_pages: pages in no page table.
    """
    table, used, unused_pages, tail = paged_layout(b, page_size, max_pages, seqused,
                                                   extra_pages, seed)
    assert tail.any() and unused_pages.any(), "the layout must have both kinds of padding"
    num_pages = table.size + extra_pages
    clean = dict(zip("qkv", normal(f"padding paged {seed}", [
        (b, sq, h, d), (num_pages, page_size, hkv, d), (num_pages, page_size, hkv, dv)], dtype)))
    sink = _sink(h) if with_sink else None
    table_dev, used_dev = jnp.asarray(table), jnp.asarray(used)

    @jax.jit
    def run(q, k, v):
        out, lse = attend(q, k, v, table_dev, used_dev, sink)
        return dict(out=out, lse=lse)

    storage = dict(pages=unused_pages, tail=tail)
    scenario_inputs = {}
    for scenario, pairs in PAGED_SCENARIOS.items():
        inputs = dict(clean)
        for cache in ("k", "v"):
            mask = np.zeros_like(tail)
            for poisoned_cache, where in pairs:
                if poisoned_cache == cache:
                    mask |= storage[where]
            if mask.any():
                inputs[cache] = poison(clean[cache], mask)
        scenario_inputs[scenario] = inputs
    return isolation_failures(run, clean, scenario_inputs, dict(out=None, lse=None))
