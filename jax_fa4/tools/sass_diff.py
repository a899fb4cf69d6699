"""Compare the SASS of kernel variants between two checkouts (no GPU needed).

    python -m jax_fa4.tools.sass_diff ../old-checkout --family sm90_bwd --head-dim 128 \
        --dtype bfloat16
    git worktree add /work/old HEAD~3 \
        && python -m jax_fa4.tools.sass_diff /work/old --family sm90_fwd

For a refactor that should not change the generated code, this is the proof that needs no GPU
run: every selected shipped variant (``jax_fa4.tools.variants``, default suite) is compiled from
each checkout (each in its own process, importing that checkout's ``jax_fa4``) and disassembled with
this checkout's ``jax_fa4/tools/sass.py``; instructions are compared with addresses, encodings and
immediates stripped. Variants are matched by their family, arch and the config fields that differ
from their defaults (so a new field added with a default that keeps the old code still pairs
with the old variant); variants without a partner are listed apart. ``--representative`` narrows
the selection to its representative variants (``jax_fa4.tools.variants.representative``: every mode
and every option value of each family), a quick sample of a large selection. Both sides compile with
one ``PYTHONHASHSEED`` (0 unless set) and, where ``setarch`` exists, with address-space
randomisation off: the DSL's embedded ptxas (13.4) allocates registers of some sm100_bwd kernels
differently depending on where its heap lands (identical PTX, different SASS;
docs/kernels/README.md), which would read as a difference. This makes such noise rare, not
impossible.
Prints one line per variant (``same`` / ``DIFFERS (...)``, saying whether only the register
allocation differs, or which opcode counts changed) and exits 1 if any differs.

A *manifest* keeps one side for later: per variant (by the same key) the sha256 of its normalised
SASS, the sha256 with register names masked, and its opcode counts, so a comparison against it
still tells a register-allocation difference from a changed instruction mix.
``--write-manifest FILE`` writes this checkout's; ``--manifest FILE`` compares this
checkout against one instead of compiling another checkout (a redesign's proof then compiles only
the new side). ``--cache-dir DIR`` takes this checkout's objects from a kernel cache (e.g. the
exhaustive test tier's ``.pytest_cache/d/jax-fa4-kernels``), compiling what it lacks on
``--jobs`` processes:

    python -m jax_fa4.tools.sass_diff --write-manifest benchmarks/results/sass-manifest.json \
        --cache-dir .pytest_cache/d/jax-fa4-kernels
    python -m jax_fa4.tools.sass_diff --manifest benchmarks/results/sass-manifest.json \
        --cache-dir .pytest_cache/d/jax-fa4-kernels --family sm90_bwd

Cached objects were compiled with address randomisation on, so a few sm100_bwd variants may
differ from a manifest through ptxas alone: confirm such a line with the two-checkout mode.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]  # this checkout's root


def sass_module():
    """This checkout's jax_fa4/tools/sass.py (stdlib only), whichever ``jax_fa4`` is imported."""
    spec = importlib.util.spec_from_file_location("jax_fa4_sass",
                                                  Path(__file__).with_name("sass.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


def variant_key(v) -> str:
    """Family, arch and the config fields that differ from their defaults."""
    import dataclasses

    fields = [f"{f.name}={getattr(v.config, f.name)!r}" for f in dataclasses.fields(v.config)
              if getattr(v.config, f.name) != f.default]
    return f"{v.arch} {v.config.kernel_name}({', '.join(fields)})"


def dump(root: str, out_dir: str, selection: dict, only_representative: bool) -> None:
    """(In a child process) compile the selection from ``root``; write {key: sass lines}."""
    sys.path.insert(0, root)
    from jax_fa4.ffi.compiler import compile_config

    try:
        from jax_fa4.tools.variants import representative, variants
    except ModuleNotFoundError:  # a checkout from before the tools moved into jax_fa4.tools
        from jax_fa4.variants import representative, variants

    sass = sass_module()
    result = {}
    selected = variants(**selection)
    for v in representative(selected) if only_representative else selected:
        kernels = sass.kernels(compile_config(v.config, v.arch).object_bytes)
        result[variant_key(v)] = [line for k in kernels for line in k.normalised()]
        print(f"  {Path(root).name}: {v.describe()}", file=sys.stderr, flush=True)
    (Path(out_dir) / "sass.json").write_text(json.dumps(result))


def cached_sass(selection: dict, only_representative: bool, cache_dir: str, jobs: int
                ) -> dict[str, list[str]]:
    """{key: normalised sass lines} of this checkout's selection, its objects from the kernel
    cache at ``cache_dir`` (compiled into it first where missing, on ``jobs`` processes)."""
    sys.path.insert(0, str(HERE))
    from jax_fa4.tools import precompile
    from jax_fa4.ffi.cache import KernelCache
    from jax_fa4.ffi.compiler import dsl_version
    from jax_fa4.tools.variants import representative, variants

    sass = sass_module()
    selected = variants(**selection)
    selected = representative(selected) if only_representative else selected
    cache = KernelCache(cache_dir)
    precompile.build(selected, cache, jobs=jobs)
    version = dsl_version()

    def lines(v) -> list[str]:
        obj = cache.get(v.config, v.arch, version).object_bytes
        # the disassembly store the test tiers keep beside the cache
        # (jax_fa4.tools.sass.stored_kernels)
        found = sass.stored_kernels(obj, cache.root / "sass")
        return [line for k in found for line in k.normalised()]

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:  # cuobjdump runs outside the GIL
        return dict(zip(map(variant_key, selected), pool.map(lines, selected)))


_REGISTER = re.compile(r"\bU?R\d+\b|\bU?P\d\b|\bB\d+\b")


def _sha(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def opcode(line: str) -> str:
    words = line.split()
    return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]


def digest(lines: list[str]) -> dict:
    """A manifest entry: sha256 of the normalised listing, sha256 of it with register names
    masked (general, uniform, predicate, barrier), and the count of each opcode."""
    return {"sha256": _sha(lines),
            "modulo_registers": _sha([_REGISTER.sub("R", line) for line in lines]),
            "opcodes": dict(sorted(Counter(map(opcode, lines)).items()))}


def difference(a: dict | str, b: dict) -> str | None:
    """None when two entries agree; else what differs: only the register allocation (the same
    instructions in the same order, e.g. ptxas's nondeterminism), or the opcode counts that
    changed (``OP old->new``, largest changes first). A plain-string entry (a manifest of an
    older format) only tells whether the listing differs."""
    if isinstance(a, str):
        return None if a == b["sha256"] else "listing (older manifest: no detail)"
    if a["sha256"] == b["sha256"]:
        return None
    if a["modulo_registers"] == b["modulo_registers"]:
        return "register allocation only"
    old, new = Counter(a["opcodes"]), Counter(b["opcodes"])
    changed = sorted((op for op in old.keys() | new.keys() if old[op] != new[op]),
                     key=lambda op: (-abs(new[op] - old[op]), op))
    if not changed:
        return "instruction order (same opcode counts)"
    total = sum(new.values()) - sum(old.values())
    return (f"{total:+d} instructions: "
            + ", ".join(f"{op} {old[op]}->{new[op]}" for op in changed[:8])
            + (" ..." if len(changed) > 8 else ""))


def write_manifest(path: str, sides: dict[str, list[str]]) -> None:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True,
                            text=True).stdout.strip()
    sys.path.insert(0, str(HERE))
    from jax_fa4.ffi.compiler import dsl_version

    body = {"commit": commit, "dsl_version": dsl_version(),
            "variants": {key: digest(lines) for key, lines in sorted(sides.items())}}
    Path(path).write_text(json.dumps(body, indent=0, sort_keys=True) + "\n")
    print(f"{len(sides)} variants written to {path}")


def compare(other: dict, this: dict, describe) -> int:
    """Print one line per key of either side (``describe(a, b)``: None when they agree, else
    what differs); the number of variants that differ."""
    differs = 0
    for key in sorted(set(this) | set(other)):
        a, b = other.get(key), this.get(key)
        if a is None or b is None:
            print(f"only in {'this' if a is None else 'other'}: {key}")
            continue
        what = describe(a, b)
        differs += what is not None
        print(f"{'same' if what is None else f'DIFFERS ({what})'}  {key}")
    return differs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("other", nargs="?", help="the other checkout's root (e.g. a git worktree)")
    p.add_argument("--family", nargs="+", help="kernel families (default: all)")
    p.add_argument("--head-dim", type=int, nargs="+")
    p.add_argument("--dtype", nargs="+")
    p.add_argument("--arch", nargs="+")
    p.add_argument("--representative", action="store_true",
                   help="only the representative variants of the selection")
    p.add_argument("--manifest", help="compare this checkout against this manifest file")
    p.add_argument("--write-manifest", metavar="FILE", help="write this checkout's manifest")
    p.add_argument("--cache-dir", help="this checkout's objects from (and into) this kernel cache")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--dump", nargs=2, metavar=("ROOT", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    selection = dict(families=args.family, head_dims=args.head_dim, dtypes=args.dtype,
                     archs=args.arch)
    if args.dump:
        dump(args.dump[0], args.dump[1], selection, args.representative)
        return 0
    if sum(x is not None for x in (args.other, args.manifest, args.write_manifest)) != 1:
        p.error("give exactly one of: another checkout, --manifest, --write-manifest")
    sass_module().cuobjdump_path()  # fail early when the disassembler is missing
    if args.manifest or args.write_manifest:
        if args.cache_dir is None:
            p.error("--manifest / --write-manifest take this checkout's objects from --cache-dir")
        this = cached_sass(selection, args.representative, args.cache_dir, args.jobs)
        if args.write_manifest:
            write_manifest(args.write_manifest, this)
            return 0
        stored = json.loads(Path(args.manifest).read_text())["variants"]
        mine = {key: digest(lines) for key, lines in this.items()}
        other = {key: stored[key] for key in stored if key in mine} if any(
            (args.family, args.head_dim, args.dtype, args.arch, args.representative)) else stored
        return 1 if compare(other, mine, difference) else 0
    sides = {}
    for name, root in (("other", str(Path(args.other).resolve())), ("this", str(HERE))):
        out = tempfile.mkdtemp(prefix=f"sass-{name}-")
        cmd = [sys.executable, __file__, args.other, "--dump", root, out]
        for flag, values in (("--family", args.family), ("--head-dim", args.head_dim),
                             ("--dtype", args.dtype), ("--arch", args.arch)):
            if values:
                cmd += [flag, *map(str, values)]
        if args.representative:
            cmd.append("--representative")
        if shutil.which("setarch"):
            cmd = ["setarch", "-R", *cmd]
        env = {**os.environ, "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")}
        subprocess.run(cmd, check=True, cwd=root, env=env)
        sides[name] = json.loads((Path(out) / "sass.json").read_text())
    def describe(a: list[str], b: list[str]) -> str | None:
        what = difference(digest(a), digest(b))
        lines = sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
        return None if what is None else f"{lines} lines; {what}"

    return 1 if compare(sides["other"], sides["this"], describe) else 0


if __name__ == "__main__":
    sys.exit(main())
