#!/usr/bin/env bash
# speedrun.sh's pipeline from a teacher that plays a uniformly random legal move: SFT teaches the format and the
# rules, RL has to find every bit of strategy (docs/RANDOM_TEACHER.md, docs/RESULTS.md).
# Its environment is tictactoe_lab (env_tictactoe_lab.py): the game with the research options it uses (the rules
# teachers, show_wins, puzzles, the extra rewards, exploration at the exploiter's replays).
#
#   TEACHER=rules_wins SHOW_WINS=true POLISH_STEPS=75 WINS_STEPS=300 bash speedrun_random_teacher.sh   # the recipe
#   QUICK=1 ..., RESUME=1 ...     # as in speedrun.sh: a ~2-minute version; each stage going on from its checkpoint
#   settings: OUT, SEED, TEACHER, SHOW_WINS, SFT_STEPS, RL_STEPS, PUZZLE_STEPS, PUZZLE_UNTIL, EXPLOIT, POLISH_STEPS,
#             WINS_STEPS, N_EVAL, RL_FLAGS (more rl.py flags, after the recipe's: the last of a flag wins)
#
# TEACHER=rules: the teacher's <think> lists the free cells; SFT, then 300 RL steps of games with the exploiter.
# TEACHER=rules_wins (the default): its <think> first states where each side could complete a line now (`Wins: me 7,
#   opponent none.`), which the student copies as it copies the format; RL learns to act on a stated threat from
#   one-decision puzzles (games that start where random play reached a threat, cut off after one reply that the
#   solver scores), not from whole games: first PUZZLE_STEPS steps of block and opening puzzles (the block stage),
#   then 120 steps of games and puzzles (a win to take or a threat to block, or an opening). RL left alone rewrites
#   the check as `Wins: me none, opponent none.`: a reward for a true one keeps it.
# TEACHER=rules_then: rules_wins's recipe, the think also ending with where it could complete a line after its move
#   (`Then: me 2 6.`), which the next turn's check copies; win puzzles in the block stage (without them it drops
#   the check's `me` part), a KL penalty to the block stage's model in the second (seeds 0 and 1: 119 and 151 lost
#   lines at step 120, behind rules_wins's 42 and 168).
# SHOW_WINS=true: every message also states where each side could complete a line now (`Wins now: you 7, opponent
#   none.`), so the model need not find its lines on the board; with a block stage it also brings start puzzles (a
#   game's first two replies: the lost lines left were forks at X's second move), the block stage run until its
#   solver reward averages PUZZLE_UNTIL=0.85 over 10 steps (10 steps at a time, up to 140), and the solver's reward 3x
#   in the second stage (seeds 0, 1, 2: 5, 13 and 45 lost lines); EXPLOIT=5 adds the exploiter to the second stage,
#   every other rollout of a replayed mistake playing another free cell there (seed 0: 0 lost lines).
# POLISH_STEPS=75: a third stage from OUT/rl, the exploiter every 5 steps, exploring at its replays, stopping at a
#   certificate with no mistake (seeds 0, 1, 2: 0, 0 and 15 lost lines). WINS_STEPS=300: where the third stage's best
#   certificate still loses a line, a fourth: the third again from its best weights, win puzzles among its puzzles
#   (seed 2 and seed 0 run in one piece: masters).
set -euo pipefail
cd "$(dirname "$0")"
OUT=${OUT:-out/random_teacher}
SEED=${SEED:-0}  # SFT's and RL's --seed: the scratch model's init, the teacher's games, the RL examples
TEACHER=${TEACHER:-rules_wins}
SHOW_WINS=${SHOW_WINS:-false}
POLISH_STEPS=${POLISH_STEPS:-0}
WINS_STEPS=${WINS_STEPS:-0}
# every message lists each side's cells (`You (X): 0 4. Opponent (O): 2.`), so the small model reads the position as numbers
case "$SHOW_WINS" in
  true) SHOW='"show_cells": true, "show_wins": true' ;;
  false) SHOW='"show_cells": true' ;;
  *) echo "SHOW_WINS=$SHOW_WINS: use true or false" >&2; exit 2 ;;
esac
# the puzzles: those of the block stage, one kind drawn per puzzle; those of the main RL stage (half of its batch);
# the fourth stage's ("win" second, as in the measured runs: a puzzle's kind is drawn by its place in the list)
PUZZLE_KINDS='"block", "block", "opening"'; MAIN_KINDS='"threat", "opening"'; WINS_KINDS='"threat", "win", "opening"'
# the block stage's episodes a step: 48 positions of 8 rollouts, about 32 blocks and 16 openings (with 8, its
# sampled block rate swung by 0.4 from step to step)
PUZZLE_BATCH=384
PUZZLE_MAX_STEPS=140
MAIN_EXPLORE=""  # the main RL stage's exploration at the exploiter's replays, if any
RL_MAIN_FLAGS=""  # rl.py flags of the main RL stage (and the third and fourth), not of the block stage
if [ "$TEACHER" = rules ]; then
  SFT_STEPS=${SFT_STEPS:-1000}; RL_STEPS=${RL_STEPS:-300}; EXPLOIT=${EXPLOIT:-5}; PUZZLE_STEPS=${PUZZLE_STEPS:-0}
  MAX_NEW=48
  SFT_ENV="{$SHOW, \"opening\": 0}"
  REWARDS=""; MAIN_REWARDS=""; PUZZLE_UNTIL=${PUZZLE_UNTIL:-0}
elif [ "$TEACHER" = rules_wins ] || [ "$TEACHER" = rules_then ]; then
  # more SFT, for the student to state the wins right; a longer think, so a higher token limit per reply
  SFT_STEPS=${SFT_STEPS:-2200}; RL_STEPS=${RL_STEPS:-120}; EXPLOIT=${EXPLOIT:-0}
  MAX_NEW=64
  # SFT's games start up to 3 rounds in, the opening's X moves random: the student learns the message a puzzle starts with
  SFT_ENV="{$SHOW, \"opening\": 3, \"opening_player\": \"random\"}"
  # rewards beyond the game's: a true `Wins:` check, and the solver's score of each move (optimal_reward)
  REWARDS=', "check_reward": 0.5, "optimal_reward": 1.0'; MAIN_REWARDS=$REWARDS
  if [ "$TEACHER" = rules_then ]; then
    PUZZLE_KINDS='"block", "block", "win", "opening"'; PUZZLE_BATCH=512; PUZZLE_STEPS=${PUZZLE_STEPS:-140}
    RL_MAIN_FLAGS="--beta 0.05"
  fi
  PUZZLE_STEPS=${PUZZLE_STEPS:-60}
  if [ "$SHOW_WINS" = true ]; then
    PUZZLE_KINDS="$PUZZLE_KINDS, \"start\""; MAIN_KINDS="$MAIN_KINDS, \"start\""; WINS_KINDS="$WINS_KINDS, \"start\""
    # one move that lets a drawn position go costs more than the games' results pay for it (seed 0: 5 lost lines, 13 at 1x)
    MAIN_REWARDS=', "check_reward": 0.5, "optimal_reward": 3.0'
    # seed 2's block stage had stalled near 0.66 at step 60 (seeds 0 and 1: 0.94 and 0.87, so they stop there)
    PUZZLE_UNTIL=${PUZZLE_UNTIL:-0.85}
    # with the exploiter, exploration at its replays in the second stage too
    if [ "$EXPLOIT" != 0 ]; then MAIN_EXPLORE=", \"replay_explore\": \"$TEACHER\""; fi
  fi
  PUZZLE_UNTIL=${PUZZLE_UNTIL:-0}
else
  echo "TEACHER=$TEACHER: use rules, rules_wins or rules_then (the minimax teacher: speedrun.sh)" >&2
  exit 2
fi
if [ "$WINS_STEPS" -gt 0 ] && { [ "$POLISH_STEPS" -eq 0 ] || [ "$PUZZLE_STEPS" -eq 0 ]; }; then
  echo "WINS_STEPS=$WINS_STEPS: the fourth stage needs a third (POLISH_STEPS > 0) and puzzles (TEACHER=rules_wins or rules_then)" >&2
  exit 2
fi
# the environments. RL: a heavier invalid-move penalty than the default 0.1 keeps the moves legal while RL explores
# (an invalid move only costs a turn), every game from the empty board; the block stage: puzzles alone; the main
# stage: half of its batch puzzles, where there is a block stage; the third and fourth stages: the exploiter's
# replays explored (at the position of a replayed mistake every other rollout plays another free cell, in the
# teacher's words), the stage ending at a certificate with no mistake; the evaluation: games from the empty board
PUZZLES=""; WINS_PUZZLES=""
if [ "$PUZZLE_STEPS" -gt 0 ]; then
  PUZZLES=", \"puzzles\": 0.5, \"puzzle_kind\": [$MAIN_KINDS]"; WINS_PUZZLES=", \"puzzles\": 0.5, \"puzzle_kind\": [$WINS_KINDS]"
fi
EXPLORE=", \"replay_explore\": \"$TEACHER\""
PUZZLE_ENV="{$SHOW, \"invalid_penalty\": 0.5$REWARDS, \"puzzles\": 1.0, \"puzzle_kind\": [$PUZZLE_KINDS]}"
RL_ENV="{$SHOW, \"opening\": 0, \"invalid_penalty\": 0.5$MAIN_REWARDS$MAIN_EXPLORE$PUZZLES}"
POLISH_ENV="{$SHOW, \"opening\": 0, \"invalid_penalty\": 0.5$MAIN_REWARDS$EXPLORE$PUZZLES, \"exploit_stop\": true}"
WINS_ENV="{$SHOW, \"opening\": 0, \"invalid_penalty\": 0.5$MAIN_REWARDS$EXPLORE$WINS_PUZZLES, \"exploit_stop\": true}"
ENV="{$SHOW}"
if [ "${QUICK:-0}" = "1" ]; then
  # a model this small and short-trained rarely ends a reply: every evaluated reply runs to the token limit
  MAX_NEW=24
  SFT="--n_games 60 --vocab_size 300 --d_model 32 --n_layers 2 --n_heads 2 --max_steps 4 --eval_every 0 --eval_n 2"
  RL="--batch 16 --group 4 --steps 2 --max_new_tokens $MAX_NEW --eval_n 2 --save_every 15 --exploit $EXPLOIT"
  N_EVAL=${N_EVAL:-4}
  if [ "$PUZZLE_STEPS" -gt 0 ]; then PUZZLE_STEPS=2; PUZZLE_BATCH=16; PUZZLE_MAX_STEPS=4; fi
else
  # SFT: one pass over the teacher's games, all kept (keeping the won ones would select for strategy)
  SFT="--n_games $((SFT_STEPS * 8)) --batch 8 --lr 2e-3 --warmup 10 --max_steps $SFT_STEPS --eval_every 0 --save_every $((SFT_STEPS / 2)) --eval_n 20"
  RL="--batch 64 --group 8 --steps $RL_STEPS --lr 2e-4 --warmup 3 --temp 1.0 --max_new_tokens $MAX_NEW --eval_every 0 --eval_n 20 --save_every 15 --exploit $EXPLOIT"
  N_EVAL=${N_EVAL:-200}
fi
SFT="$SFT --keep all --seed $SEED"
RL_MAIN="$RL --seed $SEED $RL_MAIN_FLAGS ${RL_FLAGS:-}"  # the main, third and fourth stages'
RL="$RL --seed $SEED ${RL_FLAGS:-}"  # the block stage's
RESUME_FLAG=""; TEE="tee"
if [ "${RESUME:-0}" = "1" ]; then RESUME_FLAG="--resume"; TEE="tee -a"; fi
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
SECONDS=0
stamp() { echo "[speedrun ${SECONDS}s] $*"; }

stamp "1-2. scratch model + SFT on the teacher (--teacher $TEACHER)"
python sft.py --model scratch --env tictactoe_lab --teacher $TEACHER $SFT --env_args "$SFT_ENV" --out "$OUT/sft" $RESUME_FLAG | $TEE "$OUT/sft.log"
T_SFT=$SECONDS

RL_FROM="$OUT/sft"
PUZZLE_RL=""
if [ "$PUZZLE_STEPS" -gt 0 ]; then
  stamp "3a. RL on puzzles ($PUZZLE_KINDS) from the SFT model"
  PUZZLE_RL="$RL --steps $PUZZLE_STEPS --exploit 0 --batch $PUZZLE_BATCH"
  python rl.py --model "$OUT/sft" --env tictactoe_lab $PUZZLE_RL --env_args "$PUZZLE_ENV" --out "$OUT/rl_puzzles" $RESUME_FLAG | $TEE "$OUT/rl_puzzles.log"
  # PUZZLE_UNTIL: resumed 10 steps at a time until the solver's reward averages PUZZLE_UNTIL over its last 10 steps
  # (a resume goes on exactly where it stopped)
  while [ "$PUZZLE_UNTIL" != "0" ] && [ "$PUZZLE_STEPS" -lt "$PUZZLE_MAX_STEPS" ] \
      && ! python env_tictactoe_lab.py --puzzle_learnt "$OUT/rl_puzzles/metrics.jsonl" "$PUZZLE_UNTIL"; do
    PUZZLE_STEPS=$((PUZZLE_STEPS + 10 < PUZZLE_MAX_STEPS ? PUZZLE_STEPS + 10 : PUZZLE_MAX_STEPS))
    PUZZLE_RL="$RL --steps $PUZZLE_STEPS --exploit 0 --batch $PUZZLE_BATCH"
    python rl.py --model "$OUT/sft" --env tictactoe_lab $PUZZLE_RL --env_args "$PUZZLE_ENV" --out "$OUT/rl_puzzles" --resume | tee -a "$OUT/rl_puzzles.log"
  done
  RL_FROM="$OUT/rl_puzzles"
fi

rl_stage() {  # rl.py from model $1 with flags $2 and environment $3 into OUT/$4, its log OUT/$4.log
  # an earlier run's best weights (--exploit's OUT/$4_best) must not stand in for this run's (a resumed run's are its own)
  if [ -z "$RESUME_FLAG" ]; then rm -rf "$OUT/$4_best"; fi
  python rl.py --model "$1" --env tictactoe_lab $2 --env_args "$3" --out "$OUT/$4" $RESUME_FLAG | $TEE "$OUT/$4.log"
}
stamp "3. RL from $RL_FROM"
rl_stage "$RL_FROM" "$RL_MAIN" "$RL_ENV" rl
RL_FINAL="rl"  # the RL stage whose best certificate's weights are the RL model
POLISH_RL=""
if [ "$POLISH_STEPS" -gt 0 ]; then
  POLISH_RL="$RL_MAIN --steps $POLISH_STEPS --exploit 5"  # the last of a flag wins
  stamp "3b. RL from $OUT/rl: the exploiter, exploring at its replays"
  rl_stage "$OUT/rl" "$POLISH_RL" "$POLISH_ENV" rl_polish
  RL_FINAL="rl_polish"
fi
WINS_RL=""
if [ "$WINS_STEPS" -gt 0 ] && python env_tictactoe_lab.py --lost_lines "$OUT/rl_polish_best/exploit.json"; then
  WINS_RL="$RL_MAIN --steps $WINS_STEPS --exploit 5"
  stamp "3c. RL from $OUT/rl_polish_best: the third stage again, win puzzles among its puzzles"
  rl_stage "$OUT/rl_polish_best" "$WINS_RL" "$WINS_ENV" rl_wins
  RL_FINAL="rl_wins"
fi
T_RL=$((SECONDS - T_SFT))

stamp "4. evaluation: $N_EVAL greedy games per opponent, and the certificate"
# one eval.py per model (loading it once): OUT/eval/WHO/optimal, .../random, .../exploit (its progress lines left out)
EVAL="--setting optimal random --exploit -n $N_EVAL --temp 0 --max_new_tokens $MAX_NEW"
python eval.py --model $TEACHER --env tictactoe_lab $EVAL --env_args "$ENV" --show 1 --out "$OUT/eval/teacher" | grep -v "^certify: "
python eval.py --model "$OUT/sft" --env tictactoe_lab $EVAL --env_args "$ENV" --show 1 --out "$OUT/eval/sft" | grep -v "^certify: "
# the RL model: the last RL stage's, the weights of the exploiter's best certificate (rl.py --exploit keeps them in DIR_best)
RL_MODEL="$OUT/$RL_FINAL"; if [ -d "$RL_MODEL"_best ]; then RL_MODEL="$RL_MODEL"_best; fi
python eval.py --model "$RL_MODEL" --env tictactoe_lab $EVAL --env_args "$ENV" --show 1 --out "$OUT/eval/rl" | grep -v "^certify: "
T_ALL=$SECONDS

stamp "5. report"
python scripts/speedrun_report.py "$OUT" --times "$T_SFT" "$T_RL" "$T_ALL" ${RESUME_FLAG:+--resumed} --env tictactoe_lab --teacher "$TEACHER" \
  --sft_args "$SFT --env_args '$SFT_ENV'" --rl_args "$RL_MAIN --env_args '$RL_ENV'" --env_args "$ENV" \
  ${PUZZLE_RL:+--puzzle_args "$PUZZLE_RL --env_args '$PUZZLE_ENV'"} ${POLISH_RL:+--polish_args "$POLISH_RL --env_args '$POLISH_ENV'"} \
  ${WINS_RL:+--wins_args "$WINS_RL --env_args '$WINS_ENV'"}
stamp "done: $OUT/report.md"
