#!/usr/bin/env bash
# The rollout engine's GPU measurements in one call (device time is short): the engine's exactness on the GPU with
# and without CUDA graphs, the standing benchmark on the real shapes, and the engine against model.generate().
# Logs and bench.jsonl go to $OUT (default out/gpu); each part has its own time limit, the most wanted first.
#   bash docs/gpu_bench.sh                 # on the device machine: OUT=$OUT bash docs/gpu_bench.sh
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
O=${OUT:-out/gpu}; mkdir -p "$O"
exec > >(tee -a "$O/log.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
b() { local t=$1; shift; echo "== bench $*"; timeout "$t" python3 bench.py --out "$O/bench.jsonl" "$@" 2>&1 | grep -v -i warn; return "${PIPESTATUS[0]}"; }
start=$(date +%s); el() { echo "[elapsed $(( $(date +%s) - start )) s]"; }
echo "== exact"; timeout 90 python3 docs/gpu_check.py exact 2>&1 | grep -v -i warn; el
b 150 --shape qwen3-0.6b --grad_ckpt --profile 15; el
b 150 --shape qwen3-0.6b --grad_ckpt --cuda_graphs; el
echo "== generate"; timeout 120 python3 docs/gpu_check.py generate --shape qwen3-0.6b 2>&1 | grep -v -i warn; el
b 200 --shape lfm2-2.6b --grad_ckpt --cuda_graphs; el
b 150 --shape qwen3-1.7b --grad_ckpt --cuda_graphs; el
b 150 --shape qwen3-0.6b --grad_ckpt off --token_budget 16384 --cuda_graphs; el  # the update without recomputation
python3 - "$O/bench.jsonl" <<'PY'
import json, sys, bench
rows = [json.loads(l) for l in open(sys.argv[1])]
print(bench.table(rows, rows[0]["device"] if rows else "?"))
PY
