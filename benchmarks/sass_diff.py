"""Compare the SASS of kernel variants between two checkouts (no GPU needed).

    python benchmarks/sass_diff.py ../old-checkout --family sm90_bwd --head-dim 128 --dtype bfloat16
    git worktree add /work/old HEAD~3 && python benchmarks/sass_diff.py /work/old --family sm90_fwd

For a refactor that should not change the generated code, this is the proof that needs no GPU
run: every selected shipped variant (``jax_fa4.variants``, default suite) is compiled from each
checkout (each in its own process, importing that checkout's ``jax_fa4``) and disassembled with
this checkout's ``jax_fa4/sass.py``; instructions are compared with addresses, encodings and
immediates stripped. Variants are matched by their family, arch and the config fields that differ
from their defaults (so a new field added with a default that keeps the old code still pairs
with the old variant); variants without a partner are listed apart. ``--representative`` narrows
the selection to its representative variants (``jax_fa4.variants.representative``: every mode and
every option value of each family), a quick sample of a large selection. Both sides compile with
one ``PYTHONHASHSEED`` (0 unless set) and, where ``setarch`` exists, with address-space
randomisation off: the DSL's embedded ptxas (13.4) allocates registers of some sm100_bwd kernels
differently depending on where its heap lands (identical PTX, different SASS; docs/NOTES.md), which
would read as a difference. This makes such noise rare, not impossible.
Prints one line per variant (``same`` / ``DIFFERS: n lines``) and exits 1 if any differs.
"""

from __future__ import annotations

import argparse
import json
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def sass_module():
    """This checkout's jax_fa4/sass.py (stdlib only), whichever ``jax_fa4`` is imported."""
    spec = importlib.util.spec_from_file_location("jax_fa4_sass", HERE / "jax_fa4" / "sass.py")
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
    from jax_fa4.variants import representative, variants

    sass = sass_module()
    result = {}
    selected = variants(**selection)
    for v in representative(selected) if only_representative else selected:
        kernels = sass.kernels(compile_config(v.config, v.arch).object_bytes)
        result[variant_key(v)] = [line for k in kernels for line in k.normalised()]
        print(f"  {Path(root).name}: {v.describe()}", file=sys.stderr, flush=True)
    (Path(out_dir) / "sass.json").write_text(json.dumps(result))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("other", help="the other checkout's root (e.g. a git worktree)")
    p.add_argument("--family", nargs="+", help="kernel families (default: all)")
    p.add_argument("--head-dim", type=int, nargs="+")
    p.add_argument("--dtype", nargs="+")
    p.add_argument("--arch", nargs="+")
    p.add_argument("--representative", action="store_true",
                   help="only the representative variants of the selection")
    p.add_argument("--dump", nargs=2, metavar=("ROOT", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    selection = dict(families=args.family, head_dims=args.head_dim, dtypes=args.dtype,
                     archs=args.arch)
    if args.dump:
        dump(args.dump[0], args.dump[1], selection, args.representative)
        return 0
    sass_module().cuobjdump_path()  # fail early when the disassembler is missing
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
    differs = 0
    for key in sorted(set(sides["this"]) | set(sides["other"])):
        a, b = sides["other"].get(key), sides["this"].get(key)
        if a is None or b is None:
            print(f"only in {'this' if a is None else 'other'}: {key}")
            continue
        n = sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
        differs += n > 0
        print(f"{'same' if n == 0 else f'DIFFERS: {n} lines'}  {key}")
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
