#!/usr/bin/env bash
# One GPU-machine batch, from the project root (run through .device/on-device.sh, which sets
# JAX_FA4_REQUIRE_GPU=1): the steps named, in order, each with its own time limit, each writing
# its log (and the benchmark its JSON) under $OUT as it goes, so a step cut short keeps its output.
#   bash .device/on-device.sh bash tools/device/batch.sh tests bench-main
# Steps: tests (tests/gpu with pytest-xdist), sanitizers, bench (the whole default sweep),
# bench-main / bench-more (its two halves: python -m jax_fa4.tools.bench merge joins them),
# bench-peers (the default shapes, jax-fa4 and cuDNN beside FlashAttention-3's JAX binding, which
# .device/flash-attn3-jax.tar.xz from prepare.sh fa3 brings: bench-peers.json), profile-bwd
# (Nsight Compute on one training step, ours and cuDNN's: tools/device/profile.sh), step-bench
# (a decoder's whole jitted training step, ours against cuDNN's: jax_fa4.tools.step_bench, with
# its per-kernel profile: step.json, step-profile.md and step-files.tar.xz, the traces and HLO;
# STEP_BENCH_ARGS adds flags, e.g. STEP_BENCH_ARGS="--configs b8s2k-16-4-d128 --no-attention"),
# bwd-variants (benchmarks/bwd_variants.py: backward configs side by side, bwd-variants.json;
# BWD_VARIANTS_ARGS chooses, e.g. BWD_VARIANTS_ARGS="--shapes d256 --variants v1,red").
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
status=0
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name: rc $rc in $((SECONDS - start)) s"
  tail -n 3 "$out/$name.log"
  [ "$rc" -eq 0 ] || status=1
}
pack_step_files() {  # the step benchmark's traces and HLO as one tarball, its tables beside it
  local dir="$out/step-files" tarball="$out/step-files.tar.xz"
  [ -d "$dir" ] || return 0
  [ -f "$dir/profile/profile.md" ] && cp "$dir/profile/profile.md" "$out/step-profile.md"
  XZ_OPT=-T0 tar -C "$out" -cJf "$tarball" step-files
  if [ "$(stat -c %s "$tarball")" -gt 15000000 ]; then  # too large to come back: no raw traces
    XZ_OPT=-T0 tar -C "$out" -cJf "$tarball" --exclude '*.xplane.pb' --exclude '*.trace.json.gz' \
      step-files
  fi
  rm -rf "$dir"
  ls -l "$tarball"
}
for s in "$@"; do
  case $s in
    tests) step tests 480 python -m pytest tests/gpu -q -n 14 --timeout 300 -p no:cacheprovider \
             --ignore tests/gpu/test_sanitizers.py -rfEs ;;
    sanitizers) step sanitizers 300 python -m pytest tests/gpu/test_sanitizers.py -q \
                  -p no:cacheprovider ;;
    bench) step bench 560 python -m jax_fa4.tools.bench --out "$out/bench.json" ;;
    bench-main) step bench-main 380 python -m jax_fa4.tools.bench --shapes anchors-main \
                  --out "$out/bench-main.json" ;;
    bench-more) step bench-more 380 python -m jax_fa4.tools.bench --shapes anchors-more,latency \
                  --out "$out/bench-more.json" ;;
    bench-peers) step bench-peers 400 python -m jax_fa4.tools.bench --shapes default \
                   --impls jax-fa4,cudnn,fa3-jax --out "$out/bench-peers.json" ;;
    profile-bwd) step profile-bwd 300 bash tools/device/profile.sh ;;
    step-bench) step step-bench 500 python -m jax_fa4.tools.step_bench --out "$out/step.json" \
                  --hlo "$out/step-files/hlo" --profile "$out/step-files/profile" \
                  ${STEP_BENCH_ARGS:-}
                pack_step_files ;;
    bwd-variants) step bwd-variants 560 python benchmarks/bwd_variants.py \
                    --out "$out/bwd-variants.json" ${BWD_VARIANTS_ARGS:-} ;;
    *) echo "unknown step $s"; status=2 ;;
  esac
done
exit $status
