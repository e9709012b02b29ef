#!/usr/bin/env bash
# The GPU measurements in one call (device time is short), the most wanted first, each part with its own time limit
# so that a call cut off keeps what ran: the engine's exactness; the standing benchmark on the three real shapes with
# the fast engine (the update compiled: its compilation falls in each shape's warm-up step), then the same shapes
# with generate(), the reference engine, for the README's side-by-side table; then one turn through the engine
# against model.generate(), one rank under torchrun against plain python (needs a trained tic-tac-toe model in
# .gpu/sft, carried: copy any sft output there), and eager decoding under the profiler.
# The fast-engine parts took about 5 minutes on 2026-11-26; give the call the 10 minutes a command may run.
# Logs, bench.jsonl and the two runs' metrics go to $OUT (default out/gpu).
#   OUT=$OUT bash docs/gpu_bench.sh          # on the device machine
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
O=${OUT:-out/gpu}; mkdir -p "$O"
exec > >(tee -a "$O/log.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
b() { local t=$1; shift; echo "== bench $*"; timeout "$t" python3 bench.py --out "$O/bench.jsonl" "$@" 2>&1 | grep -v -i warn; return "${PIPESTATUS[0]}"; }
start=$(date +%s); el() { echo "[elapsed $(( $(date +%s) - start )) s]"; }
echo "== exact"; timeout 70 python3 docs/gpu_check.py exact 2>&1 | grep -v -i warn; el
b 110 --shape qwen3-0.6b --grad_ckpt --engine fast; el
b 120 --shape lfm2-2.6b --grad_ckpt --engine fast; el
b 90 --shape qwen3-1.7b --grad_ckpt --engine fast; el
for shape in qwen3-0.6b qwen3-1.7b lfm2-2.6b; do b 100 --shape $shape --grad_ckpt --engine hf; el; done
echo "== generate"; timeout 150 python3 docs/gpu_check.py generate --shape qwen3-0.6b 2>&1 | grep -v -i warn; el
if [ -f .gpu/sft/config.json ]; then  # torchrun's one rank against one process: the same RL run, one after the other
  for launch in python3 "python3 -m torch.distributed.run --standalone --nproc_per_node 1"; do
    name=$([ "$launch" = python3 ] && echo python || echo torchrun); echo "== rl.py under $name"
    timeout 40 $launch rl.py --model .gpu/sft --batch 64 --group 8 --steps 6 --eval_every 0 --eval_n 2 --save_every 0 \
      --max_new_tokens 48 --env_args '{"show_cells": true, "show_wins": true}' --out "/tmp/rl_$name" 2>&1 | grep -E "^step|^done|Error" | cut -c1-200
    cp "/tmp/rl_$name/metrics.jsonl" "$O/rl_$name.jsonl"; el
  done
fi
b 90 --shape qwen3-0.6b --grad_ckpt --eager --profile 12; el  # eager decoding, for the graphs' gain, and where time goes
python3 - "$O/bench.jsonl" <<'PY'
import json, sys, bench
rows = [json.loads(l) for l in open(sys.argv[1])]
print(bench.table(rows, rows[0]["device"] if rows else "?"))
PY
