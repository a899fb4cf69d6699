"""Tools around the library, never imported by it.

* ``precompile``: build the persistent kernel cache for any arch without a GPU
  (``jax-fa4-precompile``); ``variants`` lists the kernel variants it ships, by suite and family.
* ``sass``: disassemble compiled kernels and check them (spills, local memory, required opcodes).
* ``bench``: the benchmark sweep against cuDNN and the peers (``jax-fa4-bench``), with its
  shapes (``bench_shapes``), result tables and plots (``bench_report``), the optional peers
  (``bench_peers``: FlashAttention-3's JAX binding where importable) and the GPU state a
  result file records (``bench_env``); ``readme_tables`` writes README's speed tables from the
  newest sweep (``python -m jax_fa4.tools.readme_tables``).
* What the scripts under ``benchmarks/`` and the tests share: ``bench_harness`` (the scripts'
  timing flags, input sets, result file), ``variant_sweeps`` (the configs the kernel-variant
  sweeps time), ``fa4_rule`` (FA4's numerical acceptance rule) and ``multi_gpu`` (the multi-GPU
  checks and scaling run, ``python benchmarks/multi_gpu.py``).
* ``step_bench``: a decoder's whole jitted training step with our attention against cuDNN's,
  with ``step_profile`` (the traced step's kernels per layer, side by side).
"""
