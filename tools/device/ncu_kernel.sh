#!/usr/bin/env bash
# Nsight Compute's full section set, every raw metric (stall reasons included), on one launch of
# one kernel of benchmarks/profile_step.py (run on the GPU machine through .device/on-device.sh):
#   bash tools/device/ncu_kernel.sh NAME KERNEL_REGEX [profile_step.py flags]
# writes $OUT/ncu-NAME-raw.csv (one row: the launch after the warm-up's), its stderr, and
# $OUT/ncu-NAME-sass.csv.xz: the source page, one row per SASS instruction with its warp-state
# samples (where each stall happens: tools/device/ncu_sass_summary.py reads it).
# Clocks are left alone (--clock-control none, the device tool's METHOD.md). Example:
#   bash tools/device/ncu_kernel.sh d96-fwd 'Sm90Fwd' --D 96 --fwd-only
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "no ncu"; exit 2; }
name=$1 regex=$2
shift 2
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0"  # no autotuning launches to profile
rep=$(mktemp -d)/ncu-$name
"$ncu" --clock-control none --set full --import-source no --kernel-name "regex:$regex" \
  --launch-skip 1 --launch-count 1 -o "$rep" python benchmarks/profile_step.py "$@" --steps 1 \
  > "$out/ncu-$name-raw.err" 2>&1
status=$?
"$ncu" --import "$rep.ncu-rep" --csv --page raw > "$out/ncu-$name-raw.csv" 2>> "$out/ncu-$name-raw.err"
"$ncu" --import "$rep.ncu-rep" --csv --page source --print-source sass 2>> "$out/ncu-$name-raw.err" \
  | xz -6 > "$out/ncu-$name-sass.csv.xz"
echo "$name: rc $status, $(wc -c < "$out/ncu-$name-raw.csv") bytes raw, $(wc -c < "$out/ncu-$name-sass.csv.xz") bytes sass"
tail -n 2 "$out/ncu-$name-raw.err"
exit $status
