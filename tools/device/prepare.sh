#!/usr/bin/env bash
# Run on the CPU machine, from anywhere inside the checkout. Fills the git-ignored .device/ with
# what a GPU machine without a compiler needs besides the checkout:
#   libcute_dsl_runtime.so.xz  the CuTe-DSL runtime library (the XLA FFI handlers), ~13 MB
#   runtime-version            the nvidia-cutlass-dsl version it came from (compile with the same)
#   on-device.sh               the wrapper every GPU command starts with (tools/device/on-device.sh)
# With the argument fa3 (bash tools/device/prepare.sh fa3), also the optional benchmark peer:
#   flash-attn3-jax.tar.xz     FlashAttention-3's JAX binding (PyPI flash-attn3-jax, version
#                              FA3_JAX_VERSION, default 0.2.3): its cp312 wheel unpacked, xz, ~9 MB
#                              (the wheel is 23 MB); on-device.sh unpacks it onto PYTHONPATH, where
#                              python -m jax_fa4.tools.bench times it as fa3-jax. Delete it to
#                              leave the peer out of what .device carries.
# Then precompile the kernels the run needs into .device/kernel-cache, e.g.
#   python -m jax_fa4.tools.precompile --suite tests --arch sm_90a --cache-dir .device/kernel-cache
# and on the GPU machine, from the project root: bash .device/on-device.sh <command>.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
ver=${CUTLASS_DSL_VERSION:-$(python3 -c 'import importlib.metadata as m; print(m.version("nvidia-cutlass-dsl"))' 2>/dev/null || echo 4.8.1)}
mkdir -p "$root/.device"
grep -qx '/.device/' "$root/.git/info/exclude" 2>/dev/null || echo '/.device/' >> "$root/.git/info/exclude"
if [ ! -s "$root/.device/libcute_dsl_runtime.so.xz" ] || [ "$(cat "$root/.device/runtime-version" 2>/dev/null)" != "$ver" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$tmp" "nvidia-cutlass-dsl-libs-cu13==$ver"
  unzip -q -o -j "$tmp"/*.whl 'nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so' -d "$tmp"
  xz -6 -T0 -c "$tmp/libcute_dsl_runtime.so" > "$root/.device/libcute_dsl_runtime.so.xz"
  echo "$ver" > "$root/.device/runtime-version"
  rm -rf "$tmp"
fi
fa3_ver=${FA3_JAX_VERSION:-0.2.3}
fa3_had=$(cat "$root/.device/flash-attn3-jax-version" 2>/dev/null || true)
if [ "${1:-}" = fa3 ] && { [ "$fa3_had" != "$fa3_ver" ] || [ ! -s "$root/.device/flash-attn3-jax.tar.xz" ]; }; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$tmp" "flash-attn3-jax==$fa3_ver"
  mkdir "$tmp/site"
  unzip -q "$tmp"/flash_attn3_jax-*.whl -d "$tmp/site"
  tar -C "$tmp/site" -cf - . | xz -6 -T0 > "$root/.device/flash-attn3-jax.tar.xz"
  echo "$fa3_ver" > "$root/.device/flash-attn3-jax-version"
  rm -rf "$tmp"
fi
install -m 0755 "$root/tools/device/on-device.sh" "$root/.device/on-device.sh"
du -sh "$root/.device"/* | sed "s|$root/||"
