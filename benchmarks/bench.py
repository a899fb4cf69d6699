"""Run the attention benchmark: ``python benchmarks/bench.py [flags]`` (see ``jax_fa4.tools.bench``)."""

from jax_fa4.tools.bench import main

raise SystemExit(main())
