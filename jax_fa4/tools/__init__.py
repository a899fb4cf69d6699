"""Tools around the library, never imported by it.

* ``precompile``: build the persistent kernel cache for any arch without a GPU
  (``jax-fa4-precompile``); ``variants`` lists the kernel variants it ships, by suite and family.
* ``sass``: disassemble compiled kernels and check them (spills, local memory, required opcodes).
* ``bench``: the benchmark sweep against cuDNN and the peers (``jax-fa4-bench``), with its
  shapes (``bench_shapes``), result tables and plots (``bench_report``) and the GPU state a
  result file records (``bench_env``).
"""
