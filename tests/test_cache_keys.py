"""Cache keys come from each kernel's import closure; configs never import kernels; no import
cycle anywhere in the package. Static (``ast``): nothing here compiles or imports cutlass.

An import counts wherever it is written (module level, inside functions, under ``if``), as
:mod:`jax_fa4.ffi.sources` reads them: a function-level import that closes a circle is a cycle
too.
"""

from __future__ import annotations

import shutil

import pytest

from jax_fa4.ffi import sources
from jax_fa4.ffi.cache import TOOLCHAIN_FILES, kernel_source_files, kernel_source_fingerprint
from jax_fa4.kernels import registry
from jax_fa4.kernels.exp2_probe_config import Exp2ProbeConfig
from jax_fa4.kernels.preprocess_config import PreprocessConfig
from jax_fa4.kernels.sm90 import bwd_config, fwd_config
from jax_fa4.kernels.sm90.bwd_pair_config import BwdPairConfig
from jax_fa4.kernels.sm100 import bwd_config as sm100_bwd_config
from jax_fa4.kernels.sm100 import fwd_config as sm100_fwd_config
from jax_fa4.kernels.sm100.bwd_split_config import Sm100BwdSplitConfig
from jax_fa4.tools.variants import FAMILIES

#: Import cycles the package is allowed: none (the last two, ``api`` <-> ``varlen`` and the backward
#: ops' circle through ``ops``, went with the backends redesign).
KNOWN_PACKAGE_CYCLES: set[tuple[str, ...]] = set()

#: One config of every registered kernel kind.
CONFIGS = {
    "bwd_preprocess": PreprocessConfig("bfloat16", 128),
    "sm90_fwd": fwd_config.FwdConfig.make("bfloat16", 128),
    "sm90_bwd": bwd_config.BwdConfig.make("bfloat16", 128),
    "sm90_bwd_postprocess": bwd_config.BwdConfig.make("bfloat16", 128).postprocess_config(),
    "sm90_bwd_pair": BwdPairConfig.of(bwd_config.BwdConfig.make("bfloat16", 256)),
    "sm100_fwd": sm100_fwd_config.FwdConfig.make("bfloat16", 128),
    "sm100_bwd": sm100_bwd_config.Sm100BwdConfig.make("bfloat16", 128),
    "sm100_bwd_split": Sm100BwdSplitConfig.make("dkdv", "bfloat16", 256),
    "exp2_probe": Exp2ProbeConfig(),
}

_K = "jax_fa4/kernels/"
_SPEC = {_K + "spec.py", *TOOLCHAIN_FILES}
_SEG = {_K + "segments_config.py"}
_VARLEN_BWD = {_K + "varlen_bwd_config.py"}  # the varlen backward's shared call contract
_FWD_SIGS = {_K + "forward_signatures_config.py"}
_COMMON_FWD = {_K + f"common/{m}.py" for m in ("convert", "exp2", "layout", "views")}
#: The files each kernel kind's key hashes (its launcher's import closure and the toolchain).
EXPECTED_FILES = {
    "bwd_preprocess": _SPEC | {_K + "preprocess.py", _K + "preprocess_config.py"},
    "sm90_fwd": _SPEC | _SEG | _FWD_SIGS | _COMMON_FWD | {_K + f"common/{m}.py" for m in (
        "geometry", "mask", "rows", "scores", "softmax", "tile_scheduler")} | {
        _K + "sm90/flash_fwd.py", _K + "sm90/common.py", _K + "sm90/fwd_config.py",
        _K + "sm90/v_transpose.py", _K + "sm90/v_transpose_plan.py"},
    "sm90_bwd": _SPEC | _SEG | _VARLEN_BWD | {_K + f"common/{m}.py" for m in (
        "geometry", "convert", "layout", "operands", "rows", "scores", "views")} | {
        _K + "sm90/bwd.py", _K + "sm90/bwd_common.py", _K + "sm90/common.py",
        _K + "sm90/bwd_config.py"},
    # the pair reuses the one-CTA kernel's pieces (bwd.py) and has a key of its own
    "sm90_bwd_pair": _SPEC | _SEG | _VARLEN_BWD | {_K + f"common/{m}.py" for m in (
        "cluster", "geometry", "convert", "layout", "operands", "rows", "scores", "views")} | {
        _K + f"sm90/{m}.py" for m in ("bwd", "bwd_common", "common", "bwd_config", "bwd_pair",
                                      "bwd_pair_config")},
    "sm90_bwd_postprocess": _SPEC | _SEG | _VARLEN_BWD | {_K + f"common/{m}.py" for m in (
        "convert", "geometry", "layout", "rows", "views")} | {
        _K + "sm90/bwd_postprocess.py", _K + "sm90/bwd_common.py", _K + "sm90/common.py",
        _K + "sm90/bwd_config.py"},
    "sm100_fwd": _SPEC | _SEG | _FWD_SIGS | _COMMON_FWD | {
        _K + "common/geometry.py", _K + "common/scores.py", _K + "common/softmax.py",
        _K + "sm100/flash_fwd.py",
        _K + "sm100/fwd_config.py", _K + "sm100/tile_order.py"},
    "sm100_bwd": _SPEC | _SEG | _VARLEN_BWD | {_K + f"common/{m}.py" for m in (
        "geometry", "convert", "layout", "rows", "scores", "views")} | {
        _K + f"sm100/{m}.py" for m in ("bwd", "bwd_2cta", "bwd_config", "bwd_launcher")},
    # the split backward reuses the fused kernel's compute pieces (bwd.py), not its launcher
    "sm100_bwd_split": _SPEC | _SEG | _VARLEN_BWD | {_K + f"common/{m}.py" for m in (
        "geometry", "convert", "layout", "rows", "scores", "views")} | {
        _K + f"sm100/{m}.py" for m in ("bwd", "bwd_config", "bwd_split", "bwd_split_config")},
    "exp2_probe": _SPEC | {_K + "common/exp2.py", _K + "exp2_probe.py",
                           _K + "exp2_probe_config.py"},
}


def test_every_kernel_kind_has_a_launcher_module():
    assert set(CONFIGS) == set(registry.LAUNCHERS) == set(EXPECTED_FILES)
    assert set(FAMILIES) <= set(registry.LAUNCHERS)
    for kind, config in CONFIGS.items():
        assert config.kernel_name == kind
        module = registry.launcher_module(config)
        text = sources.module_file(module).read_text()
        assert "\ndef make_launcher(" in text, f"{module} defines no make_launcher"


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_key_hashes_the_launchers_import_closure(kind):
    files = set(kernel_source_files(CONFIGS[kind]))
    assert files == EXPECTED_FILES[kind]
    arch_dir = "sm100/" if kind.startswith("sm90") else "sm90/"
    assert not any(arch_dir in f for f in files), f"{kind} hashes another arch's kernels"


def test_configs_and_registry_import_no_kernel_module():
    """A config (and the registry, and the cache) imports only configs and spec, even in
    functions: the runtime path never imports a kernel, and no kernel/config cycle can form."""
    graph = sources.import_graph()
    config_like = {m for m in graph if m.endswith("_config")} | {"jax_fa4.kernels.spec"}
    for module in [*config_like, "jax_fa4.kernels.registry"]:
        assert set(sources.closure(module)) - config_like <= {module}, module
    cache_closure = set(sources.closure("jax_fa4.ffi.cache"))
    assert not {m for m in cache_closure if m.startswith("jax_fa4.kernels.")} - config_like - {
        "jax_fa4.kernels.registry"}


def _package_copy(tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(sources.ROOT / "jax_fa4", root / "jax_fa4",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _keys(root=sources.ROOT):
    return {k: kernel_source_fingerprint(c, root) for k, c in CONFIGS.items()}


def test_keys_do_not_depend_on_where_the_package_lies(tmp_path):
    """Only the files' contents and paths below the root count: a checkout and an installed
    copy of the same sources share their cache entries."""
    assert _keys(_package_copy(tmp_path)) == _keys()


@pytest.mark.parametrize("edited, rekeyed", [
    ("kernels/sm100/tile_order.py", {"sm100_fwd"}),
    ("kernels/sm100/bwd_2cta.py", {"sm100_bwd"}),
    ("kernels/sm90/bwd_common.py", {"sm90_bwd", "sm90_bwd_postprocess", "sm90_bwd_pair"}),
    ("kernels/sm90/common.py", {"sm90_fwd", "sm90_bwd", "sm90_bwd_postprocess",
                                "sm90_bwd_pair"}),
    ("kernels/common/views.py", {"sm90_fwd", "sm90_bwd", "sm90_bwd_postprocess", "sm90_bwd_pair",
                                 "sm100_fwd",
                                 "sm100_bwd", "sm100_bwd_split"}),
    ("kernels/common/geometry.py", {"sm90_fwd", "sm90_bwd", "sm90_bwd_postprocess",
                                    "sm90_bwd_pair", "sm100_fwd",
                                    "sm100_bwd", "sm100_bwd_split"}),
    ("kernels/common/mask.py", {"sm90_fwd"}),
    ("kernels/common/scores.py", {"sm90_fwd", "sm90_bwd", "sm90_bwd_pair", "sm100_fwd", "sm100_bwd",
                                  "sm100_bwd_split"}),
    ("kernels/sm100/bwd_split.py", {"sm100_bwd_split"}),
    ("kernels/sm100/bwd.py", {"sm100_bwd", "sm100_bwd_split"}),
    ("kernels/sm90/fwd_config.py", {"sm90_fwd"}),
    ("kernels/sm90/bwd.py", {"sm90_bwd", "sm90_bwd_pair"}),  # (the pair reuses its pieces)
    ("kernels/sm90/bwd_pair.py", {"sm90_bwd_pair"}),
    ("kernels/common/cluster.py", {"sm90_bwd_pair"}),
    ("kernels/sm90/fwd_tuning.py", set()),  # a tuning table: only the configs it changes
    ("kernels/sm90/bwd_tuning.py", set()),
    ("kernels/sm100/fwd_tuning.py", set()),
    ("kernels/sm100/bwd_tuning.py", set()),
    ("kernels/segments_config.py", {"sm90_fwd", "sm90_bwd", "sm90_bwd_postprocess", "sm90_bwd_pair",
                                    "sm100_fwd", "sm100_bwd", "sm100_bwd_split"}),
    ("kernels/common/softmax.py", {"sm90_fwd", "sm100_fwd"}),
    ("kernels/forward_signatures_config.py", {"sm90_fwd", "sm100_fwd"}),
    ("kernels/common/exp2.py", {"sm90_fwd", "sm100_fwd", "exp2_probe"}),
    ("kernels/spec.py", set(CONFIGS)),
    ("ffi/compiler.py", set(CONFIGS)),
    ("api.py", set()),
])
def test_editing_a_file_rekeys_exactly_the_kernels_that_import_it(tmp_path, edited, rekeyed):
    root = _package_copy(tmp_path)
    with open(root / "jax_fa4" / edited, "a") as f:
        f.write("# an edit\n")
    before, after = _keys(), _keys(root)
    assert {k for k in CONFIGS if after[k] != before[k]} == rekeyed


def test_no_import_cycle_in_kernels_or_binding():
    found = sources.cycles(sources.import_graph())
    local = [c for c in found
             if any(m.startswith(("jax_fa4.kernels.", "jax_fa4.ffi.")) for m in c)]
    assert not local, f"import cycles through the kernels or the binding: {local}"


def test_no_import_cycle_in_the_package():
    """The whole package, function-level imports included, is cycle-free."""
    graph = sources.import_graph()
    assert "jax_fa4.backends.base" in graph and "jax_fa4.autodiff" in graph  # the graph is whole
    found = set(sources.cycles(graph))
    assert found == KNOWN_PACKAGE_CYCLES, f"import cycles in jax_fa4: {sorted(found)}"


def test_closure_follows_relative_and_function_level_imports(tmp_path):
    pkg = tmp_path / "jax_fa4"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("import jax_fa4.top\n")
    (pkg / "top.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from . import b\nfrom .c import name\n"
                                      "def f():\n    from jax_fa4.sub import d\n"
                                      "import numpy\n")
    (pkg / "sub" / "b.py").write_text("from ..sub.e import x\n")
    (pkg / "sub" / "c.py").write_text("from jax_fa4.sub import a\n")  # a cycle a -> c -> a
    (pkg / "sub" / "d.py").write_text("")
    (pkg / "sub" / "e.py").write_text("")
    assert sources.closure("jax_fa4.sub.a", tmp_path) == tuple(
        f"jax_fa4.sub.{m}" for m in "abcde")
    graph = sources.import_graph(tmp_path)
    assert graph["jax_fa4"] == {"jax_fa4.top"}
    assert sources.cycles(graph) == [("jax_fa4.sub.a", "jax_fa4.sub.c")]


def test_only_config_modules_import_the_tuning_tables():
    """A tuning module is outside every key (sources.TUNING_MODULES): kernel code must not read
    it, only the config modules that turn its rows into config fields (which are the key)."""
    graph = sources.import_graph()
    assert sources.TUNING_MODULES <= set(graph)
    importers = {m for m, deps in graph.items() if deps & sources.TUNING_MODULES}
    kernel_side = {m for m in importers
                   if m.startswith("jax_fa4.kernels.") and not m.endswith("_config")}
    assert importers and not kernel_side, kernel_side


def test_a_table_edit_rekeys_no_kernel_source(tmp_path):
    """Editing a tuning row leaves every kernel's source fingerprint alone: only the configs made
    from that row change (their fields are the key)."""
    root = _package_copy(tmp_path)
    path = root / "jax_fa4" / "kernels" / "sm90" / "fwd_tuning.py"
    text = path.read_text()
    assert '"none": _T(192, 160)' in text  # the FP8 hdim-64 row
    path.write_text(text.replace('"none": _T(192, 160)', '"none": _T(192, 128)', 1))
    assert _keys(root) == _keys()
