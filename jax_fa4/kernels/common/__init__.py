"""Device helpers shared by the attention kernels (CuTe-DSL): accumulator layout views, online
softmax, attention masks, per-tile key-block ranges and tile schedulers.

Nothing here imports JAX; everything here imports the CuTe-DSL compiler, so import these modules
lazily (from a kernel module), never from a config module.
"""
