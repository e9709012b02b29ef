#!/usr/bin/env bash
# The experiments that could take Qwen3-0.6B's step nearer its floors, after docs/gpu_bench.sh (about 8 minutes;
# a call cut off keeps what ran). In order:
#   1. the standard step on Qwen3-0.6B with each experiment, to compare with gpu_bench.sh's run just before on the
#      same machine: decoding through the compiled layers; checkpointing on every other layer only;
#   2. one turn through the engine: eager, graphs with SDPA, graphs with matrix products, and the same with the
#      layers compiled inside the graph (docs/gpu_check.py compile_decoding, an experiment);
#   3. --fsdp under torchrun on the one GPU (NCCL, bf16 gathered weights, both engines) against no --fsdp.
# Logs and bench.jsonl go to $OUT (default out/gpu).   OUT=$OUT bash docs/gpu_next.sh   # on the device machine
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
O=${OUT:-out/gpu}; mkdir -p "$O"
exec > >(tee -a "$O/log.txt") 2>&1
start=$(date +%s); el() { echo "[elapsed $(( $(date +%s) - start )) s]"; }
f() { grep -v -i "warn\|^|---\|^Device\|^$\|^| shape"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== bench qwen3-0.6b, layers compiled for decoding too (experiment)"
timeout 150 python3 -c "import sys; sys.path.insert(0, 'docs'); import gpu_check, bench; gpu_check.compile_decoding(); bench.main()" \
  --out "$O/bench_compiled_decoding.jsonl" --shape qwen3-0.6b 2>&1 | f | tail -4; el
echo "== bench qwen3-0.6b, every other layer checkpointed (experiment)"
timeout 100 python3 -c "import sys; sys.path.insert(0, 'docs'); import gpu_check, bench; gpu_check.checkpoint_half(); bench.main()" \
  --out "$O/bench_checkpoint_half.jsonl" --shape qwen3-0.6b 2>&1 | f | tail -4; el
echo "== one turn"; timeout 150 python3 docs/gpu_check.py generate --engine_only 2>&1 | f | tail -5; el
echo "== --fsdp on one GPU (torchrun, 1 rank; NCCL, bf16 gathered weights): each engine, and without --fsdp"
timeout 120 python3 sft.py --model scratch --n_games 200 --max_steps 200 --eval_every 0 --eval_n 10 \
  --out "$O/fsdp_sft" 2>&1 | grep "^done"
R="rl.py --model $O/fsdp_sft --batch 64 --group 8 --steps 3 --eval_every 0 --eval_n 10 --temp 1.1 --max_new_tokens 32"
for e in fast hf; do
  timeout 120 torchrun --standalone --nproc_per_node 1 $R --engine $e --fsdp --out "$O/fsdp_$e" 2>&1 \
    | grep "held per rank\|^step 3 | reward\|^done\|Error" | cut -c1-160
done
timeout 90 python3 $R --out "$O/fsdp_none" 2>&1 | grep "^step 3 | reward\|^done" | cut -c1-160; el
