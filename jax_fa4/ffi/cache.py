"""Persistent on-disk cache of compiled kernel objects.

Layout: ``<root>/<arch>/<kernel>-<digest>.o`` with a JSON sidecar ``<kernel>-<digest>.json`` holding
the config, the arch, the kernel-source fingerprint (``sources``) and the files it hashes
(``source_files``), the DSL version and the object's sha256. ``digest`` hashes (config, arch,
source fingerprint, DSL version).

The source fingerprint of a config hashes exactly the files its kernel's code comes from: the
import closure of its launcher module (:mod:`jax_fa4.kernels.registry`,
:func:`jax_fa4.ffi.sources.closure`: the kernel, its config, the helpers it imports) and the
compile path that wraps every kernel (``ffi/compiler.py``). Editing a helper rekeys the kernels
that import it, and no other.

* The root (``$JAX_FA4_CACHE_DIR``, default ``$XDG_CACHE_HOME/jax_fa4`` or ``~/.cache/jax_fa4``) is
  created with mode 0700. Cached objects are executable code, so a root (or arch directory) that
  another user owns or that group/others can write is refused with :class:`UnsafeCacheError`.
* Writers take a per-entry lock file (``fcntl.flock``), write to a temporary file and
  ``os.replace`` it in, object first and sidecar last: a reader never sees a half-written entry.
* A reader checks the sidecar and the object's sha256; a missing, truncated or corrupt entry counts
  as a miss (and is rebuilt by the caller when a compiler is there), never as a crash.

When no compiler is installed the DSL version is unknown to the process; lookups then accept an
entry built by any DSL version (the newest when several are present), or exactly
``$JAX_FA4_DSL_VERSION`` when that is set.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jax_fa4.ffi import sources
from jax_fa4.kernels.registry import launcher_module
from jax_fa4.kernels.spec import KernelConfig

ENV_CACHE_DIR = "JAX_FA4_CACHE_DIR"
ENV_DSL_VERSION = "JAX_FA4_DSL_VERSION"
_FORMAT = 2
#: The compile path, which wraps every kernel: part of every key (with the DSL version).
TOOLCHAIN_FILES = ("jax_fa4/ffi/compiler.py",)


class UnsafeCacheError(RuntimeError):
    """The cache directory could be written by someone else: its objects cannot be trusted."""


def default_cache_dir() -> Path:
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "jax_fa4"


@functools.cache
def _fingerprint(launcher: str, root: Path) -> tuple[str, tuple[str, ...]]:
    """(sha256, files) of a launcher module's import closure and the toolchain files."""
    files = sorted({*(sources.module_file(m, root).relative_to(root).as_posix()
                      for m in sources.closure(launcher, root)), *TOOLCHAIN_FILES})
    h = hashlib.sha256()
    for rel in files:
        h.update(rel.encode())
        h.update(b"\0")
        h.update((root / rel).read_bytes())
        h.update(b"\0")
    return h.hexdigest(), tuple(files)


def kernel_source_files(config: KernelConfig, root: Path = sources.ROOT) -> tuple[str, ...]:
    """The files (relative to ``root``) whose contents make ``config``'s source fingerprint."""
    return _fingerprint(launcher_module(config), root)[1]


def kernel_source_fingerprint(config: KernelConfig, root: Path = sources.ROOT) -> str:
    """sha256 over ``config``'s :func:`kernel_source_files` (memoised per launcher module): an
    edit of any of them invalidates its objects. ``root``: the directory holding ``jax_fa4``."""
    return _fingerprint(launcher_module(config), root)[0]


def _version_key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in version.replace("-", ".").split("."))


@dataclass(frozen=True)
class CacheEntry:
    object_bytes: bytes
    meta: dict[str, Any]


class KernelCache:
    """A directory of compiled kernel objects keyed by (config, arch, sources, DSL version)."""

    def __init__(self, root: str | os.PathLike[str] | None = None):
        self.root = Path(root).expanduser() if root is not None else default_cache_dir()

    # -- safety ---------------------------------------------------------------------------------
    def _ensure_dir(self, path: Path, create: bool) -> bool:
        if create:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            st = path.stat()
        except FileNotFoundError:
            return False
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeCacheError(f"kernel cache path {path} is not a directory")
        if st.st_uid != os.getuid():
            raise UnsafeCacheError(
                f"kernel cache directory {path} is owned by uid {st.st_uid}, not by this user "
                f"(uid {os.getuid()}): refusing to load executable code from it; set "
                f"{ENV_CACHE_DIR} to a directory of your own")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UnsafeCacheError(
                f"kernel cache directory {path} is writable by group or others (mode "
                f"{stat.S_IMODE(st.st_mode):o}): refusing to load executable code from it; "
                f"`chmod go-w {path}` or set {ENV_CACHE_DIR} to a private directory")
        return True

    # -- keys -----------------------------------------------------------------------------------
    @staticmethod
    def digest(config: KernelConfig, arch: str, dsl_version: str) -> str:
        key = {
            "format": _FORMAT,
            "config": config.key_dict(),
            "arch": arch,
            "sources": kernel_source_fingerprint(config),
            "dsl_version": dsl_version,
        }
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]

    def _paths(self, config: KernelConfig, arch: str, dsl_version: str) -> tuple[Path, Path]:
        stem = f"{config.kernel_name}-{self.digest(config, arch, dsl_version)}"
        d = self.root / arch
        return d / f"{stem}.o", d / f"{stem}.json"

    # -- reading --------------------------------------------------------------------------------
    def _read(self, obj_path: Path, meta_path: Path) -> CacheEntry | None:
        try:
            meta = json.loads(meta_path.read_text())
            data = obj_path.read_bytes()
        except (OSError, ValueError):
            return None
        if not isinstance(meta, dict) or meta.get("sha256") != hashlib.sha256(data).hexdigest():
            return None
        return CacheEntry(data, meta)

    def _candidates(self, config: KernelConfig, arch: str) -> Iterator[tuple[str, Path, Path]]:
        """Entries of any DSL version matching (config, arch, sources), newest version first."""
        d = self.root / arch
        found = []
        for meta_path in d.glob(f"{config.kernel_name}-*.json"):
            try:
                meta = json.loads(meta_path.read_text())
            except (OSError, ValueError):
                continue
            if (isinstance(meta, dict) and meta.get("config") == config.key_dict()
                    and meta.get("sources") == kernel_source_fingerprint(config)
                    and isinstance(meta.get("dsl_version"), str)):
                found.append((meta["dsl_version"], meta_path.with_suffix(".o"), meta_path))
        yield from sorted(found, key=lambda t: _version_key(t[0]), reverse=True)

    def get(self, config: KernelConfig, arch: str, dsl_version: str | None) -> CacheEntry | None:
        """The cached object for (config, arch), or None. ``dsl_version`` None: see module doc."""
        if not self._ensure_dir(self.root, create=False) or not self._ensure_dir(
                self.root / arch, create=False):
            return None
        dsl_version = dsl_version or os.environ.get(ENV_DSL_VERSION)
        if dsl_version is not None:
            return self._read(*self._paths(config, arch, dsl_version))
        for _, obj_path, meta_path in self._candidates(config, arch):
            entry = self._read(obj_path, meta_path)
            if entry is not None:
                return entry
        return None

    # -- writing --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, config: KernelConfig, arch: str, dsl_version: str) -> Iterator[None]:
        """Exclusive lock on one entry, across processes (held while compiling it)."""
        d = self.root / arch
        self._ensure_dir(self.root, create=True)
        self._ensure_dir(d, create=True)
        obj_path, _ = self._paths(config, arch, dsl_version)
        fd = os.open(obj_path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    @staticmethod
    def _atomic_write(path: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def put(self, config: KernelConfig, arch: str, dsl_version: str, object_bytes: bytes,
            extra: dict[str, Any] | None = None) -> CacheEntry:
        """Store an object (the caller holds :meth:`lock`). Returns the stored entry."""
        obj_path, meta_path = self._paths(config, arch, dsl_version)
        meta = {
            "format": _FORMAT,
            "kernel": config.kernel_name,
            "config": config.key_dict(),
            "arch": arch,
            "sources": kernel_source_fingerprint(config),
            "source_files": list(kernel_source_files(config)),
            "dsl_version": dsl_version,
            "sha256": hashlib.sha256(object_bytes).hexdigest(),
            **(extra or {}),
        }
        self._atomic_write(obj_path, object_bytes)
        self._atomic_write(meta_path, json.dumps(meta, indent=1, sort_keys=True).encode())
        return CacheEntry(object_bytes, meta)

    def entries(self) -> list[dict[str, Any]]:
        """Metadata of every readable entry (for ``precompile --list``)."""
        out = []
        if not self.root.is_dir():
            return out
        for meta_path in sorted(self.root.glob("*/*.json")):
            with contextlib.suppress(OSError, ValueError):
                out.append(json.loads(meta_path.read_text()))
        return out
