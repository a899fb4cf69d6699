#!/usr/bin/env bash
# Runs on the GPU machine, from the project root: bash .device/on-device.sh <command...>
# (tools/device/prepare.sh copies it into the git-ignored .device/ with the runtime library.)
# Unpacks the CuTe-DSL runtime library, points jax-fa4 at it and at the precompiled kernel cache
# carried in .device/kernel-cache, puts the checkout on PYTHONPATH (and, when .device holds
# flash-attn3-jax.tar.xz from prepare.sh fa3, that benchmark peer unpacked without pip: the
# benchmark then times it as fa3-jax; it needs einops, which the GPU image has), records the
# GPU's state and runs the command with JAX_FA4_REQUIRE_GPU=1: there, a GPU test that cannot
# find a Hopper GPU, misses a kernel in the cache, or would run the pure-JAX reference instead of
# a kernel fails instead of skipping (tests/conftest.py, tests/gpu/conftest.py).
set -euo pipefail
root=$(pwd)
lib=/tmp/cute-dsl-runtime/libcute_dsl_runtime.so
if [ ! -s "$lib" ]; then
  mkdir -p "$(dirname "$lib")"
  xz -dc "$root/.device/libcute_dsl_runtime.so.xz" > "$lib"
fi
export JAX_FA4_CUTE_RUNTIME_LIB="$lib"
export JAX_FA4_CACHE_DIR="${JAX_FA4_CACHE_DIR:-$root/.device/kernel-cache}"
export JAX_FA4_REQUIRE_GPU="${JAX_FA4_REQUIRE_GPU:-1}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
if [ -s "$root/.device/flash-attn3-jax.tar.xz" ]; then
  fa3=/tmp/flash-attn3-jax
  if [ ! -d "$fa3/flash_attn3_jax" ]; then
    mkdir -p "$fa3.tmp" && tar -C "$fa3.tmp" -xJf "$root/.device/flash-attn3-jax.tar.xz"
    rm -rf "$fa3" && mv "$fa3.tmp" "$fa3"
  fi
  export PYTHONPATH="$PYTHONPATH:$fa3"
fi
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu \
  --format=csv,noheader || true
exec "$@"
