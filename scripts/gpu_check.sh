#!/usr/bin/env bash
# The GPU checks of a session that is lent a device (issue 40), as one run on the GPU machine:
# the CUDA-marked tests, the GPU benchmarks, the train command on [0] and [0, 0], then the whole
# suite on what time is left. The machine has its own python3 with torch and the dev libraries
# and no network, so the package runs from src/ (PYTHONPATH), not from an install.
#
#   OUT=/some/dir BUDGET_S=400 bash scripts/gpu_check.sh
#
# Every log and result lands in $OUT (at most 8 files, the device tool's limit).
set -u
OUT=${OUT:-/tmp/gpu-check}
BUDGET_S=${BUDGET_S:-400}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD" PYTHONUNBUFFERED=1 CI=true
PY=${PY:-python3}
end=$((SECONDS + BUDGET_S))
left() { echo $((end - SECONDS)); }

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import sys, torch, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'transformers', transformers.__version__)"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== CUDA-marked tests"
timeout 150 $PY -m pytest -q -p no:cacheprovider -m cuda --timeout 120 -ra 2>&1 | tee "$OUT/cuda.log" | tail -40

echo "== GPU benchmarks"
timeout 130 $PY benchmarks/bench_gpu.py --quick --out "$OUT/latest-gpu.json" 2>&1 | tee "$OUT/bench.log" | tail -30

echo "== train on [0] and [0, 0]"
for n in 1 2; do
  devices=$([ $n = 1 ] && echo 0 || echo 0,0)
  timeout 60 $PY -m dataparallel train --devices "$devices" --no-progress --json "$OUT/train-$n.json"
done >"$OUT/train.log" 2>&1
tail -30 "$OUT/train.log"

echo "== whole suite, $(left) s left"
if [ "$(left)" -gt 30 ]; then
  timeout "$(left)" $PY -m pytest -q -p no:cacheprovider -n 14 --timeout 200 -ra 2>&1 \
    | tee "$OUT/full.log" | tail -40
fi
