"""CuTe-DSL kernels. Kernel modules import the compiler and never JAX; their ``*_config`` modules
(the compile keys, see :mod:`jax_fa4.kernels.spec`) import neither, nor any kernel module:
:mod:`jax_fa4.kernels.registry` binds each config to its launcher module."""
