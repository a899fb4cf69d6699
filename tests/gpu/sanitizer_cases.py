"""One small forward + backward of every kernel kind, run under compute-sanitizer by
tests/gpu/test_sanitizers.py (``python tests/gpu/sanitizer_cases.py`` runs them plainly).

Each case is ``jax.value_and_grad`` of a loss through ``flash_attention(implementation="sm90")``,
so it launches the forward, the preprocess, the backward and its dQ postprocess kernels.
Lengths are odd and mismatched so that every tail path (TMA clipping, masked last blocks,
padded dQ rows) runs. Two forward-only cases add the decode kernels: a dense decode step (the
64-row decode tile on GQA-packed, split keys) and a paged one (page-table loads, per-chunk
``seqused_k``, a partly used last page). Two varlen cases (MHA and GQA) run the varlen forward
and backward kernels on packed sequences with empty, length-1 and odd lengths, and padding
tokens around them (per-sequence TMA offsets, row-predicated stores, the work list).

Group ``segments`` (issue #23): forward + backward with segment ids: packed runs with a padding id
and a learnable sink (GQA, causal), non-contiguous ids (the key-by-key compare) with a softcap and
max logits, and a (q_ids, kv_ids) pair on mismatched lengths (the sorted tables) with a window.

Groups ``bad-varlen`` and ``bad-paged`` (memcheck only, issue #24): traced cu_seqlens, page tables
and seqused_k that break the contract (not starting at 0, decreasing, past the packed tokens,
negative, longer than max_seqlen; page indices past num_pages or negative; seqused_k past the
table's pages or negative), which no validation sees under jit. Only "0 memcheck errors" is
required (the results are meaningless), and finite paged outputs (the clamping rules make them
well defined).
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp

import jax_fa4

# (head_dim, head_dim_v, H, Hkv, causal, window, softcap): every shipped tuning kind
CASES = [
    (64, 64, 4, 4, False, (None, None), 0.0),  # 3 consumer warpgroups
    (64, 64, 4, 2, True, (None, None), 0.0),
    (96, 96, 2, 2, False, (33, 5), 0.0),
    (128, 128, 4, 4, False, (None, None), 0.0),
    (128, 128, 4, 1, True, (None, None), 0.0),  # MQA: float32 per-head dK/dV
    (128, 128, 2, 2, False, (40, 10), 20.0),
    (192, 128, 2, 2, True, (None, None), 0.0),
    (256, 256, 2, 2, True, (None, None), 0.0),  # ping-pong + conditional rescale
    (256, 256, 2, 2, False, (None, None), 10.0),
]
SQ, SK = 77, 131


def run_case(case, seed: int) -> None:
    d, dv, h, hkv, causal, window, softcap = case
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (1, SQ, h, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (1, SK, hkv, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (1, SK, hkv, dv), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(ks[3], (1, SQ, h, dv), jnp.float32)

    def loss(q, k, v):
        out = jax_fa4.flash_attention(q, k, v, causal=causal, window_size=window,
                                      softcap=softcap, implementation="sm90")
        return jnp.sum(out.astype(jnp.float32) * w)

    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    jax.block_until_ready(grads)
    assert bool(jnp.isfinite(value)) and all(bool(jnp.all(jnp.isfinite(g))) for g in grads), case


def run_decode_cases(seed: int) -> None:
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (2, 1, 8, 128), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (2, 2048, 2, 128), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (2, 2048, 2, 128), jnp.float32).astype(jnp.bfloat16)
    out = jax.jit(lambda q, k, v: jax_fa4.flash_attention(q, k, v, implementation="sm90"))(
        q, k, v)
    k_cache = jax.random.normal(ks[3], (41, 128, 2, 128), jnp.float32).astype(jnp.bfloat16)
    v_cache = jax.random.normal(ks[4], (41, 128, 2, 128), jnp.float32).astype(jnp.bfloat16)
    table = jnp.arange(40, dtype=jnp.int32)[::-1].reshape(2, 20)
    used = jnp.asarray([2500, 130], jnp.int32)
    paged = jax.jit(lambda *a: jax_fa4.flash_attention_paged(*a, implementation="sm90"))(
        q, k_cache, v_cache, table, used)
    for x in (out, paged):
        assert bool(jnp.all(jnp.isfinite(x.astype(jnp.float32))))


_START = time.monotonic()


def run_varlen_cases(seed: int) -> None:
    lens_q, lens_k = (1, 0, 77, 130, 5), (7, 3, 131, 64, 0)
    tq, tk = 3 + sum(lens_q) + 4, 3 + sum(lens_k) + 4
    cu_q = jnp.asarray([3, 4, 4, 81, 211, 216], jnp.int32)
    cu_k = jnp.asarray([3, 10, 13, 144, 208, 208], jnp.int32)
    for hkv, causal in ((4, False), (2, True)):
        ks = jax.random.split(jax.random.key(seed + hkv), 4)
        q = jax.random.normal(ks[0], (tq, 4, 128), jnp.float32).astype(jnp.bfloat16)
        k = jax.random.normal(ks[1], (tk, hkv, 128), jnp.float32).astype(jnp.bfloat16)
        v = jax.random.normal(ks[2], (tk, hkv, 128), jnp.float32).astype(jnp.bfloat16)
        w = jax.random.normal(ks[3], (tq, 4, 128), jnp.float32)

        def loss(q, k, v):
            out = jax_fa4.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                 causal=causal, implementation="sm90")
            return jnp.sum(out.astype(jnp.float32) * w)

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
        _progress(f"varlen hkv={hkv} causal={causal}: compiled")
        value, grads = step(q, k, v)
        jax.block_until_ready(grads)
        _progress(f"varlen hkv={hkv} causal={causal}: ran")
        assert bool(jnp.isfinite(value)) and all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


#: (head_dim, H, Hkv, causal, window, softcap, form): the segment-id cases (issue #23)
SEGMENT_CASES = [
    (128, 4, 2, True, (None, None), 0.0, "packed+padding+sink"),
    (64, 4, 4, False, (None, None), 15.0, "non-contiguous+max_logits"),
    (96, 2, 2, False, (40, 10), 0.0, "pair"),
]


def _runs(lengths: list[int], ids: list[int]) -> jax.Array:
    return jnp.concatenate([jnp.full((n,), i, jnp.int32) for n, i in zip(lengths, ids)])[None]


def run_segment_cases(seed: int) -> None:
    for i, (d, h, hkv, causal, window, softcap, form) in enumerate(SEGMENT_CASES):
        sq, sk = (SQ, SK) if form == "pair" else (SK, SK)
        ks = jax.random.split(jax.random.key(seed + i), 5)
        q = jax.random.normal(ks[0], (1, sq, h, d), jnp.float32).astype(jnp.bfloat16)
        k = jax.random.normal(ks[1], (1, sk, hkv, d), jnp.float32).astype(jnp.bfloat16)
        v = jax.random.normal(ks[2], (1, sk, hkv, d), jnp.float32).astype(jnp.bfloat16)
        w = jax.random.normal(ks[3], (1, sq, h, d), jnp.float32)
        extra = {}
        if form.startswith("packed"):  # three documents, then padding (-1)
            extra = dict(segment_ids=_runs([40, 1, 67, 23], [0, 1, 2, -1]),
                         padding_segment_id=-1,
                         learnable_sink=jax.random.normal(ks[4], (h,), jnp.float32))
        elif form.startswith("non-contiguous"):  # ids come back after other runs
            extra = dict(segment_ids=_runs([20, 33, 1, 50, 27], [5, 2, 5, 7, 2]),
                         return_max_logits=True)
        else:  # (q_ids, kv_ids) on Sq != Sk, one query id missing from the keys
            extra = dict(segment_ids=(_runs([30, 40, 7], [1, 2, 3]), _runs([60, 71], [1, 2])))

        def loss(q, k, v):
            out = jax_fa4.flash_attention(q, k, v, causal=causal, window_size=window,
                                          softcap=softcap, implementation="sm90", **extra)
            if isinstance(out, tuple):  # (out, max_logits)
                out = out[0] + out[1].sum()
            return jnp.sum(out.astype(jnp.float32) * w)

        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
        jax.block_until_ready(grads)
        _progress(f"segments {form}: ran")
        assert bool(jnp.isfinite(value)) and all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


# -- adversarial traced metadata (issue #24) ---------------------------------------------------
# Inside jax.jit the varlen / paged metadata is traced, so no call-time validation runs: these
# cases hand the kernels values that break the contract and require only that the kernels finish
# with no memcheck error (the results are meaningless by design), plus finite paged outputs,
# which the clamping rules make well defined (docs/api.md, "Bad metadata under jit").

#: Varlen: three sequences packed between 3 leading and 5 trailing padding tokens; max_seqlen
#: 100, not a multiple of any query tile, so a longer sequence reaches the grid's partial tile.
BAD_TQ, BAD_TK, BAD_MAX_Q, BAD_MAX_K = 3 + 150 + 5, 3 + 200 + 5, 100, 100
#: (what, cu_seqlens_q, cu_seqlens_k); the first is legal (a baseline in the same program).
BAD_CU_SEQLENS = [
    ("legal, leading padding", [3, 40, 90, 153], [3, 70, 140, 203]),
    ("first entry above 0", [20, 40, 90, 153], [50, 70, 140, 203]),
    ("decreasing", [3, 120, 40, 153], [3, 180, 30, 203]),
    ("last entry past the packed tokens", [3, 40, 90, BAD_TQ + 77],
     [3, 70, 140, BAD_TK + 131]),
    ("every entry past the packed tokens", [BAD_TQ + 10, BAD_TQ + 50, BAD_TQ + 90, BAD_TQ + 99],
     [BAD_TK + 5, BAD_TK + 60, BAD_TK + 100, BAD_TK + 170]),
    ("negative entries", [-50, -10, 60, 153], [-90, 30, 100, 203]),
    ("a sequence longer than max_seqlen", [3, 4, 5, 153], [3, 4, 5, 203]),
]


def run_bad_varlen_cases(seed: int) -> None:
    """Forward and backward of a varlen call with traced cu_seqlens that break the contract,
    one compiled program for all of them (MHA causal and GQA with a window and softcap)."""
    for hkv, causal, window, softcap in ((4, True, (None, None), 0.0), (2, False, (40, 7), 15.0)):
        ks = jax.random.split(jax.random.key(seed + hkv), 4)
        q = jax.random.normal(ks[0], (BAD_TQ, 4, 128), jnp.float32).astype(jnp.bfloat16)
        k = jax.random.normal(ks[1], (BAD_TK, hkv, 128), jnp.float32).astype(jnp.bfloat16)
        v = jax.random.normal(ks[2], (BAD_TK, hkv, 128), jnp.float32).astype(jnp.bfloat16)
        w = jax.random.normal(ks[3], (BAD_TQ, 4, 128), jnp.float32)

        def loss(q, k, v, cu_q, cu_k):
            out = jax_fa4.flash_attention_varlen(q, k, v, cu_q, cu_k, BAD_MAX_Q, BAD_MAX_K,
                                                 causal=causal, window_size=window,
                                                 softcap=softcap, implementation="sm90")
            return jnp.sum(out.astype(jnp.float32) * w)

        cu_spec = jax.ShapeDtypeStruct((4,), jnp.int32)
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(
            q, k, v, cu_spec, cu_spec).compile()
        for what, cu_q, cu_k in BAD_CU_SEQLENS:
            jax.block_until_ready(step(q, k, v, jnp.asarray(cu_q, jnp.int32),
                                       jnp.asarray(cu_k, jnp.int32)))
            _progress(f"bad varlen hkv={hkv} causal={causal}: {what}")


#: Paged: 2 batch entries over a 9-page cache of 128-key pages, 4 table slots each.
BAD_PAGES, BAD_PAGE_SIZE = 9, 128
#: (what, page_table, seqused_k)
BAD_PAGED = [
    ("legal", [[3, 7, -1, -1], [0, 8, 2, 5]], [200, 512]),
    ("page index = num_pages", [[3, BAD_PAGES, -1, -1], [0, 8, 2, BAD_PAGES]], [200, 512]),
    ("page index far past num_pages", [[2**20, 1, -1, -1], [0, 2**30, 2, 2**31 - 1]],
     [200, 512]),
    ("negative page index", [[-1, 1, -1, -1], [0, -7, 2, -(2**31)]], [200, 512]),
    ("seqused_k past the table's pages", [[3, 7, -1, -1], [0, 8, 2, 5]], [100000, 2**31 - 1]),
    ("negative seqused_k", [[3, 7, -1, -1], [0, 8, 2, 5]], [-5, -(2**31)]),
]


def run_bad_paged_cases(seed: int) -> None:
    """Paged forward with traced page tables and seqused_k that break the contract: a decode
    step (GQA-packed, maybe split over the keys) and a causal 3-query chunk, with a sink. The
    kernels clamp seqused_k to [0, max_pages * page_size] and read a page index outside the
    cache as zeros (TMA's out-of-bounds fill), so every output must be finite (no NaN)."""
    ks = jax.random.split(jax.random.key(seed), 4)
    shape = (BAD_PAGES, BAD_PAGE_SIZE, 2, 128)
    k_cache = jax.random.normal(ks[0], shape, jnp.float32).astype(jnp.bfloat16)
    v_cache = jax.random.normal(ks[1], shape, jnp.float32).astype(jnp.bfloat16)
    sink = jnp.linspace(-1.0, 2.0, 8, dtype=jnp.float32)
    for sq, causal in ((1, False), (3, True)):
        q = jax.random.normal(ks[2], (2, sq, 8, 128), jnp.float32).astype(jnp.bfloat16)

        def attend(q, k_cache, v_cache, table, used):
            return jax_fa4.flash_attention_paged(q, k_cache, v_cache, table, used,
                                                 causal=causal, learnable_sink=sink,
                                                 return_lse=True, implementation="sm90")

        fn = jax.jit(attend).lower(q, k_cache, v_cache, jax.ShapeDtypeStruct((2, 4), jnp.int32),
                                   jax.ShapeDtypeStruct((2,), jnp.int32)).compile()
        for what, table, used in BAD_PAGED:
            out, lse = jax.block_until_ready(fn(q, k_cache, v_cache,
                                                jnp.asarray(table, jnp.int32),
                                                jnp.asarray(used, jnp.int32)))
            _progress(f"bad paged sq={sq}: {what}")
            assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32)))), (sq, what)
            assert not bool(jnp.any(jnp.isnan(lse))), (sq, what)


def _progress(what: str) -> None:
    """A timestamped line (where a sanitizer run spends its time, or stops)."""
    print(f"[{time.monotonic() - _START:7.1f} s] {what}", flush=True)


#: Case groups, each run in its own process by tests/gpu/test_sanitizers.py (on the H200,
#: compute-sanitizer's host process crashed, rc 139, when the varlen steps ran after all the
#: others in one process; each group alone is clean, and without the sanitizer all run in one
#: process).
GROUPS = ("dense", "varlen", "segments", "bad-varlen", "bad-paged")


def main(argv: list[str] | None = None) -> int:
    groups = (argv if argv is not None else sys.argv[1:]) or list(GROUPS)
    unknown = set(groups) - set(GROUPS)
    if unknown:
        print(f"unknown case groups {sorted(unknown)}; known: {GROUPS}", file=sys.stderr)
        return 2
    count = 0
    if "dense" in groups:
        for i, case in enumerate(CASES):
            run_case(case, i)
            _progress(f"ran {case}")
        run_decode_cases(len(CASES))
        print("ran the dense and paged decode steps", flush=True)
        count += len(CASES) + 2
    if "varlen" in groups:
        run_varlen_cases(len(CASES) + 1)
        print("ran the varlen forward and backward steps", flush=True)
        count += 2
    if "segments" in groups:
        run_segment_cases(len(CASES) + 4)
        print("ran the segment-id forward and backward steps", flush=True)
        count += len(SEGMENT_CASES)
    if "bad-varlen" in groups:
        run_bad_varlen_cases(len(CASES) + 2)
        print("ran the varlen steps on bad traced cu_seqlens", flush=True)
        count += len(BAD_CU_SEQLENS) * 2
    if "bad-paged" in groups:
        run_bad_paged_cases(len(CASES) + 3)
        print("ran the paged steps on bad traced page tables and seqused_k", flush=True)
        count += len(BAD_PAGED) * 2
    print(f"{count} cases ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
