#!/usr/bin/env bash
# Nsight Compute on one training step's kernels, jax-fa4's and cuDNN's, one shape (run on the GPU
# machine through .device/on-device.sh; batch.sh's profile-bwd step). Per implementation:
#   ncu-<impl>-kernels.csv  every kernel of the profiled step with its duration (gpu__time_duration)
#   ncu-<impl>-full.csv     the full section set of the step's longest kernel (the backward's main
#                           kernel on a training shape), --page details
# Clocks are left alone (--clock-control none, the device tool's METHOD.md). Usage:
#   bash tools/device/profile.sh [profile_step.py shape flags, default B4 S8192 H16 D128 causal]
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "no ncu"; exit 2; }
shape=("$@")
[ ${#shape[@]} -gt 0 ] || shape=(--B 4 --S 8192 --H 16 --D 128 --causal)
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0"  # no autotuning launches to profile
status=0
for impl in jax-fa4 cudnn; do
  step=(python benchmarks/profile_step.py --impl "$impl" "${shape[@]}" --steps 1)
  "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv "${step[@]}" \
    > "$out/ncu-$impl-kernels.csv" 2> "$out/ncu-$impl-kernels.err" || status=1
  # the longest kernel of the last step: the second half of the launches (warm-up, then the step)
  name=$(python - "$out/ncu-$impl-kernels.csv" <<'PY'
import csv, io, re, sys
text = open(sys.argv[1]).read()
rows = list(csv.DictReader(io.StringIO(text[text.index('"ID"'):])))
ids = sorted({int(r["ID"]) for r in rows})
last = {r["Kernel Name"]: float(r["Metric Value"].replace(",", "")) for r in rows
        if int(r["ID"]) >= ids[len(ids) // 2]}
name = max(last, key=last.get)
print(re.escape(name.split("(")[0])[:120])
PY
) || { echo "$impl: no kernel list"; status=1; continue; }
  echo "$impl: longest kernel of the step: $name"
  "$ncu" --clock-control none --set full --kernel-name "regex:^$name" --launch-skip 1 \
    --launch-count 1 --csv --page details "${step[@]}" > "$out/ncu-$impl-full.csv" \
    2> "$out/ncu-$impl-full.err" || status=1
  tail -n 2 "$out/ncu-$impl-full.err"
done
exit $status
