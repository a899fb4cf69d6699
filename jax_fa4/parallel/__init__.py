"""Parallelism: one attention call split over devices.

* :mod:`jax_fa4.parallel.sharding`: batch and head sharding under ``jax.jit`` (the forward and
  backward bound as ``custom_partitioning`` primitives);
* :mod:`jax_fa4.parallel.ring`: context parallelism inside ``shard_map`` (:func:`ring_attention`,
  :func:`zigzag`, :func:`unzigzag`);
* :mod:`jax_fa4.parallel.manual_axes`: ``shard_map``'s varying manual axes across JAX versions.

This file imports nothing: the binding (:mod:`jax_fa4.ffi.call`) takes ``manual_axes`` without
loading the API that ``ring`` sits on.
"""
