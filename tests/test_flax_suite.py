"""Flax's own attention tests, run on jax-fa4's Flax layers.

The installed Flax version's source distribution (downloaded from PyPI once, then kept in
``.pytest_cache``) ships ``tests/nnx/nn/attention_test.py`` and
``tests/linen/linen_attention_test.py``. A separate pytest runs both with the plugin
``tests/flax_suite/fa4_flax_substitute.py``, which puts ``jax_fa4.flax``'s layers in place of
``nnx.MultiHeadAttention``, ``linen.MultiHeadDotProductAttention`` and ``linen.MultiHeadAttention``:
every test must pass, except the documented refusals (attention-probability dropout,
``sow_weights=True``), which must raise our error with our message. Skipped only when PyPI cannot
be reached.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

import flax
import jax
import pytest

import jax_fa4

SUITE = Path(__file__).parent / "flax_suite"
#: The test files taken from Flax's source distribution, by their path in it.
FLAX_TEST_FILES = ("tests/nnx/nn/attention_test.py", "tests/linen/linen_attention_test.py")


def _plugin():
    spec = importlib.util.spec_from_file_location("fa4_flax_substitute",
                                                  SUITE / "fa4_flax_substitute.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=10).close()
    except OSError:
        return False
    return True


def _sdist_from_index(version: str, folder: Path) -> Path | None:
    """Flax ``version``'s sdist from PyPI's simple index (its JSON form, PEP 691) into
    ``folder``, its sha256 checked; None where the index or the file cannot be read."""
    name = f"flax-{version}.tar.gz"
    index = urllib.request.Request("https://pypi.org/simple/flax/",
                                   headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(index, timeout=30) as response:
            (entry,) = [f for f in json.load(response)["files"] if f["filename"] == name]
        with urllib.request.urlopen(entry["url"], timeout=300) as response:
            data = response.read()
    except (OSError, ValueError, KeyError):
        return None
    if hashlib.sha256(data).hexdigest() != entry.get("hashes", {}).get("sha256"):
        return None
    (folder / name).write_bytes(data)
    return folder / name


def _download_tests(version: str, dest: Path) -> None:
    """Download Flax ``version``'s sdist and extract :data:`FLAX_TEST_FILES` into ``dest``
    (written whole, then renamed: concurrent runs never see half a directory). From PyPI's
    index directly, else with pip (which knows the machine's index settings, but first
    prepares the package's metadata in a build environment: seconds of work)."""
    with tempfile.TemporaryDirectory() as tmp:
        sdist = _sdist_from_index(version, Path(tmp))
        if sdist is None:
            pip = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 "--disable-pip-version-check", "-q", f"flax=={version}", "-d", tmp],
                capture_output=True, text=True, timeout=600)
            if pip.returncode:
                if not _pypi_reachable():
                    pytest.skip(f"cannot download Flax {version}'s sdist (PyPI unreachable): "
                                f"{pip.stderr.strip()[-300:]}")
                pytest.fail(f"pip download of flax=={version}'s sdist failed:\n{pip.stderr}")
            (sdist,) = Path(tmp).glob("flax-*.tar.gz")
        staging = Path(tmp) / "tests"
        with tarfile.open(sdist) as tar:
            for path in FLAX_TEST_FILES:
                member = tar.getmember(f"{sdist.name.removesuffix('.tar.gz')}/{path}")
                out = staging / path
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(tar.extractfile(member).read())
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            staging.rename(dest)
        except OSError:  # another run got there first
            if not dest.exists():
                raise


@pytest.fixture(scope="module")
def flax_tests(request, tmp_path_factory) -> Path:
    """The directory holding the installed Flax version's :data:`FLAX_TEST_FILES`."""
    if getattr(request.config, "cache", None) is not None:
        root = request.config.cache.mkdir("flax-sdist-tests")
    else:  # -p no:cacheprovider
        root = tmp_path_factory.mktemp("flax-sdist-tests")
    dest = root / f"flax-{flax.__version__}"
    if not dest.exists():
        _download_tests(flax.__version__, dest)
    return dest


def test_flax_attention_suite(flax_tests, tmp_path):
    """Flax's attention tests of both files pass on jax-fa4's layers, but for the documented
    refusals (one pytest for both: one interpreter's start-up and imports)."""
    report = tmp_path / "report.json"
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # none of this repository's settings
    # only the substitution plugin (-p below): none of the environment's pytest plugins
    env = dict(os.environ, FA4_FLAX_SUITE_REPORT=str(report), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
               PYTHONPATH=os.pathsep.join([str(SUITE), str(Path(jax_fa4.__file__).parents[1]),
                                           os.environ.get("PYTHONPATH", "")]))
    if jax.config.jax_compilation_cache_dir:  # tests/conftest.py's XLA cache serves it too
        env.update(JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    files = [str(flax_tests / path) for path in FLAX_TEST_FILES]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-c", str(tmp_path / "pytest.ini"),
         "--rootdir", str(flax_tests), "-p", "no:cacheprovider", "-p", "fa4_flax_substitute",
         *files], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    tail = run.stdout[-6000:] + run.stderr[-2000:]
    assert report.exists(), f"the Flax suite did not run:\n{tail}"
    result = json.loads(report.read_text())
    outcomes = result["outcomes"]
    counts = {kind: sum(v == kind for v in outcomes.values())
              for kind in ("passed", "xfailed", "failed", "skipped")}
    print(f"Flax {flax.__version__}'s attention tests on jax_fa4.flax: {counts}")
    failed = sorted(node for node, v in outcomes.items() if v != "passed" and v != "xfailed")
    assert not failed, f"failed or skipped: {failed}\n{tail}"
    assert run.returncode == 0, tail
    refusals = _plugin().REFUSALS
    xfailed = {node for node, v in outcomes.items() if v == "xfailed"}
    expected = {node for node in outcomes if _refusal_key(node) in refusals}
    assert xfailed == expected, f"expected failures {sorted(xfailed)} != refusals"
    names = {Path(path).name: path for path in FLAX_TEST_FILES}
    assert {_refusal_key(node)[0] for node in outcomes} <= names.keys(), sorted(outcomes)
    for name, path in names.items():  # each file exercised jax-fa4's attention
        ran = [node for node in outcomes if _refusal_key(node)[0] == name]
        assert ran, f"no test of {path} ran"
        assert sum(result["attention_calls"].get(node, 0) for node in ran) > 0, (
            f"no test of {path} called jax-fa4's attention: were the layers substituted?")


def _refusal_key(nodeid: str) -> tuple[str, str, str]:
    """A node id ``dir/file.py::Class::test`` as a REFUSALS key ``(file.py, Class, test)``."""
    path, cls, name = nodeid.split("::")
    return Path(path).name, cls, name
