"""Run the attention benchmark: ``python benchmarks/bench.py [flags]`` (see ``jax_fa4.bench``)."""

from jax_fa4.bench import main

raise SystemExit(main())
