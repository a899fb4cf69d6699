"""Multi-GPU correctness and scaling on the GPUs of one host: sharded attention, ring attention,
sharded training (``jax_fa4.tools.multi_gpu``, whose docstring lists the parts and the flags).

    python benchmarks/multi_gpu.py                  # everything, every visible GPU
    python benchmarks/multi_gpu.py --parts checks   # the correctness suite alone
    python benchmarks/multi_gpu.py --readme         # docs/sharding.md's multi-GPU section
"""

import sys

from jax_fa4.tools.multi_gpu import main

if __name__ == "__main__":
    sys.exit(main())
