#!/usr/bin/env bash
# Nsight Compute's full section set, every raw metric (stall reasons included), on one launch of
# one kernel of benchmarks/profile_step.py (run on the GPU machine through .device/on-device.sh):
#   bash tools/device/ncu_kernel.sh NAME KERNEL_REGEX [profile_step.py flags]
# writes $OUT/ncu-NAME-raw.csv (one row: the launch after the warm-up's) and its stderr.
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
"$ncu" --clock-control none --set full --kernel-name "regex:$regex" --launch-skip 1 \
  --launch-count 1 --csv --page raw python benchmarks/profile_step.py "$@" --steps 1 \
  > "$out/ncu-$name-raw.csv" 2> "$out/ncu-$name-raw.err"
status=$?
echo "$name: rc $status, $(wc -c < "$out/ncu-$name-raw.csv") bytes"
tail -n 2 "$out/ncu-$name-raw.err"
exit $status
