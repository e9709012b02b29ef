"""
RL with verifiable rewards: a readable GRPO/CISPO loop for one GPU.

    python rl.py --model out/speedrun/sft --batch 64 --group 8 --steps 45 --lr 5e-5 --warmup 3 --temp 1.0 \
        --max_new_tokens 48 --eval_every 0 --eval_n 20 --save_every 15 --exploit 5 --seed 0 \
        --env_args '{"show_cells": true, "opening": 3, "invalid_penalty": 0.5}' --out out/speedrun/rl   # the speedrun's RL (CPU, 5-9 min)
    python rl.py --batch 256 --temp 1.1                   # GPU: RL from out/sft (a 0.35B-2B model fits one GPU)
    python rl.py --env reverse --batch 64 --group 8 --max_new_tokens 32 --model out/sft_reverse
    python rl.py --model out/sft --batch 16 --group 4 --steps 2 --eval_every 0 --out /tmp/rl   # CPU smoke run
    torchrun --standalone --nproc_per_node 8 rl.py --batch 256 --temp 1.1   # data parallel: 8 GPUs, the same global batch

Under torchrun (one process per GPU) every rank rolls out its share of each step's examples, whole groups, and
the gradients are summed over the ranks, so N ranks take the update one process takes from the same --batch;
rank 0 alone logs, evaluates, certifies and saves (common.py, "several processes").

One step, in the order of this file:
  1. rollouts: take E = batch/group consecutive examples (the environment stratifies difficulty over consecutive
     examples, so every batch is balanced) and roll each out `group` times at --temp; rollouts of one example
     share its seed, so the opponent answers the same position the same way and rewards differ only by policy;
     an episode's sampling draws are keyed by (--seed, its number in the run, its rollout, turn), not by the
     batch it is sampled in, so the rollouts are the same whatever --gen_batch or the number of ranks;
  2. group advantages: A = R - mean(R of its group)  (--scale_rewards group: / std of the group, as in GRPO);
  3. the loss on the sampled tokens only (the trajectory `mask`), recomputed from the exact token ids of the
     rollouts (the batch's common prefix, the system prompt, runs once: common.decoder_hidden), logits divided
     by the sampling temperature so the logprobs describe the sampled distribution;
  4. the update: one optimizer step per batch (--minibatch / --ppo_epochs for several, where the ratio matters);
     on a GPU a big model's decoder layers run compiled for it (--compile), fp32 weights under bf16 autocast;
  5. the loop: log, evaluate, checkpoint, repeat.

--exploit N: an exploiter, for an environment with an exploit(policy) hook (tic-tac-toe: its certificate, the
greedy policy against every opponent line). Every N steps the hook finds the lines where the greedy policy makes
a mistake; up to half of each step's examples then replay them (tic-tac-toe: from the empty board, the
opponent's moves scripted along the line, or with replay_from "mistake" from the position of the mistake; the
opponent optimal after it), so the groups compare a repeat of the mistake with the other moves sampled there.
A fix can break another line, so the weights of the best certificate (also checked after the last step) are
kept in DIR_best: a model proved over every line, like eval.py --certify. A mistake the policy is sure of is
repeated by its whole group, which then holds no better move to learn from; tic-tac-toe's replay_explore has every
other rollout play another move there (the environment's forced_reply hook). --exploit_stop ends the run at the
first certificate that finds no mistake: nothing is left for the exploiter to teach.

Losses (see policy_loss): cispo (default) = -sg(clip(r, 1-eps_low, 1+eps_high)) * A * log pi, with the upper
cap 1+eps_high (default 1.2) and no lower clip unless --eps_low is given; grpo = PPO's clipped objective.

Simplifications, on purpose:
  - on-policy by default: with one optimizer step per batch the "old" logprobs are the current ones, r = 1,
    and both losses reduce to REINFORCE with a group-mean baseline; the clip only acts with several updates
    per batch (old logprobs are then recomputed by a no-grad pass before the first update);
  - one advantage per episode: every token the model sampled in a multi-turn game gets the game's advantage
    (no per-turn credit assignment, no value function, no discount);
  - no KL penalty unless --beta > 0 (then a frozen reference copy is loaded), no entropy bonus;
  - generation on the training weights by sample.py's own decoding loop over the HF model (no vLLM, no async, no
    paged attention): each rollout batch keeps one KV cache with a row per episode for the whole game; a group's
    rollouts share their prompt's encoding, then each goes on in its own row;
  - a reply the environment forces (its forced_reply hook: exploration) is trained like a sampled one, with its
    advantage and no importance weight, so there the update is not the policy's gradient: it pulls the policy
    toward a forced move that did better than its group, and away from one that did worse;
  - episodes whose advantage is 0 (e.g. groups whose rewards are all equal) are skipped in the backward
    pass (they carry no gradient) but still count in the token normalisation.
Outputs in DIR (default out/rl): metrics.jsonl (one JSON line per step), curves.png (if matplotlib is
installed), eval rollouts, and a checkpoint (save_pretrained + trainer_state.pt) every --save_every steps.
"""
import argparse
import math
import os
import random
import sys
import time

import torch

from eval import evaluate_standard, plot_curves
from common import (TRAIN_FLAG_RULES, add_train_args, at_least, check_flags, check_ranks_agree, checkpoint_to_resume,
                    compile_layers, compiled_layers, disk_full_says_what_is_kept, enable_grad_ckpt, finish_save,
                    from_rank0, gather_from_ranks, load_env, load_model, log_eval, log_line, lr_at, non_negative,
                    pad_batch, parse_env_args, pick_device, positive, rng_state, save_checkpoint, start_or_resume,
                    start_ranks, stop_ranks, sum_gradients, sum_over_ranks, token_logprobs, token_microbatches, train_autocast)
from sample import POLICY_FLAG_RULES, HFPolicy, NonFiniteLogits, rollout, show

# ----------------------------------------------------------------------------- 1. rollouts


def step_examples(env, n_examples, seed, step, replays=None):
    """The examples of one step: a function of (seed, step), so a resumed run sees the same ones. With --exploit,
    up to half of them replay, in turn, the lines where the policy erred (`replays`, from the environment's
    exploit hook); each keeps only its example's seed, which decides what the opponent does after the line."""
    examples = env.examples(n_examples, seed=seed * 1_000_003 + step)
    k = min(len(replays or []), n_examples // 2)
    for j in range(k):
        examples[j] = {"seed": examples[j]["seed"], **replays[(step * k + j) % len(replays)]}
    return examples


def sample_rollouts(env, examples, policy, group, first_index):
    """`group` rollouts of every example (sample.rollout: records ordered example by example). The examples are
    numbered from first_index, a number no other example of the run has: an episode's random draws are keyed by
    (seed, its number, its rollout, turn)."""
    try:
        return rollout(env, examples, policy, group=group, start_index=first_index, progress=False)
    except torch.OutOfMemoryError as e:  # the rollout batches' KV caches grow with every turn: say what to turn down
        raise SystemExit(f"out of GPU memory in the rollouts: lower --gen_batch (episodes per rollout batch, now "
                         f"{policy.batch_size}) or --max_new_tokens ({policy.max_new_tokens}).\n  ({str(e)[:200]})") from e
    except NonFiniteLogits as e:
        raise SystemExit(f"{e}: resume from the last checkpoint (--resume) with a lower --lr") from e


# ----------------------------------------------------------------------------- 2. group advantages


def group_advantages(rewards, group, scale_rewards="none"):
    """Advantages (B,) of the B = E * group episodes of a step, laid out as `rollout` returns them: example by
    example, the `group` rollouts of one example side by side.

    A = R - mean(R of the episode's group); --scale_rewards group also divides by the group's standard deviation
    (with Bessel's correction, as torch.std and TRL; + 1e-4 so that a group of equal rewards gives 0, not NaN).
    A group of equal rewards gives exactly 0, so the update skips it: each reward is first taken relative to its
    group's first one (exact for equal rewards), as R - mean(R) of eight rewards of 0.7 would leave about 6e-08."""
    rewards = torch.as_tensor(rewards, dtype=torch.float64).view(-1, group)  # (E, G)
    rewards = rewards - rewards[:, :1]
    adv = rewards - rewards.mean(1, keepdim=True)
    if scale_rewards == "group":
        adv = adv / (rewards.std(1, keepdim=True) + 1e-4)
    return adv.float().flatten()  # (B,)


# ----------------------------------------------------------------------------- 3. the loss


def kl_k3(logp, ref_logp):
    """Per-token k3 estimate of KL(policy || reference) from sampled tokens' logprobs: exp(d) - d - 1 with
    d = ref - logp, >= 0 and unbiased (Schulman's k3)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def policy_loss(logp, old_logp, adv, weight, loss="cispo", eps_low=None, eps_high=0.2, ref_logp=None, beta=0.0):
    """Sum over tokens of weight * per-token loss; every argument is (N,) over the loss tokens.

    r = exp(logp - old_logp), A = the token's episode advantage
      cispo: l = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp   (no lower clip when eps_low is None)
      grpo:  l = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)  (eps_low None -> 0.2; eps_high 0.28 = DAPO clip-higher)
      KL (beta > 0): l += beta * (exp(ref - logp) - (ref - logp) - 1)   (the k3 estimator, >= 0)
    weight = 1 / (loss tokens in the batch) for token-level averaging (DAPO, CISPO), or
             1 / (tokens of the episode * episodes in the batch) for per-sequence averaging (GRPO).
    Returns (loss, clipped) where clipped marks tokens whose ratio hit a bound."""
    ratio = torch.exp(logp - old_logp)
    hi = 1.0 + eps_high
    if loss == "cispo":
        lo = None if eps_low is None else 1.0 - eps_low
        per_token = -ratio.clamp(min=lo, max=hi).detach() * adv * logp
        clipped = (ratio > hi) | ((ratio < lo) if lo is not None else torch.zeros_like(ratio, dtype=torch.bool))
    elif loss == "grpo":
        lo = 1.0 - (0.2 if eps_low is None else eps_low)
        per_token = -torch.min(ratio * adv, ratio.clamp(lo, hi) * adv)
        clipped = ((ratio > hi) & (adv > 0)) | ((ratio < lo) & (adv < 0))
    else:
        raise ValueError(f"unknown loss {loss!r}: cispo or grpo")
    if beta > 0:
        per_token = per_token + beta * kl_k3(logp, ref_logp)
    return (per_token * weight).sum(), clipped


def loss_weights(n_tokens, loss_agg, batch_tokens, batch_episodes):
    """The weight of each loss token, per episode, from the episodes' loss-token counts: token-level averaging
    (DAPO, CISPO) gives every token of the batch 1 / (loss tokens in the batch); per-sequence averaging (GRPO)
    gives 1 / (tokens of its episode * episodes in the batch). The batch is the whole step's (`batch_tokens`,
    `batch_episodes`: summed over the ranks under torchrun, so N ranks compute one process's update). Every
    episode of the batch counts, also one whose advantage is 0 and which the update therefore skips. Several
    optimizer steps per batch (--minibatch) keep these whole-batch weights."""
    if loss_agg == "token":
        return [1.0 / max(batch_tokens, 1)] * len(n_tokens)
    return [1.0 / (max(t, 1) * batch_episodes) for t in n_tokens]


# ----------------------------------------------------------------------------- 4. the update


def update(model, records, adv, args, opt, amp, ref_model=None, first=0, batch=None):
    """The optimizer step(s) of one batch. records: rollouts with ids/mask/logprobs; adv: (len(records),) advantages.
    Under torchrun, `records` are episodes first .. first + len(records) - 1 of the step's `batch`; each optimizer
    step sums the ranks' gradients (common.sum_gradients) and every rank takes the same step.

    The batch is split into --minibatch episodes per optimizer step (all of it by default), each taken --ppo_epochs
    times; with more than one step the importance ratio is against the logprobs from before the first one. Every
    optimizer step accumulates micro-batches of at most --token_budget padded tokens (same gradient)."""
    n_episodes, batch = len(records), batch or len(records)
    n_tokens = [sum(r["mask"][1:]) for r in records]  # loss tokens: position t predicts token t + 1
    weights = loss_weights(n_tokens, args.loss_agg, sum_over_ranks([sum(n_tokens)])[0], batch)
    trained = [i for i in range(n_episodes) if n_tokens[i] and (adv[i] != 0 or args.beta > 0)]  # the rest has no gradient
    per_step = args.minibatch or batch
    minibatches = [[i for i in trained if lo <= first + i < lo + per_step] for lo in range(0, batch, per_step)]
    several_steps = args.ppo_epochs > 1 or len(minibatches) > 1
    device = model.device

    def micro_batches(episodes):
        """(ids, mask, advantage per token, weight per token) for each micro-batch of `episodes`."""
        for micro in token_microbatches([len(records[i]["ids"]) for i in episodes], args.token_budget):
            micro = [episodes[j] for j in micro]
            ids, mask = pad_batch(([records[i]["ids"] for i in micro], [records[i]["mask"] for i in micro]), 0, device)  # (B, T)
            per_token = lambda vals: torch.cat([torch.full((n_tokens[i],), float(vals[i])) for i in micro]).to(device)  # (N,)
            yield micro, ids, mask, per_token(adv.tolist()), per_token(weights)

    # --compile: the layers run compiled for the forwards, the checkpoint recomputation and the backward alike
    with compiled_layers(model):
        before = {}  # episode -> (logprobs before any update, the reference's logprobs), from a no-grad pass
        if several_steps or args.beta > 0:
            with torch.no_grad(), amp:
                for micro, ids, mask, _, _ in micro_batches(trained):
                    sizes = [n_tokens[i] for i in micro]
                    old = token_logprobs(model, ids, mask, args.temp)[0].split(sizes)
                    ref = token_logprobs(ref_model, ids, mask, args.temp)[0].split(sizes) if ref_model else [None] * len(micro)
                    before.update({i: (o, r) for i, o, r in zip(micro, old, ref)})

        stats = {"entropy": 0.0, "clip_frac": 0.0, "grad_norm": 0.0, "logp_mismatch": 0.0, "kl": 0.0, "train_tokens": 0, "skipped": 0}
        counted = 0
        for epoch in range(args.ppo_epochs):
            for minibatch in minibatches:
                if not sum_over_ranks([len(minibatch)])[0]:  # no episode with a gradient in any rank's share: no step
                    continue
                total_loss = 0.0
                for micro, ids, mask, adv_tok, weight_tok in micro_batches(minibatch):
                    with amp:
                        logp, entropy = token_logprobs(model, ids, mask, args.temp)  # (N,)
                    old_logp = torch.cat([before[i][0] for i in micro]) if several_steps else logp.detach()
                    ref_logp = torch.cat([before[i][1] for i in micro]) if ref_model else None
                    loss, clipped = policy_loss(logp, old_logp, adv_tok, weight_tok, args.loss, args.eps_low, args.eps_high, ref_logp, args.beta)
                    loss.backward()
                    total_loss += loss.item()
                    if epoch == 0:  # how far the trainer's logprobs (before any update) are from the sampler's
                        sampled = torch.tensor([lp for i in micro for lp, m in zip(records[i]["logprobs"][1:], records[i]["mask"][1:]) if m], device=device)
                        stats["logp_mismatch"] += (old_logp - sampled).abs().sum().item()
                    stats["entropy"] += entropy.sum().item()
                    if ref_logp is not None:  # the penalty's own estimate, logged
                        stats["kl"] += kl_k3(logp.detach(), ref_logp).sum().item()
                    stats["clip_frac"] += clipped.float().sum().item()
                    stats["train_tokens"] += int(mask.numel())
                    counted += len(logp)
                sum_gradients(model)
                total_loss = sum_over_ranks([total_loss])[0]
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
                if not (math.isfinite(total_loss) and torch.isfinite(grad_norm)):
                    print(f"warning: non-finite loss {total_loss} or grad norm {grad_norm.item()}: update skipped")
                    opt.zero_grad(set_to_none=True)
                    stats["skipped"] += 1
                    continue
                opt.step()
                opt.zero_grad(set_to_none=True)
                stats["grad_norm"] = grad_norm.item()
    keys = ("entropy", "clip_frac", "logp_mismatch", "kl", "train_tokens")
    *sums, counted = sum_over_ranks([stats[k] for k in keys] + [counted])
    stats.update(zip(keys, sums))
    stats["entropy"] /= max(counted, 1)
    stats["clip_frac"] /= max(counted, 1)
    stats["kl"] /= max(counted, 1)
    stats["logp_mismatch"] /= max(counted // args.ppo_epochs, 1)
    return stats


# ----------------------------------------------------------------------------- logs: step metrics, curves


def batch_metrics(records, env):
    """Step metrics from the rollouts: reward and components, environment metrics, reply lengths."""
    n = len(records)
    out = {"reward": sum(r["reward"] for r in records) / n}
    for k in records[0]["rewards"]:
        out[f"reward_{k}"] = sum(r["rewards"][k] for r in records) / n
    for k in records[0].get("metrics", {}):
        if not k.startswith("n_"):
            out[k] = sum(r["metrics"][k] for r in records) / n
    lengths = []  # tokens of each reply: runs of mask == 1
    for r in records:
        run = 0
        for m in r["mask"] + [0]:
            if m:
                run += 1
            elif run:
                lengths.append(run)
                run = 0
    out["reply_len"] = sum(lengths) / max(len(lengths), 1)
    out["reply_len_max"] = max(lengths, default=0)
    out["truncated"] = sum(r.get("truncated", 0) for r in records) / max(len(lengths), 1)
    return out


# ----------------------------------------------------------------------------- 5. the loop


def parse_args(argv=None):
    """rl.py's flags (bench.py reads the same defaults)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="out/sft", help="hub id or save_pretrained directory to start from (default: the SFT output)")
    p.add_argument("--env", default="tictactoe", help="environment NAME (env_NAME.py)")
    p.add_argument("--env_args", default="{}", help="JSON keyword arguments for load_environment(); num_groups defaults to batch/group")
    p.add_argument("--batch", type=int, default=256, help="episodes per step (batch/group examples x group rollouts)")
    p.add_argument("--group", type=int, default=8, help="rollouts per example")
    p.add_argument("--temp", type=float, default=1.0, help="sampling temperature (the loss uses the same)")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling (1.0 keeps logprobs exact)")
    p.add_argument("--max_new_tokens", type=int, default=128, help="max generated tokens per turn")
    p.add_argument("--gen_batch", type=int, default=512, help="max episodes per rollout batch (each keeps one KV cache for its whole game)")
    p.add_argument("--engine", choices=["auto", "hf", "fast"], default="auto", help="rollout engine: hf (generate(), the "
                   "reference), fast (engine.py: a KV cache row per episode, CUDA graphs); auto: fast where it holds the model")
    p.add_argument("--steps", type=int, default=200, help="RL steps")
    p.add_argument("--loss", choices=["cispo", "grpo"], default="cispo", help="policy loss")
    p.add_argument("--loss_agg", choices=["token", "sequence"], default="token", help="token: DAPO/CISPO averaging over the batch; sequence: GRPO per-episode mean")
    p.add_argument("--eps_low", type=float, default=None, help="lower clip 1-eps_low (grpo default 0.2; cispo: none unless set)")
    p.add_argument("--eps_high", type=float, default=0.2, help="upper clip 1+eps_high (0.28 = DAPO clip-higher)")
    p.add_argument("--beta", type=float, default=0.0, help="KL penalty to the frozen initial model (0: no reference loaded)")
    p.add_argument("--scale_rewards", choices=["none", "group"], default="none", help="group: divide advantages by the group's reward std")
    p.add_argument("--ppo_epochs", type=int, default=1, help="passes over each batch")
    p.add_argument("--minibatch", type=int, default=0, help="episodes per optimizer step (0: the whole batch)")
    p.add_argument("--max_bad_steps", type=int, default=3, help="stop after this many non-finite updates in a row")
    p.add_argument("--exploit", type=int, default=0, help="every N steps the environment's exploit() hook (tictactoe: the "
                   "certificate, the greedy policy against every opponent line, as eval.py --certify) finds the lines where "
                   "the greedy policy errs, and up to half of each step's examples replay them: an exploiter; the weights "
                   "of the best certificate (fewest lost lines, then mistakes; the latest on a tie) are kept in DIR_best (0: off)")
    p.add_argument("--exploit_stop", action="store_true", help="with --exploit: stop once a certificate finds no mistake "
                   "to replay (the greedy policy is right on every line, so the exploiter has nothing left to teach; its "
                   "weights are then DIR_best's and the final checkpoint's)")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto", help="run the decoder layers through "
                   "torch.compile in the update (the rollouts stay eager, with their own CUDA graphs): fuses the "
                   "elementwise work; costs a compilation in the first step. auto: on a GPU for a model of 300M+ parameters")
    add_train_args(p, lr=1e-6, warmup=5, schedule="constant", token_budget=32768, out="out/rl", eval_every=20, eval_n=100, save_every=20)
    args = p.parse_args(argv)
    check_flags(args, {**TRAIN_FLAG_RULES, "top_p": POLICY_FLAG_RULES["top_p"], "max_new_tokens": POLICY_FLAG_RULES["max_new_tokens"],
                       "batch": (at_least(1), ">= 1"), "group": (at_least(2), ">= 2: the advantage compares rollouts of the same example"),
                       "temp": (positive, "a finite number > 0: the loss divides the logits by it"),
                       "gen_batch": (at_least(1), ">= 1"), "steps": (at_least(0), ">= 0"),
                       "eps_high": (non_negative, "a finite number >= 0"),
                       "eps_low": (lambda x: x is None or (non_negative(x) and x < 1), "in [0, 1)"),
                       "beta": (non_negative, "a finite number >= 0"),
                       "ppo_epochs": (at_least(1), ">= 1"), "minibatch": (at_least(0), ">= 0 (0: the whole batch)"),
                       "max_bad_steps": (at_least(1), ">= 1"), "exploit": (at_least(0), ">= 0 (0: off)")})
    if args.exploit_stop and not args.exploit:
        raise SystemExit("--exploit_stop stops on a certificate of --exploit N: give --exploit too")
    if args.batch % args.group:
        raise SystemExit(f"--batch {args.batch} must be a multiple of --group {args.group}")
    return args


def my_share(n_examples, group, rank, world):
    """(first, end): the step's examples this rank rolls out, whole groups, the same number on every rank."""
    if n_examples % world:
        raise SystemExit(f"--batch {n_examples * group} is {n_examples} examples x --group {group}: that cannot be split "
                         f"evenly over {world} ranks in whole groups; make --batch a multiple of {world} x {group} = {world * group}")
    per_rank = n_examples // world
    return rank * per_rank, (rank + 1) * per_rank


def main():
    args = parse_args()

    # ---- setup; under torchrun, rank 0 alone prints and writes files (the others' errors still reach stderr)
    t_start = time.time()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    rank, world, device = start_ranks(pick_device(args.device), args.dist_timeout)
    if rank:
        sys.stdout = open(os.devnull, "w")
    os.makedirs(args.out, exist_ok=True)
    metrics_path = os.path.join(args.out, "metrics.jsonl") if rank == 0 else None
    resume = checkpoint_to_resume(args, rank)

    # ---- environment: an environment that stratifies difficulty over consecutive examples (tic-tac-toe's
    # num_groups) gets one bucket per example of a step, so every batch is balanced
    env_args = parse_env_args(args.env_args)
    n_examples = args.batch // args.group
    first, end = my_share(n_examples, args.group, rank, world)  # under torchrun: this rank's examples of each step
    env = load_env(args.env, env_args, defaults={"num_groups": n_examples})
    if args.exploit and not hasattr(env, "exploit"):
        raise SystemExit(f"--exploit needs an environment with an exploit() hook (tictactoe), not {args.env!r}")

    # ---- model
    model, tokenizer = load_model(args.out if resume else args.model, device, train=True)
    ref_model = load_model(args.model, device)[0].eval().requires_grad_(False) if args.beta > 0 else None
    enable_grad_ckpt(model, args.grad_ckpt, device)
    compile_layers(model, args.compile, device)
    policy = HFPolicy(model, tokenizer, env.system_prompt, args.temp, args.top_p, args.max_new_tokens, args.gen_batch,
                      seed=args.seed, engine=args.engine)
    greedy = HFPolicy(model, tokenizer, env.system_prompt, 0.0, 1.0, args.max_new_tokens, args.gen_batch, engine=args.engine)
    amp = train_autocast(device)

    # ---- optimizer (fp32 weights and state, load_model(train=True); bf16 autocast for the forward on a GPU)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.99))
    trainer_state = start_or_resume(args, opt, resume, rank)
    step, bad_steps = trainer_state["step"], 0
    # --exploit's state: the lines to replay, the step whose certificate found them, the best certificate so far
    replays, replays_step, best = (trainer_state.get(k) for k in ("exploit_lines", "exploit_step", "exploit_best"))
    del trainer_state  # its optimizer state is in opt now: do not hold a second copy for the whole run

    def run_eval(step):
        model.eval()
        evals = evaluate_standard(args.env, env_args, greedy, args.eval_n, 10_000 + args.seed, args.out)
        log_eval(step, evals, metrics_path)
        for _, recs in evals.values():
            print(show(recs[0]))

    def save(step):  # every rank checks that it holds the weights rank 0 saves
        check_ranks_agree(model)
        if rank:
            return
        save_checkpoint(model, tokenizer, args.out, {"optimizer": opt.state_dict(), "step": step, "rng": rng_state(),
                                                   "exploit_lines": replays, "exploit_step": replays_step, "exploit_best": best},
                        {"rl_args.json": vars(args)})
        plot_curves([("", os.path.join(args.out, "metrics.jsonl"))], os.path.join(args.out, "curves.png"))

    best_dir = args.out.rstrip("/") + "_best"  # --exploit: the weights of the best certificate
    if resume and rank == 0:
        finish_save(best_dir)  # a save of the best weights that a crash interrupted

    def exploit(step):
        """--exploit: the environment certifies the greedy policy (env.exploit); log the certificate, keep the weights
        of the best one so far in DIR_best (a tie goes to the later, more trained weights), return the replays.
        Under torchrun rank 0 certifies, and every rank gets its replays."""
        nonlocal best
        found = None
        if rank == 0:
            t0 = time.time()
            summary, key, found = env.exploit(greedy)
            key = list(key)  # the trainer state keeps it as a list
            log_line(step, {**{f"certify_{k}": v for k, v in summary.items()}, "certify_s": time.time() - t0}, metrics_path)
            if best is None or key <= best["key"]:
                best = {"key": key, "step": step}
                save_checkpoint(model, tokenizer, best_dir, {"step": step}, {"certificate.json": {"step": step, **summary}})
            print(f"exploit: the certificate at step {step} ranks {key}, {len(found)} mistakes to replay; "
                  f"the best so far: step {best['step']}, in {best_dir}")
        found, best = from_rank0((found, best))
        return found

    # --exploit_stop: the certificate at this step found no mistake (a run that stopped there, or ended on it)
    perfect = lambda: args.exploit_stop and replays == [] and replays_step == step
    if resume and (step >= args.steps or perfect()):  # its final evaluation and save are done: again would repeat rows
        print(f"--resume: {args.out} holds the final checkpoint (step {step}, --steps {args.steps}"
              f"{', its certificate finds no mistake' if step < args.steps else ''}): nothing to do")
        stop_ranks()
        return

    # ---- loop
    while step < args.steps:
        model.eval()
        if args.exploit and (replays is None or (step % args.exploit == 0 and replays_step != step)):
            replays, replays_step = exploit(step), step
        if perfect():
            print(f"--exploit_stop: the certificate at step {step} finds no mistake: stopping")
            break
        t0 = time.time()
        # 1. rollouts: `group` episodes of each of the step's examples (under torchrun: of this rank's share of them)
        examples = step_examples(env, n_examples, args.seed, step, replays)[first:end]
        tokens0 = policy.gen_tokens
        records = sample_rollouts(env, examples, policy, args.group, step * n_examples + first)
        t_gen = time.time() - t0
        # 2. advantages: each episode's reward minus the mean of its example's group (a group is never split)
        adv = group_advantages([r["reward"] for r in records], args.group, args.scale_rewards)  # (episodes of this rank,)
        # 3-4. the loss on the sampled tokens, and the optimizer step(s)
        lr = lr_at(step, args.lr, args.warmup, args.steps, args.schedule)
        for g in opt.param_groups:
            g["lr"] = lr
        model.train()
        t1 = time.time()
        try:
            stats = update(model, records, adv, args, opt, amp, ref_model, first * args.group, args.batch)
        except torch.OutOfMemoryError as e:
            raise SystemExit(f"out of GPU memory in the update: lower --token_budget (tokens per micro-batch, now "
                             f"{args.token_budget}) or add --grad_ckpt.\n  ({str(e)[:200]})") from e
        except torch._dynamo.exc.TorchDynamoException as e:  # no compiler for this GPU, a layer it cannot trace, ...
            raise SystemExit(f"torch.compile failed on the update's layers: run with --compile off.\n  "
                             f"({type(e).__name__}: {str(e).strip().splitlines()[0][:300]})") from e
        t_train = time.time() - t1
        step += 1
        bad_steps = bad_steps + 1 if stats["skipped"] else 0
        # the step's metrics over the whole batch: every rank's episodes, in the order one process would have them
        shares = gather_from_ranks(([{k: r[k] for k in ("reward", "rewards", "metrics", "mask", "truncated")} for r in records],
                                    (adv == 0).tolist(), policy.gen_tokens - tokens0))
        m = batch_metrics([r for share in shares for r in share[0]], env)
        m.update(entropy=stats["entropy"], clip_frac=stats["clip_frac"], grad_norm=stats["grad_norm"], lr=lr,
                 logp_mismatch=stats["logp_mismatch"], zero_adv=sum(z for share in shares for z in share[1]) / args.batch,
                 gen_tokens_per_s=sum(share[2] for share in shares) / t_gen, train_tokens_per_s=stats["train_tokens"] / max(t_train, 1e-9),
                 step_time=time.time() - t0, skipped_updates=stats["skipped"])
        if ref_model is not None:
            m["kl"] = stats["kl"]
        if device.startswith("cuda"):
            m["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        log_line(step, m, metrics_path)
        if bad_steps >= args.max_bad_steps:
            raise SystemExit(f"{bad_steps} non-finite updates in a row: stopping. The last good checkpoint is in {args.out}; "
                             "lower --lr, raise --grad_clip headroom, or check the model's dtype.")
        if rank == 0 and args.eval_every and step % args.eval_every == 0 and step < args.steps:
            run_eval(step)  # the other ranks wait for rank 0 at the next step's first collective
        if args.save_every and step % args.save_every == 0 and step < args.steps:
            save(step)

    # ---- final evaluation and save
    if args.exploit and replays_step != step:  # (a stop by --exploit_stop has just certified this step)
        model.eval()
        found = exploit(step)
        if step % args.exploit == 0:  # the next step's replays too: a --resume with more --steps goes on with them
            replays, replays_step = found, step
    if rank == 0:
        run_eval(step)
    save(step)
    print(f"done: {step} steps in {time.time() - t_start:.0f}s, model in {args.out}")
    stop_ranks()


if __name__ == "__main__":
    with disk_full_says_what_is_kept("The last complete checkpoint in --out is kept: free space, then rerun with --resume."):
        main()
