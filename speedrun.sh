#!/usr/bin/env bash
# speedrun: from nothing to a tic-tac-toe master, offline, on a laptop CPU (a GPU is used when there is one).
#
#   bash speedrun.sh              # the full run: scratch model -> SFT on an imperfect teacher -> RL -> eval + certificate
#   QUICK=1 bash speedrun.sh      # a ~2-minute version of the same pipeline (the test suite runs it)
#   RESUME=1 bash speedrun.sh     # after a crash or a stop: the same settings again, each stage going on from its last
#                                 # checkpoint in OUT (a stage already finished does nothing, one without a checkpoint
#                                 # starts fresh); the logs are appended to and the report's times are this invocation's
#   SFT_STEPS=2200 RL_STEPS=100 OUT=out/long bash speedrun.sh   # settings: OUT, SEED, SFT_STEPS, RL_STEPS, EXPLOIT,
#                                 # N_EVAL, RL_FLAGS (more rl.py flags, after the recipe's: the last of a flag wins)
#
# RL from a teacher that plays random moves (TEACHER=rules, rules_wins, rules_then): speedrun_random_teacher.sh.
#
# 1-2. sft.py builds a small Llama + BPE tokenizer from scratch and trains it on games of the scripted minimax
# teacher that plays a random move with probability 0.2 (it loses real games against the optimal opponent; its lost
# games are dropped), each game starting up to 3 rounds in, so more of the data is the endgame, where the student
# erred most, and a step is cheaper; 3. rl.py (CISPO) from the SFT model on such games and, for half of each batch,
# on the lines where the certificate (re-run every EXPLOIT steps, ~10 s) shows it erring; 4. eval.py: teacher, SFT
# and RL model, greedy, from the empty board, against the optimal and the random opponent, and the certificate
# (every opponent line), the RL model being the weights of the exploiter's best certificate (OUT/rl_best);
# 5. scripts/speedrun_report.py: OUT/report.md, OUT/results.json and OUT/curves.png (when matplotlib is installed).
set -euo pipefail
cd "$(dirname "$0")"
if [ "${TEACHER:-minimax}" != minimax ]; then
  echo "TEACHER=$TEACHER: speedrun.sh runs the minimax teacher; use speedrun_random_teacher.sh for rules, rules_wins or rules_then" >&2
  exit 2
fi
OUT=${OUT:-out/speedrun}
SEED=${SEED:-0}  # SFT's and RL's --seed: the scratch model's init, the teacher's games, the RL examples
SFT_STEPS=${SFT_STEPS:-2200}
RL_STEPS=${RL_STEPS:-45}  # ~8-11 s a step on 2 cores
EXPLOIT=${EXPLOIT:-5}  # the exploiter: every EXPLOIT RL steps (0: off), certify the greedy policy and replay its mistakes
# the environments: every message lists each side's cells, so the small model reads the position as numbers; SFT's
# and RL's games start up to 3 rounds in; RL's heavier invalid-move penalty than the default 0.1 keeps the moves
# legal while RL explores (an invalid move only costs a turn); the evaluation's games start from the empty board;
# the scripted minimax teacher plays a random move 20% of the time (player_random_prob)
SFT_ENV='{"show_cells": true, "opening": 3, "player_random_prob": 0.2}'
RL_ENV='{"show_cells": true, "opening": 3, "invalid_penalty": 0.5}'
ENV='{"show_cells": true}'
TEACHER_ENV='{"show_cells": true, "player_random_prob": 0.2}'  # the evaluation's, with the teacher's random moves
if [ "${QUICK:-0}" = "1" ]; then
  # a model this small and short-trained rarely ends a reply: every evaluated reply runs to the token limit
  MAX_NEW=24
  SFT="--n_games 60 --vocab_size 300 --d_model 32 --n_layers 2 --n_heads 2 --max_steps 4 --eval_every 0 --eval_n 2"
  RL="--batch 16 --group 4 --steps 2 --max_new_tokens $MAX_NEW --eval_n 2 --save_every 15 --exploit $EXPLOIT"
  N_EVAL=${N_EVAL:-4}
else
  MAX_NEW=48  # tokens per reply: the longest think is about 40
  SFT="--n_games 24000 --batch 8 --lr 2e-3 --warmup 10 --max_steps $SFT_STEPS --eval_every 0 --save_every $((SFT_STEPS / 2)) --eval_n 20"
  RL="--batch 64 --group 8 --steps $RL_STEPS --lr 5e-5 --warmup 3 --temp 1.0 --max_new_tokens $MAX_NEW --eval_every 0 --eval_n 20 --save_every 15 --exploit $EXPLOIT"
  N_EVAL=${N_EVAL:-200}
fi
SFT="$SFT --keep format=1,loss=0 --seed $SEED"
RL="$RL --seed $SEED ${RL_FLAGS:-}"
RESUME_FLAG=""; TEE="tee"
if [ "${RESUME:-0}" = "1" ]; then RESUME_FLAG="--resume"; TEE="tee -a"; fi
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
SECONDS=0
stamp() { echo "[speedrun ${SECONDS}s] $*"; }

stamp "1-2. scratch model + SFT on the teacher (minimax, random moves p=0.2)"
python sft.py --model scratch --teacher minimax $SFT --env_args "$SFT_ENV" --out "$OUT/sft" $RESUME_FLAG | $TEE "$OUT/sft.log"
T_SFT=$SECONDS

stamp "3. RL from $OUT/sft"
# an earlier run's best weights (--exploit's OUT/rl_best) must not stand in for this run's (a resumed run's are its own)
if [ -z "$RESUME_FLAG" ]; then rm -rf "$OUT/rl_best"; fi
python rl.py --model "$OUT/sft" $RL --env_args "$RL_ENV" --out "$OUT/rl" $RESUME_FLAG | $TEE "$OUT/rl.log"
T_RL=$((SECONDS - T_SFT))

stamp "4. evaluation: $N_EVAL greedy games per opponent, and the certificate"
# one eval.py per model (loading it once): OUT/eval/WHO/optimal, .../random, .../exploit (its progress lines left out)
EVAL="--setting optimal random --exploit -n $N_EVAL --temp 0 --max_new_tokens $MAX_NEW"
python eval.py --model minimax $EVAL --env_args "$TEACHER_ENV" --show 1 --out "$OUT/eval/teacher" | grep -v "^certify: "
python eval.py --model "$OUT/sft" $EVAL --env_args "$ENV" --show 1 --out "$OUT/eval/sft" | grep -v "^certify: "
# the RL model: the weights of the exploiter's best certificate (rl.py --exploit keeps them in OUT/rl_best), if any
RL_MODEL="$OUT/rl"; if [ -d "$OUT/rl_best" ]; then RL_MODEL="$OUT/rl_best"; fi
python eval.py --model "$RL_MODEL" $EVAL --env_args "$ENV" --show 1 --out "$OUT/eval/rl" | grep -v "^certify: "
T_ALL=$SECONDS

stamp "5. report"
python scripts/speedrun_report.py "$OUT" --times "$T_SFT" "$T_RL" "$T_ALL" ${RESUME_FLAG:+--resumed} --teacher minimax --teacher_random_prob 0.2 \
  --sft_args "$SFT --env_args '$SFT_ENV'" --rl_args "$RL --env_args '$RL_ENV'" --env_args "$ENV"
stamp "done: $OUT/report.md"
