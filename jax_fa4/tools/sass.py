"""What a compiled kernel object really is, read without a GPU: registers, spills, SASS.

A kernel object (what :func:`jax_fa4.ffi.compiler.compile_config` returns, what the kernel cache
holds, what ``jax.export`` embeds) carries one CUDA ELF (cubin) per kernel inside host code.
:func:`kernels` finds the cubins, disassembles each with NVIDIA's ``cuobjdump`` (which calls
``nvdisasm``) and returns, per kernel function, its resource usage and its SASS listing, with
the instructions counted by opcode. :func:`problems` is the check every shipped variant must
pass: no local memory (spills or a stack frame), at most 255 registers, shared memory within a
CTA's 227 KB, and the instructions its kernel family cannot do without.

The disassemblers come from NVIDIA's wheels ``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm``
(in the ``test`` extra: ``pip install 'jax-fa4[test]'``); ``$JAX_FA4_CUOBJDUMP`` names another
``cuobjdump`` (its ``nvdisasm`` then comes from ``$NVDISASM_PATH`` or ``PATH``). The parsing
here is the project's own.

    python -m jax_fa4.tools.sass kernel.o [more.o ...]      # one summary line per kernel
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gzip
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

#: ``e_machine`` of a CUDA ELF.
EM_CUDA = 190
MAX_REGISTERS = 255

ENV_CUOBJDUMP = "JAX_FA4_CUOBJDUMP"

# One SASS instruction line: "/*0a40*/  @!P0 HGMMA.64x128x16.F32.BF16 gdesc[UR4], R24, gsb0 ;"
_INSTRUCTION = re.compile(
    r"^\s*/\*[0-9a-f]{4,}\*/\s+(@!?U?P[T\d]+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
_FUNCTION = re.compile(r"^\s*Function : (\S+)\s*$", re.M)
_RESOURCES = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_ARCH = re.compile(r"code for (sm_\w+)")
# The 64-bit halves of each instruction's encoding cuobjdump prints beside it: dropped.
_ENCODING = re.compile(r"\s*/\* 0x[0-9a-f]{16} \*/")


class DisassemblerNotFoundError(RuntimeError):
    """cuobjdump / nvdisasm are not installed."""


@functools.cache
def cuobjdump_path() -> str:
    """The ``cuobjdump`` to run: ``$JAX_FA4_CUOBJDUMP``, NVIDIA's wheel, then ``PATH``."""
    named = os.environ.get(ENV_CUOBJDUMP)
    if named:
        if not os.access(named, os.X_OK):
            raise DisassemblerNotFoundError(f"{ENV_CUOBJDUMP}={named!r} is not an executable")
        return named
    for root in _wheel_bin_dirs():
        candidate = root / "cuobjdump"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("cuobjdump")
    if found:
        return found
    raise DisassemblerNotFoundError(
        "cuobjdump not found: pip install 'jax-fa4[test]' (NVIDIA's nvidia-cuda-cuobjdump and "
        f"nvidia-cuda-nvdisasm wheels), or set {ENV_CUOBJDUMP}")


def _wheel_bin_dirs() -> list[Path]:
    """``nvidia/cu*/bin`` folders of the installed NVIDIA CUDA wheels, newest CUDA first."""
    try:
        import nvidia  # the wheels' namespace package
    except ImportError:
        return []
    dirs = [p for root in getattr(nvidia, "__path__", ()) for p in Path(root).glob("cu*/bin")]
    return sorted(dirs, key=lambda p: p.parent.name, reverse=True)


def _tool_env(cuobjdump: str) -> dict[str, str]:
    """cuobjdump finds nvdisasm through NVDISASM_PATH / PATH: point it at the one beside it."""
    env = dict(os.environ)
    here = Path(cuobjdump).parent
    if "NVDISASM_PATH" not in env and (here / "nvdisasm").exists():
        env["NVDISASM_PATH"] = str(here)
        env["PATH"] = f"{here}{os.pathsep}{env.get('PATH', '')}"
    return env


def cuda_elves(data: bytes) -> list[bytes]:
    """Every 64-bit little-endian CUDA ELF embedded in ``data``, whole (to its last byte: the
    larger of the section header table's end and every section's file extent)."""
    found = []
    at = data.find(b"\x7fELF\x02\x01")
    while at >= 0:
        end = _elf_end(data, at)
        if end is None:
            at = data.find(b"\x7fELF\x02\x01", at + 1)
            continue
        found.append(data[at:end])
        at = data.find(b"\x7fELF\x02\x01", end)
    return found


def _elf_end(data: bytes, at: int) -> int | None:
    """End offset of the CUDA ELF starting at ``at``, None when it is not one or is cut off."""
    if len(data) < at + 64 or struct.unpack_from("<H", data, at + 18)[0] != EM_CUDA:
        return None
    phoff, shoff = struct.unpack_from("<QQ", data, at + 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, at + 0x36)
    size = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    for index in range(shnum):
        header = at + shoff + index * shentsize
        if header + 0x28 > len(data):
            return None
        kind = struct.unpack_from("<I", data, header + 4)[0]
        offset, length = struct.unpack_from("<QQ", data, header + 0x18)
        if kind != 8:  # SHT_NOBITS takes no room in the file
            size = max(size, offset + length)
    return at + size if at + size <= len(data) else None


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel function of a cubin: resource usage and SASS."""

    name: str
    arch: str
    registers: int
    stack: int
    local: int
    shared_static: int
    sass: str  # cuobjdump's listing of this function (without the instruction encodings)

    @functools.cached_property
    def _parsed(self) -> tuple[tuple[str, str, str], ...]:
        """(predicate, opcode, operands) of every instruction, in order."""
        out = []
        for line in self.sass.splitlines():
            m = _INSTRUCTION.match(line)
            if m:
                out.append(((m.group(1) or "").strip(), m.group(2), " ".join(m.group(3).split())))
        return tuple(out)

    @functools.cached_property
    def instructions(self) -> tuple[str, ...]:
        """Each instruction as ``"[@P] OPCODE.MODS operands"`` (no address or encoding)."""
        return tuple(" ".join(part for part in ins if part) for ins in self._parsed)

    @functools.cached_property
    def opcodes(self) -> collections.Counter:
        """Instruction count per full opcode (with its modifiers, e.g. ``MUFU.EX2``)."""
        return collections.Counter(op for _, op, _ in self._parsed)

    def count(self, opcode: str) -> int:
        """Instructions whose opcode is ``opcode`` or extends it by modifiers
        (``count("UTMALDG")`` counts ``UTMALDG.2D`` and ``UTMALDG.3D.2CTA``)."""
        dotted = opcode + "."
        return sum(n for op, n in self.opcodes.items() if op == opcode or op.startswith(dotted))

    def matches(self, pattern: str) -> int:
        """Instructions (``"[@P] OPCODE.MODS operands"``) a regular expression finds something
        in."""
        rx = re.compile(pattern)
        return sum(1 for i in self.instructions if rx.search(i))

    @property
    def spills(self) -> bool:
        """Local memory in any form: spill loads / stores, a stack frame, local bytes."""
        return bool(self.count("LDL") or self.count("STL") or self.local or self.stack)

    def setmaxnreg(self) -> list[int]:
        """The distinct register targets of ``setmaxnreg`` (USETMAXREG), ascending."""
        targets = set()
        for _, op, operands in self._parsed:
            if op.startswith("USETMAXREG"):
                m = re.search(r"0x([0-9a-f]+)\s*$", operands)
                if m:
                    targets.add(int(m.group(1), 16))
        return sorted(targets)

    def normalised(self) -> list[str]:
        """The instructions with hex immediates replaced by ``X``: what stays equal when only
        addresses and constants move (``jax_fa4/tools/sass_diff.py``)."""
        return [re.sub(r"0x[0-9a-f]+", "X", i) for i in self.instructions]

    def summary(self) -> str:
        watched = ("HGMMA", "UTCHMMA", "UTMALDG", "UTMASTG", "MUFU.EX2", "LDL", "STL")
        ops = "  ".join(f"{op} {self.count(op)}" for op in watched if self.count(op))
        return (f"{self.arch} {self.name[:72]}: {self.registers} registers, stack {self.stack}, "
                f"local {self.local}, static shared {self.shared_static} B; {ops}")


def kernels(obj: bytes, name_contains: str | None = None) -> list[Kernel]:
    """The kernel functions of every cubin in ``obj`` (optionally only those whose name
    contains ``name_contains``)."""
    out = []
    for elf in cuda_elves(obj):
        out.extend(k for k in _disassemble(elf)
                   if name_contains is None or name_contains in k.name)
    return out


def stored_kernels(obj: bytes, store: Path | None) -> tuple[Kernel, ...]:
    """:func:`kernels` of ``obj``, kept under ``store`` (when given) as ``<sha256 of obj>.json.gz``
    so a listing is disassembled once: the test tiers keep their store beside their kernel cache
    (``<cache>/sass``), and ``jax_fa4/tools/sass_diff.py --cache-dir`` reads and fills the same
    one."""
    path = store / f"{hashlib.sha256(obj).hexdigest()}.json.gz" if store is not None else None
    if path is not None and path.exists():
        try:
            return tuple(Kernel(**k) for k in json.loads(gzip.decompress(path.read_bytes())))
        except (OSError, ValueError, TypeError, EOFError):
            pass  # damaged: disassemble again and rewrite it
    found = tuple(kernels(obj))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(gzip.compress(json.dumps([dataclasses.asdict(k) for k in found]).encode()))
        tmp.replace(path)
    return found


def _run_cuobjdump(path: Path) -> str:
    """cuobjdump's resource usage and SASS listing of the cubin at ``path``."""
    tool = cuobjdump_path()
    res = subprocess.run([tool, "--dump-resource-usage", "--dump-sass", str(path)],
                         capture_output=True, text=True, env=_tool_env(tool))
    if res.returncode != 0:
        raise RuntimeError(f"{tool} failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
    return res.stdout


def _disassemble(elf: bytes) -> list[Kernel]:
    with tempfile.TemporaryDirectory(prefix="jax-fa4-sass-") as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(elf)
        text = _run_cuobjdump(path)
    resources = {m.group(1): tuple(int(x) for x in m.groups()[1:])
                 for m in _RESOURCES.finditer(text)}
    arch = _ARCH.search(text)
    heads = list(_FUNCTION.finditer(text))
    found = []
    for n, head in enumerate(heads):
        body = text[head.end():heads[n + 1].start() if n + 1 < len(heads) else len(text)]
        body = "\n".join(line for line in (_ENCODING.sub("", ln) for ln in body.splitlines())
                          if line.strip())
        reg, stack, shared, local = resources.get(head.group(1), (0, 0, 0, 0))
        found.append(Kernel(head.group(1), arch.group(1) if arch else "?", reg, stack, local,
                            shared, body))
    return found


def problems(kernel: Kernel, *, dynamic_smem_bytes: int, must_have: Iterable[str] = (),
             label: str | None = None) -> list[str]:
    """What keeps ``kernel`` from shipping, one line each (empty: clean): local memory,
    over 255 registers, over 227 KB of shared memory (``dynamic_smem_bytes`` plus the static
    beyond the system's 1 KB reserve), a missing instruction of ``must_have`` (opcode prefixes,
    as :meth:`Kernel.count` takes them)."""
    # imported here: the rest of this module is stdlib only (tools/sass_diff.py loads it beside
    # another checkout's package)
    from jax_fa4.kernels.spec import SMEM_CAPACITY_BYTES, SMEM_SYSTEM_RESERVE_BYTES

    label = label or kernel.name
    found = []
    if kernel.spills:
        found.append(f"{label}: local memory (LDL {kernel.count('LDL')}, STL "
                     f"{kernel.count('STL')}, stack {kernel.stack}, local {kernel.local})")
    if kernel.registers > MAX_REGISTERS:
        found.append(f"{label}: {kernel.registers} registers (max {MAX_REGISTERS})")
    shared = max(kernel.shared_static - SMEM_SYSTEM_RESERVE_BYTES, 0) + dynamic_smem_bytes
    if shared > SMEM_CAPACITY_BYTES:
        found.append(f"{label}: {shared} B of shared memory (max {SMEM_CAPACITY_BYTES})")
    missing = [op for op in must_have if not kernel.count(op)]
    if missing:
        found.append(f"{label}: no {', '.join(missing)} in its SASS")
    return found


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m jax_fa4.tools.sass", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("objects", nargs="+", type=Path, help="kernel objects, cubins or exports")
    p.add_argument("--sass-out", type=Path, help="write each kernel's SASS listing here")
    args = p.parse_args(argv)
    for path in args.objects:
        for n, kernel in enumerate(kernels(path.read_bytes())):
            print(f"{path.name}#{n} {kernel.summary()}")
            if args.sass_out:
                args.sass_out.mkdir(parents=True, exist_ok=True)
                (args.sass_out / f"{path.name}.{n}.sass").write_text(kernel.sass)
    return 0


if __name__ == "__main__":
    sys.exit(main())
