"""The GPU suite's kernels are in the ``tests`` suite of ``jax_fa4.tools.variants``.

The GPU suite (tests/gpu) runs on a kernel cache of ``precompile --suite tests --arch sm_90a``
(README, "Development"); a kernel missing there fails its test with KernelNotAvailableError, on
the GPU only. Here the GPU tests' calls are lowered for CUDA on any machine
(tests/cuda_lowering.py: each kernel lookup recorded, nothing compiled), and every kernel they
lower to must be a variant of that suite; a failure names each missing config and the GPU tests
that need it. A call that would fall back to the reference fails too (as it does on the GPU,
tests/gpu/conftest.py), so every call is checked on the kernels it runs there.

The calls, taken from the GPU tests' own data and code wherever it can be done without running:

* the extreme-numerics cases (tests/extreme_cases.py, each at its dtype): the GPU test's problem
  and call, forward and, where differentiable, the gradient of out and lse;
* tests/gpu/test_sm90_bwd.py's case lists: its jitted backward chains (the table's kernel, the
  deterministic one, each opt-in form of the swap cases);
* the GPU tests that go through a runner (test_varlen.py's ``run_varlen_case`` and
  ``run_varlen_grad_case``, test_paged.py's ``run_paged_case``, test_segments.py's ``run``, also
  from test_single_rounding.py, test_fp8.py's ``run_fp8_paged_case`` and
  ``run_fp8_varlen_case``): each is called with each of its parameters, the runner replaced by
  one that lowers the runner's call (its arguments, shapes and options) instead of running it;
* the padding-isolation cases, the sanitizer case groups (tests/gpu/sanitizer_cases.py) and the
  GPU tests that take a gradient in their own body (:data:`GRADIENT_TESTS`): their code runs with
  ``jax.jit`` standing in (:class:`_Jax`: a jitted call is lowered, not run; random inputs are
  zeros), up to the first jitted call, or to the end where only finiteness is checked;
* the explicit examples of tests/gpu/test_properties.py: the programs tests/attention_properties.py
  would run (its drawn cases are not covered: they range over every shipped bfloat16 kernel);
* the parametrized forward calls of tests/gpu/test_max_logits.py and test_fp8.py, rebuilt from
  their parameters;
* tests/gpu/test_dot_product_attention.py's calls, from its case table and call builder.

The backward kernels those calls reach through the API come from
``jax_fa4.tools.variants.GPU_API_BACKWARD``, a table of problem kinds by GPU test module; the same
test keeps each of its entries exactly what its module's calls reach. The conformance cases are
checked by tests/test_conformance.py (``test_gpu_suite_holds_every_kernel_of_the_cases``).
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from cuda_lowering import lower_for_cuda, placeholder
from jax_fa4.backends import base
from jax_fa4.tools.variants import GPU_API_BACKWARD, Variant, backward_kind, variants

ARCH = "sm_90a"
HOPPER = "9.0"  # the GPU suite's device: implementation=None picks sm90 there
F32 = jnp.float32


def _spec(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


@functools.cache
def _suite() -> frozenset[Variant]:
    return frozenset(variants("tests", archs=[ARCH]))


def _refuse_fallback(what: str, implementation: str, reason: str) -> None:
    raise AssertionError(f"the {what} would run the reference instead of the {implementation} "
                         f"kernels ({reason}); on the GPU (JAX_FA4_REQUIRE_GPU=1) that fails")


class Needs:
    """The kernels (variant -> the GPU tests asking for it) of the calls lowered so far."""

    def __init__(self) -> None:
        self.tests: dict[Variant, list[str]] = {}
        self.calls = 0

    def lower(self, test: str, program: Callable, *args) -> None:
        """Lower ``jax.jit(program)(*args)`` for CUDA as the GPU test ``test`` runs it."""
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(base, "reference_fallback", _refuse_fallback)
            try:
                lowered = lower_for_cuda(program, *args, compute_capability=HOPPER)
            except AssertionError as err:
                raise AssertionError(f"{test}: {err}") from None
        assert lowered.kernels, f"{test}: the call lowers to no kernel"
        assert sorted(lowered.objects) == sorted(placeholder(c, a) for c, a in lowered.kernels)
        self.calls += 1
        for config, arch in lowered.kernels:
            tests = self.tests.setdefault(Variant(config, arch), [])
            if test not in tests:
                tests.append(test)

    def missing(self) -> list[str]:
        """One entry per kernel outside the ``tests`` suite: its config (and for a backward main
        kernel its problem kind, in GPU_API_BACKWARD's notation) and the tests."""
        suite = _suite()
        out = []
        for v, tests in self.tests.items():
            if v not in suite:
                kind = (f" (kind {backward_kind(v.config)!r})"
                        if v.config.kernel_name == "sm90_bwd" else "")
                out.append(f"{v.describe()}{kind}\n    needed by: {', '.join(tests)}")
        return out

    def backward_kinds(self) -> dict[str, set[str]]:
        """GPU test module -> the backward kinds (GPU_API_BACKWARD's notation) its calls reach."""
        out: dict[str, set[str]] = {}
        for variant, tests in self.tests.items():
            if variant.config.kernel_name == "sm90_bwd":
                for test in tests:
                    out.setdefault(test.split("::")[0], set()).add(backward_kind(variant.config))
        return out


# -- parameters and runners of GPU test functions -----------------------------------------------
def parametrizations(test: Callable) -> list[tuple[str, dict]]:
    """(id, keyword arguments) of every combination of ``test``'s parametrize marks."""
    axes = []
    for mark in getattr(test, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names, values = mark.args[:2]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        combos = []
        for value in values:
            if hasattr(value, "marks") and hasattr(value, "values"):  # pytest.param(...)
                value = value.values
            elif len(names) == 1:
                value = (value,)
            combos.append(dict(zip(names, value, strict=True)))
        axes.append(combos)
    out = []
    for combo in itertools.product(*axes):
        kwargs = {k: v for part in combo for k, v in part.items()}
        out.append((",".join(f"{k}={v!r}" for k, v in kwargs.items()), kwargs))
    return out


def _node(module, test: Callable, params: str = "") -> str:
    path = module.__name__.replace(".", "/") + ".py"
    return f"{path}::{test.__name__}" + (f"[{params}]" if params else "")


def runner_tests(module, runners: set[str]) -> list[Callable]:
    """The test functions of ``module`` that call one of ``runners`` (by name)."""
    found = [fn for name, fn in vars(module).items()
             if name.startswith("test_") and getattr(fn, "__module__", None) == module.__name__
             and runners & set(fn.__code__.co_names)]
    assert found, f"no test of {module.__name__} calls {sorted(runners)}"
    return found


def run_through_runners(needs: Needs, module, replacements: dict[str, Callable],
                        patch_in: tuple = ()) -> None:
    """Call every test of ``module`` that calls a runner of ``replacements`` (name -> function
    taking ``(needs, test id, the runner's bound arguments)``) with each of its
    parametrizations, the runners replaced (where ``module`` or a module of ``patch_in`` has
    them) by ones that lower the runner's call instead of running it."""
    targets = list(dict.fromkeys((module, *patch_in)))
    originals = {(target, name): getattr(target, name) for target in targets
                 for name in replacements if hasattr(target, name)}
    for test in runner_tests(module, set(replacements)):
        for params, kwargs in parametrizations(test):
            node = _node(module, test, params)
            with pytest.MonkeyPatch.context() as mp:
                for (target, name), original in originals.items():
                    mp.setattr(target, name, _lowering_runner(needs, node, original,
                                                              replacements[name]))
                if "monkeypatch" in inspect.signature(test).parameters:
                    kwargs = {**kwargs, "monkeypatch": mp}
                test(**kwargs)


def _lowering_runner(needs: Needs, node: str, original: Callable, replacement: Callable):
    """A stand-in for the runner ``original`` that passes its bound arguments (defaults
    applied) to ``replacement``."""
    signature = inspect.signature(original)

    def runner(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        replacement(needs, node, bound.arguments)

    return runner


# -- the runners' calls -------------------------------------------------------------------------
def _varlen_call(needs: Needs, node: str, a: dict, grad: bool) -> None:
    """tests/gpu/test_varlen.py's run_varlen_case / run_varlen_grad_case, lowered."""
    from tests.gpu import test_varlen

    pad = test_varlen.PAD_FRONT + test_varlen.PAD_BACK
    tq, tk = pad + sum(a["lens_q"]), pad + sum(a["lens_k"])
    h, hkv, d, dv, dtype = a["h"], a["hkv"], a["d"], a["dv"], a["dtype"]
    n = len(a["lens_q"]) + 1
    sink = a["sink"] if grad else (True if a["sink"] else None)
    args = (_spec((tq, h, d), dtype), _spec((tk, hkv, d), dtype), _spec((tk, hkv, dv), dtype),
            _spec((n,), jnp.int32), _spec((n,), jnp.int32), _spec((h,), F32))
    kw = {"causal": a["causal"], "window_size": a["window"], "softcap": a["softcap"],
          "implementation": "sm90"}

    def attend(q, k, v, cu_q, cu_k, s, **extra):
        return jax_fa4.flash_attention_varlen(
            q, k, v, cu_q, cu_k, max(a["lens_q"]), max(a["lens_k"]),
            learnable_sink=None if sink is None else s, **kw, **extra)

    if grad:
        program = jax.grad(lambda q, k, v, cu_q, cu_k, s: jnp.sum(
            attend(q, k, v, cu_q, cu_k, s).astype(F32)), argnums=(0, 1, 2, 5))
    else:
        program = functools.partial(attend, return_lse=True)
    needs.lower(node, program, *args)


def _paged_call(needs: Needs, node: str, a: dict) -> None:
    """tests/gpu/test_paged.py's run_paged_case, lowered."""
    b, h, hkv, page, pages = a["b"], a["h"], a["hkv"], a["page_size"], a["max_pages"]
    num_pages = b * pages + 3
    args = (_spec((b, a["sq"], h, a["d"]), a["dtype"]),
            _spec((num_pages, page, hkv, a["d"]), a["dtype"]),
            _spec((num_pages, page, hkv, a["dv"]), a["dtype"]),
            _spec((b, pages), jnp.int32), _spec((b,), jnp.int32), _spec((h,), F32))
    needs.lower(node, lambda q, kc, vc, table, used, s: jax_fa4.flash_attention_paged(
        q, kc, vc, table, used, causal=a["causal"], window_size=a["window"],
        softcap=a["softcap"], learnable_sink=s if a["sink"] else None, return_lse=True,
        implementation="sm90"), *args)


def _fp8_paged_call(needs: Needs, node: str, a: dict) -> None:
    """tests/gpu/test_fp8.py's run_fp8_paged_case, lowered (an e4m3 cache; q e4m3 with its
    descale, or bfloat16 quantised by the call)."""
    b, h, hkv, d, page, pages = a["b"], a["h"], a["hkv"], a["d"], a["page_size"], a["max_pages"]
    e4m3 = jnp.float8_e4m3fn
    num_pages = b * pages + 3
    args = (_spec((b, a["sq"], h, d), jnp.bfloat16 if a["q16"] else e4m3),
            _spec((num_pages, page, hkv, d), e4m3), _spec((num_pages, page, hkv, d), e4m3),
            _spec((b, pages), jnp.int32), _spec((b,), jnp.int32), _spec((b, hkv), F32),
            _spec((hkv,), F32), _spec((hkv,), F32))
    window = (None, 0) if a["causal"] else a["window"]
    needs.lower(node, lambda q, kc, vc, table, used, qd, kd, vd: jax_fa4.flash_attention_paged(
        q, kc, vc, table, used, q_descale=None if a["q16"] else qd, k_descale=kd, v_descale=vd,
        window_size=window, softcap=a["softcap"], return_lse=True, implementation="sm90"),
        *args)


def _fp8_varlen_call(needs: Needs, node: str, a: dict) -> None:
    """tests/gpu/test_fp8.py's run_fp8_varlen_case, lowered (packed e4m3 q, k, v)."""
    from tests.gpu import test_fp8

    pad = test_fp8.PAD_FRONT + test_fp8.PAD_BACK
    tq, tk = pad + sum(a["lens_q"]), pad + sum(a["lens_k"])
    h, hkv, d, n = a["h"], a["hkv"], a["d"], len(a["lens_q"])
    e4m3 = jnp.float8_e4m3fn
    args = (_spec((tq, h, d), e4m3), _spec((tk, hkv, d), e4m3), _spec((tk, hkv, d), e4m3),
            _spec((n + 1,), jnp.int32), _spec((n + 1,), jnp.int32),
            *(_spec((n, hkv), F32) for _ in range(3)))
    window = (None, 0) if a["causal"] else a["window"]
    needs.lower(node, lambda q, k, v, cu_q, cu_k, qd, kd, vd: jax_fa4.flash_attention_varlen(
        q, k, v, cu_q, cu_k, max(a["lens_q"]), max(a["lens_k"]), q_descale=qd, k_descale=kd,
        v_descale=vd, window_size=window, softcap=a["softcap"], return_lse=True,
        implementation="sm90"), *args)


def _segments_call(needs: Needs, node: str, a: dict) -> None:
    """tests/gpu/test_segments.py's run, lowered (the gradient too with ``grads``)."""
    (b, sq), sk = a["q_ids"].shape, a["kv_ids"].shape[1]
    h, hkv, d, dtype = a["h"], a["hkv"], a["d"], a["dtype"]
    args = (_spec((b, sq, h, d), dtype), _spec((b, sk, hkv, d), dtype),
            _spec((b, sk, hkv, d), dtype), _spec((h,), F32),
            _spec((b, sq), jnp.int32), _spec((b, sk), jnp.int32))

    def kernel(q, k, v, s, q_ids, kv_ids):
        return jax_fa4.flash_attention(
            q, k, v, segment_ids=(q_ids, kv_ids), learnable_sink=s if a["sink"] else None,
            return_lse=True, implementation="sm90", causal=a["causal"],
            window_size=a["window"], softcap=a["softcap"])

    needs.lower(node, kernel, *args)
    if a["grads"]:
        argnums = (0, 1, 2, 3) if a["sink"] else (0, 1, 2)
        needs.lower(node, jax.grad(lambda *x: jnp.sum(kernel(*x)[0].astype(F32)),
                                   argnums=argnums), *args)


# -- GPU code run with jax.jit lowering instead of running ---------------------------------------
class _Lowered(Exception):
    """Stops a check once its library call is lowered (nothing else of it runs here)."""


class _Random:
    """``jax.random`` with zeros for its draws (only their shapes reach the lowered calls)."""

    def __getattr__(self, name):
        return getattr(jax.random, name)

    @staticmethod
    def normal(key, shape=(), dtype=F32):
        return np.zeros(shape, dtype)

    @staticmethod
    def uniform(key, shape=(), dtype=F32, minval=0.0, maxval=1.0):
        return np.zeros(shape, dtype)


class _Jax:
    """``jax`` for a GPU module's code: ``jax.jit(f)`` lowers f for CUDA into ``needs`` when
    called (or ``.lower``-ed) and then, with ``stop``, raises :class:`_Lowered` (the rest of a
    test compares against the reference, nothing to lower), else returns zeros of f's outputs
    (code that only checks its results are finite runs on)."""

    def __init__(self, needs: Needs, node: str, stop: bool) -> None:
        self.needs, self.node, self.stop = needs, node, stop
        self.random = _Random()

    def __getattr__(self, name):
        return getattr(jax, name)

    def jit(self, fn: Callable, static_argnums=(), **_) -> Callable:
        static = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
        stand_in = self

        def lower(*args, **kwargs):
            fixed = {i: a for i, a in enumerate(args) if i in static}
            traced = [a for i, a in enumerate(args) if i not in static] + list(kwargs.values())

            def program(*xs):
                it = iter(xs)
                positional = [fixed[i] if i in fixed else next(it) for i in range(len(args))]
                return fn(*positional, **{name: next(it) for name in kwargs})

            jitted = jax.jit(program)  # (its trace for the lowering gives the shapes too)
            stand_in.needs.lower(stand_in.node, jitted, *traced)
            if stand_in.stop:
                raise _Lowered
            return _Zeros(jitted.eval_shape(*traced))

        def call(*args, **kwargs):
            return lower(*args, **kwargs)()

        call.lower = lower
        return call


class _Zeros:
    """A stand-in compiled program: returns zeros of its outputs' shapes, whatever its inputs."""

    def __init__(self, shapes) -> None:
        self.shapes = shapes

    def compile(self) -> _Zeros:
        return self

    def __call__(self, *args, **kwargs):
        return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), self.shapes)


def run_standing_in(needs: Needs, node: str, modules: tuple, run: Callable, *,
                    stop: bool) -> None:
    """``run()`` with ``jax`` in ``modules`` replaced by :class:`_Jax` (``stop``: until the first
    jitted call, which must come) and their ``poison_device_memory`` doing nothing."""
    with pytest.MonkeyPatch.context() as mp:
        for module in modules:
            mp.setattr(module, "jax", _Jax(needs, node, stop))
            if hasattr(module, "poison_device_memory"):  # (no device memory to fill)
                mp.setattr(module, "poison_device_memory", lambda *args, **kwargs: None)
        if not stop:
            run()
            return
        with pytest.raises(_Lowered):
            run()


# -- the groups of GPU tests --------------------------------------------------------------------
def extreme_numerics(needs: Needs) -> None:
    from extreme_cases import CASES, make_problem
    from tests.gpu import test_extreme_numerics as module

    for case in CASES:
        pb = make_problem(case, "sm90")
        node = _node(module, module.test_extreme_case_sm90, case.name)
        needs.lower(node, lambda args, sink, pb=pb: pb.call(*args, sink), pb.args, pb.sink)
        if not case.differentiable:
            continue

        def loss(q, k, v, sink, rest, pb=pb):
            out, lse = pb.call(q, k, v, *rest, sink)
            return jnp.sum(out.astype(F32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

        argnums = (0, 1, 2) if pb.sink is None else (0, 1, 2, 3)
        needs.lower(node, jax.grad(loss, argnums=argnums), *pb.args[:3], pb.sink, pb.args[3:])


def sm90_backward_lists(needs: Needs) -> None:
    from tests.gpu import test_sm90_bwd as module

    def shapes(c):
        return (_spec((c.b, c.sq, c.h, c.d), c.dtype), _spec((c.b, c.sk, c.hkv, c.d), c.dtype),
                _spec((c.b, c.sk, c.hkv, c.dv), c.dtype), _spec((c.b, c.sq, c.h, c.dv), c.dtype),
                _spec((c.b, c.h, c.sq), F32), _spec((c.b, c.sq, c.h, c.dv), c.dtype))

    def chain(test, c, opts, form=None):
        node = _node(module, test, module._id(c) + (f",{form}" if form else ""))
        if form is None:
            program = functools.partial(module.sm90_backward, opts=opts)
        else:
            q, k, v = shapes(c)[:3]
            main, _ = jax_fa4.backends.get("sm90").backward_configs(q, k, v, opts)
            program = functools.partial(module.sm90_backward_config, opts=opts,
                                        config=module.OPT_IN_FORMS[form](main))
        needs.lower(node, program, *shapes(c))

    for c in module.CASES:
        chain(module.test_backward_matches_reference, c,
              module.Opts(1.0 / c.d ** 0.5, c.window, c.softcap))
    for c in module.DETERMINISTIC_CASES:
        chain(module.test_deterministic_kernel_is_bitwise_repeatable, c,
              module.DetOpts(1.0 / c.d ** 0.5, c.window, c.softcap))
    for c, form in itertools.product(module.SWAP_CASES, module.OPT_IN_FORMS):
        chain(module.test_opt_in_kernel_matches_reference, c,
              module.Opts(1.0 / c.d ** 0.5, c.window, c.softcap), form)
    for (c, grouped), lookahead in itertools.product(module.PAIR_FORMS, (False, True)):
        node = _node(module, module.test_pair_kernel_matches_reference,
                     f"{module._id(c)}{'-group' if grouped else ''}-{lookahead}")
        program = functools.partial(module.sm90_backward_config,
                                    opts=module.Opts(1.0 / c.d ** 0.5, c.window, c.softcap),
                                    config=module._pair_config(c, lookahead, grouped))
        needs.lower(node, program, *shapes(c))


def padding_isolation(needs: Needs) -> None:
    import padding_checks
    from tests.gpu import test_padding_isolation as module

    for test, cases in ((module.test_varlen_padding_isolated, module.VARLEN_CASES),
                        (module.test_paged_padding_isolated, module.PAGED_CASES)):
        for case in cases:
            with pytest.MonkeyPatch.context() as mp:  # (the poisoned copies are not lowered)
                mp.setattr(padding_checks, "poison", lambda x, padding: x)
                run_standing_in(needs, _node(module, test, case), (padding_checks,),
                                functools.partial(test, case), stop=True)


def property_examples(needs: Needs) -> None:
    import attention_properties
    from tests.gpu import test_properties as module

    for test in vars(module).values():
        for example in getattr(test, "hypothesis_explicit_examples", ()):
            node = _node(module, test, repr(example.args or example.kwargs))

            def lower(fn, *args, node=node, **_):
                needs.lower(node, fn, *args)
                raise _Lowered

            with pytest.MonkeyPatch.context() as mp, pytest.raises(_Lowered):
                mp.setattr(attention_properties, "_run", lower)
                test.hypothesis.inner_test(*example.args, **example.kwargs)


def runner_based(needs: Needs) -> None:
    from tests.gpu import test_fp8, test_paged, test_segments, test_single_rounding, test_varlen

    replacements = {
        "run_varlen_case": lambda n, node, a: _varlen_call(n, node, a, grad=False),
        "run_varlen_grad_case": lambda n, node, a: _varlen_call(n, node, a, grad=True),
        "run_paged_case": _paged_call,
    }
    for module in (test_varlen, test_paged, test_single_rounding):
        run_through_runners(needs, module, replacements, patch_in=(test_varlen, test_paged))
    run_through_runners(needs, test_segments, {"run": _segments_call})
    run_through_runners(needs, test_fp8, {"run_fp8_paged_case": _fp8_paged_call,
                                          "run_fp8_varlen_case": _fp8_varlen_call})


def forward_parameters(needs: Needs) -> None:
    """test_max_logits.py's and test_fp8.py's parametrized forward calls."""
    from tests.gpu import test_fp8, test_max_logits

    for params, p in parametrizations(test_max_logits.test_dense):
        b, dt, d, h, hkv = 2, p["dtype"], p["d"], p["h"], p["hkv"]
        args = (_spec((b, p["sq"], h, d), dt), _spec((b, p["sk"], hkv, d), dt),
                _spec((b, p["sk"], hkv, d), dt), _spec((h,), F32))
        needs.lower(_node(test_max_logits, test_max_logits.test_dense, params),
                    lambda q, k, v, s, p=p: jax_fa4.flash_attention(
                        q, k, v, learnable_sink=s if p["sink"] else None, return_lse=True,
                        return_max_logits=True, implementation="sm90", causal=p["causal"],
                        window_size=p["window"], softcap=p["softcap"]), *args)
    for params, p in parametrizations(test_fp8.test_fp8_forward):
        b, d, h, hkv = p["b"], p["d"], p["h"], p["hkv"]
        fp8 = jnp.float8_e4m3fn
        args = (_spec((b, p["sq"], h, d), fp8), _spec((b, p["sk"], hkv, d), fp8),
                _spec((b, p["sk"], hkv, d), fp8), _spec((b, hkv), F32), _spec((b, hkv), F32),
                _spec((b, hkv), F32))
        window = (None, 0) if p["causal"] else p["window"]
        needs.lower(_node(test_fp8, test_fp8.test_fp8_forward, params),
                    lambda q, k, v, qd, kd, vd, p=p, window=window: jax_fa4.flash_attention(
                        q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, window_size=window,
                        softcap=p["softcap"], return_lse=True, implementation="sm90"), *args)


def dot_product_attention_cases(needs: Needs) -> None:
    """tests/gpu/test_dot_product_attention.py's jitted calls, each lowered."""
    from tests.gpu import test_dot_product_attention as module

    test = module.test_lowers_to_kernels_and_matches_jax_nn
    for case, ((b, t, s, n, kh, h), _, _) in module.CASES.items():
        args = (_spec((b, t, n, h), jnp.bfloat16), _spec((b, s, kh, h), jnp.bfloat16),
                _spec((b, s, kh, h), jnp.bfloat16), module.lengths(case, spec=True))
        needs.lower(_node(module, test, case), module.attend(case), *args)


def sanitizer_cases(needs: Needs) -> None:
    """Every case group of tests/gpu/sanitizer_cases.py (run under compute-sanitizer by
    test_sanitizers.py), its jitted calls lowered; its checks (finite results) see zeros."""
    from tests.gpu import sanitizer_cases as module

    for group in module.GROUPS:
        node = f"tests/gpu/sanitizer_cases.py::main[{group}]"  # (test_sanitizers.py runs it)
        run_standing_in(needs, node, (module,), lambda group=group: module.main([group]),
                        stop=False)


#: GPU tests that take gradients in their own body (no runner, no case list): each runs up to
#: its first jitted call, the kernels' (its inputs drawn as zeros; their helpers' modules too).
GRADIENT_TESTS = {
    "tests.gpu.test_single_rounding": ("test_sink_forward_backward_random",),
    "tests.gpu.test_sm90_bwd": ("test_grad_through_the_api_matches_the_reference",
                                "test_deterministic_grads_are_bitwise_repeatable",
                                "test_sink_grad_through_the_api_matches_the_reference"),
    "tests.gpu.test_preprocess": ("test_grad_through_api_uses_kernel_and_matches_reference",
                                  "test_deterministic_gradients_are_bitwise_equal"),
    "tests.gpu.test_max_logits": ("test_gradient_is_unchanged",),
}


def gradient_tests(needs: Needs) -> None:
    import importlib

    from tests.gpu import test_sm90_fwd

    for name, tests in GRADIENT_TESTS.items():
        module = importlib.import_module(name)
        for test in (getattr(module, t) for t in tests):
            for params, kwargs in parametrizations(test):
                run_standing_in(needs, _node(module, test, params), (module, test_sm90_fwd),
                                functools.partial(test, **kwargs), stop=True)


GROUPS: dict[str, Callable[[Needs], None]] = {
    "extreme_numerics": extreme_numerics,
    "sm90_backward_lists": sm90_backward_lists,
    "runner_based": runner_based,
    "padding_isolation": padding_isolation,
    "sanitizer_cases": sanitizer_cases,
    "gradient_tests": gradient_tests,
    "property_examples": property_examples,
    "forward_parameters": forward_parameters,
    "dot_product_attention": dot_product_attention_cases,
}
#: The groups whose calls go through the API (test_sm90_bwd.py's lists call the backend with
#: the configs of variants.SM90_BWD_GPU_*)
API_GROUPS = [g for g in GROUPS if g != "sm90_backward_lists"]


@functools.cache
def _needs(group: str) -> Needs:
    needs = Needs()
    GROUPS[group](needs)
    return needs


def test_gpu_suite_kernels_are_in_the_tests_suite():
    """Every kernel the calls of each group lower to is in the ``tests`` suite; and each entry of
    variants.GPU_API_BACKWARD is exactly the backward kinds its module's calls reach: none
    missing (the first check would name its kernels), none no longer reached (a kernel the GPU
    run would compile for nothing). One test for both: the second reads the first's lowerings
    (two tests, given to two pytest-xdist workers, would each lower every group)."""
    problems = []
    for group in GROUPS:
        needs = _needs(group)
        assert needs.calls and needs.tests, f"{group}: no call lowered to a kernel"
        missing = needs.missing()
        if missing:
            problems.append(f"{group}: {len(missing)} kernels the GPU suite runs are not in the "
                            "tests suite of jax_fa4.tools.variants (precompile --suite tests):\n"
                            + "\n".join(missing))
    reached: dict[str, set[str]] = {}
    for group in API_GROUPS:
        for module, kinds in _needs(group).backward_kinds().items():
            reached.setdefault(module, set()).update(kinds)
    backward = []
    for module in sorted(reached.keys() | GPU_API_BACKWARD.keys()):
        have, listed = reached.get(module, set()), set(GPU_API_BACKWARD.get(module, ()))
        if have - listed:
            backward.append(f"{module}: add {sorted(have - listed)}")
        if listed - have:
            backward.append(f"{module}: reached by none of its calls: {sorted(listed - have)}")
    if backward:
        problems.append("jax_fa4.tools.variants.GPU_API_BACKWARD is not what the GPU tests "
                        "reach:\n" + "\n".join(backward))
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)
