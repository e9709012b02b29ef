#!/usr/bin/env bash
# The GPU measurements in one call of under 10 minutes (device time is short), the most wanted first, each part
# with its own time limit so that a call cut off keeps what ran:
#   1. the standing benchmark on the three real shapes, both engines of a shape in one process: the fast engine
#      first (its warm-up step pays the compiled update's compilation: 54-86 s on an H200), then generate(), the
#      reference engine, which reuses that compilation; STEPS timed steps each (default 1, so that three shapes
#      fit one call);
#   2. the GPU tests (tests/test_gpu.py: the engine's exactness on five architectures, the bf16 update, the
#      compiled update, a 2-step rl.py) in the time left; on a still-warm machine, a second call runs them whole:
#      python3 -m pytest tests/test_gpu.py -v
# Logs, bench.jsonl and the tests' report go to $OUT (default out/gpu).
#   OUT=$OUT bash docs/gpu_bench.sh                               # on the device machine
#   SHAPES="tiny" bash docs/gpu_bench.sh                          # on a CPU: checks this script itself
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
O=${OUT:-out/gpu}; mkdir -p "$O"
exec > >(tee -a "$O/log.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
start=$(date +%s); el() { echo "[elapsed $(( $(date +%s) - start )) s]"; }
b() { local t=$1; shift; echo "== bench $*"; timeout "$t" python3 bench.py --out "$O/bench.jsonl" "$@" 2>&1 \
  | grep -v -i "warn\|^$\|^Device\|^| shape\|^|---"; el; }
read -r -a shapes <<< "${SHAPES:-qwen3-0.6b lfm2-2.6b qwen3-1.7b}"
limits=(190 240 200)
for i in "${!shapes[@]}"; do
  b "${limits[$i]}" --shape "${shapes[$i]}" --grad_ckpt --engine fast hf --steps "${STEPS:-1}"
done
python3 - "$O/bench.jsonl" <<'PY'
import json, sys, bench
rows = [json.loads(l) for l in open(sys.argv[1])]
print(bench.table(rows, rows[0]["device"] if rows else "?"))
PY
left=$(( 585 - $(date +%s) + start ))
echo "== tests/test_gpu.py (${left} s left)"
timeout "$(( left > 20 ? left : 20 ))" python3 -m pytest tests/test_gpu.py -v -p no:cacheprovider --durations 8 2>&1 \
  | grep -v -i "warn" > "$O/test_gpu.txt"
grep -E "PASSED|FAILED|ERROR|passed|failed|slowest|^[0-9.]+s " "$O/test_gpu.txt"; el
