"""
RL with verifiable rewards: a readable GRPO/CISPO loop for one GPU.

    python rl.py --batch 256 --temp 1.1     # GPU: RL from out/sft (a 0.35B-2B model fits one GPU)
    python rl.py --env reverse --batch 64 --group 8 --max_new_tokens 32 --model out/sft_reverse
    torchrun --standalone --nproc_per_node 8 rl.py --batch 256 --temp 1.1   # 8 GPUs, same batch
    torchrun --standalone --nproc_per_node 8 rl.py --fsdp --model DIR_OF_AN_8B_SFT_MODEL ...
    # CPU smoke run that trains (README, "Your first environment": env_add.py)
    python sft.py --model scratch --env add --max_steps 400 --eval_every 0 --out /tmp/add_sft
    python rl.py --model /tmp/add_sft --env add --batch 64 --group 8 --steps 5 --lr 5e-5 \\
        --max_new_tokens 12 --eval_every 0 --eval_n 50 --out /tmp/add_rl

One step, in the order of this file:
  1. rollouts: batch/group examples, each rolled out `group` times at --temp, every draw keyed by
     (--seed, episode, rollout, turn), so rollouts depend on neither --gen_batch nor the ranks;
     --dynamic_sampling (DAPO) replaces groups of equal rewards by informative ones;
  2. group advantages: A = R - mean(R of its group) (--scale_rewards group: / its std, as GRPO);
  3. the loss on the sampled tokens only (the trajectory's `mask`), recomputed from the exact
     token ids at the sampling temperature: cispo, grpo or gspo (policy_loss), averaged per token,
     per episode or by a constant (loss_weights);
  4. the update: one optimizer step per batch (--minibatch / --ppo_epochs for several);
  5. the loop: log, evaluate, checkpoint; --exploit runs the environment's exploiter.
Simplifications, on purpose:
  1. on-policy by default (one optimizer step per batch: r = 1, REINFORCE with a group baseline);
  2. one advantage for every token of an episode: no per-turn credit, no value function;
  3. no KL penalty unless --beta > 0, no entropy bonus;
  4. rollouts on the training weights (sample.py: no vLLM, no async);
  5. a reply the environment forces (its forced_reply hook) is trained like a sampled one;
  6. episodes of advantage 0 skip the backward pass but count in the normaliser;
  7. under torchrun each rank rolls out its share (--fsdp: on the weights gathered from the
     ranks' shards) and the gradients are summed: N ranks take one process's update (with
     --dynamic_sampling each rank fills its own share).
Writes DIR (out/rl): metrics.jsonl, curves.png, evaluations, checkpoints (+ trainer_state.pt).
"""
import argparse
import os
import time
from collections import Counter

import torch

from common import (TRAIN_FLAG_RULES, RunLog, add_train_args, at_least, check_flags,
                    checkpoint_to_resume, end_of_step, finish_save, load_env, load_model, lr_at,
                    non_negative, optimizer_step, out_of_memory_says, pad_batch, parse_env_args,
                    positive, run_training, save_run, start_or_resume, start_run,
                    token_microbatches, train_autocast)
from engine import compile_layers, compiled_layers, scorer_to_train
from eval import evaluate_standard, plot_curves
from ranks import (empty_passes, from_rank0, gather_from_ranks, gathered, my_share, passes_behind,
                   stop_ranks, sum_over_ranks)
from sample import HFPolicy, rollout, rollout_metrics, show

EXTRA_DRAW = 1 << 40  # --dynamic_sampling: the k-th extra draw's episodes are numbered from k * this

# ----------------------------------------------------------------------------- 1. rollouts
def sample_rollouts(env, examples, policy, group, first_index):
    """`group` rollouts of every example, numbered from first_index (an episode's draws' key)."""
    with out_of_memory_says(f"in the rollouts: lower --gen_batch (now {policy.batch_size}) "
                            "or --max_new_tokens"):
        return rollout(env, examples, policy, group=group, start_index=first_index, progress=False)


def dynamic_sampling(env, records, draw, policy, group, tries):
    """DAPO's dynamic sampling: a group of equal rewards has no signal, so up to `tries` more draws
    (draw(k) -> (examples, first index)) replace such groups by informative ones of new examples,
    uniform groups filling what they could not. Returns (records, draws taken)."""
    split = lambda recs: [recs[i:i + group] for i in range(0, len(recs), group)]
    informative = lambda g: len({r["reward"] for r in g}) > 1
    groups, k = split(records), 0
    kept = [g for g in groups if informative(g)]
    while len(kept) < len(groups) and k < tries:
        k += 1
        examples, first_index = draw(k)
        more = sample_rollouts(env, examples, policy, group, first_index)
        kept += [g for g in split(more) if informative(g)]
    if k == 0:  # every group informative, or the option off: the records as they were
        return records, 1
    kept = (kept + [g for g in groups if not informative(g)])[:len(groups)]
    return [r for g in kept for r in g], k + 1


# ----------------------------------------------------------------------------- 2. group advantages
def group_advantages(rewards, group, scale_rewards="none"):
    """Advantages (B,) of E * group episodes, a group side by side: A = R - mean(R of the group)
    (--scale_rewards group: / (its std + 1e-4), as TRL's); equal rewards give exactly 0."""
    rewards = torch.as_tensor(rewards, dtype=torch.float64).view(-1, group)  # (E, G)
    rewards = rewards - rewards[:, :1]  # relative to the group's first: equal rewards give 0
    adv = rewards - rewards.mean(1, keepdim=True)
    if scale_rewards == "group":
        adv = adv / (rewards.std(1, keepdim=True) + 1e-4)
    return adv.float().flatten()  # (B,)


# ----------------------------------------------------------------------------- 3. the loss
def kl_k3(logp, ref_logp):
    d = ref_logp - logp  # per-token KL(policy || reference) from sampled tokens' logprobs: k3
    return torch.exp(d) - d - 1


def policy_loss(logp, old_logp, adv, weight, loss="cispo", eps_low=None, eps_high=0.2,
                ref_logp=None, beta=0.0, sizes=None, is_weight=None):
    """Sum over tokens of weight * per-token loss; every tensor is (N,) over the loss tokens, the
    episodes' tokens one after another, `sizes` their counts (gspo needs them).

    r = exp(logp - old_logp), A = the token's episode advantage, sg = stop-gradient
      cispo: l = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp  (eps_low None: no lower clip)
      grpo:  l = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)  (eps_low None: 0.2)
      gspo:  grpo's l with r = the episode's ratio exp(mean over its tokens of logp - old_logp)
             (GSPO, arXiv 2507.18071, whose eps are 3e-4 and 4e-4)
      is_weight: l *= min(pi_trainer / pi_sampler, C) (--tis_cap C), before the KL term
      KL (beta > 0): l += beta * (exp(ref - logp) - (ref - logp) - 1)  (the k3 estimator, >= 0)
    Returns (loss, clipped) where clipped marks tokens whose ratio hit a bound."""
    log_ratio = logp - old_logp
    if loss == "gspo":  # one ratio per episode, at each of its tokens
        log_ratio = torch.cat([d.mean().expand(len(d)) for d in log_ratio.split(sizes)])
    ratio, hi = torch.exp(log_ratio), 1.0 + eps_high
    if loss == "cispo":
        lo = -1.0 if eps_low is None else 1.0 - eps_low  # -1: no lower clip, ratios are > 0
        per_token = -ratio.clamp(min=lo, max=hi).detach() * adv * logp
        clipped = (ratio > hi) | (ratio < lo)
    else:  # grpo, gspo: PPO's clipped objective
        lo = 1.0 - (0.2 if eps_low is None else eps_low)
        per_token = -torch.min(ratio * adv, ratio.clamp(lo, hi) * adv)
        clipped = ((ratio > hi) & (adv > 0)) | ((ratio < lo) & (adv < 0))
    if is_weight is not None:
        per_token = per_token * is_weight
    if beta > 0:
        per_token = per_token + beta * kl_k3(logp, ref_logp)
    return (per_token * weight).sum(), clipped


def loss_weights(n_tokens, loss_agg, batch_tokens, batch_episodes, max_episode_tokens=None):
    """Each episode's token weight over the whole step's batch (all ranks', all minibatches'),
    skipped episodes of advantage 0 counted too:
      token:    1 / (loss tokens in the batch)                 (DAPO, CISPO)
      sequence: 1 / (the episode's loss tokens * episodes)      (GRPO)
      constant: 1 / (episodes * max_turns * max_new_tokens)     (Dr. GRPO: the most loss tokens
                the batch can have; single-turn, TRL's dr_grpo exactly)"""
    if loss_agg == "sequence":
        return [1.0 / (max(t, 1) * batch_episodes) for t in n_tokens]
    total = batch_tokens if loss_agg == "token" else batch_episodes * max_episode_tokens
    return [1.0 / max(total, 1)] * len(n_tokens)


# ----------------------------------------------------------------------------- 4. the update
def update(scorer, records, adv, args, opt, amp, ref=None, first=0, batch=None,
           max_episode_tokens=None):
    """The optimizer step(s) of a batch of rollouts with advantages adv (B,): --minibatch episodes
    a step, each taken --ppo_epochs times, the ratio against the logprobs before the first;
    micro-batches of at most --token_budget padded tokens. Under torchrun `records` are episodes
    first.. of the step's `batch`. --mask_truncated: an episode cut off (a reply at
    --max_new_tokens, or its metric cut_off) has no loss token, as TRL's. scorer, ref: the policy's
    and the reference's common.Scorer."""
    model, batch = scorer.model, batch or len(records)
    cut = lambda r: args.mask_truncated and (r["truncated"] or r["metrics"].get("cut_off"))
    n_tokens = [0 if cut(r) else sum(r["mask"][1:]) for r in records]  # t + 1 is predicted at t
    weights = loss_weights(n_tokens, args.loss_agg, sum_over_ranks([sum(n_tokens)])[0], batch,
                           max_episode_tokens)
    trained = [i for i in range(len(records)) if n_tokens[i] and (adv[i] != 0 or args.beta > 0)]
    per_step = args.minibatch or batch  # episodes per optimizer step
    minibatches = [[i for i in trained if lo <= first + i < lo + per_step]
                   for lo in range(0, batch, per_step)]
    several_steps = args.ppo_epochs > 1 or len(minibatches) > 1

    def micro_batches(episodes):  # lists of episodes, of at most --token_budget padded tokens
        return [[episodes[j] for j in micro] for micro in token_microbatches(
            [len(records[i]["ids"]) for i in episodes], args.token_budget)]

    def tensors(micro):
        """ids, mask (B, T); each loss token's advantage, weight, sampler's logprob (N,)."""
        ids, mask = pad_batch(([records[i]["ids"] for i in micro],
                               [records[i]["mask"] for i in micro]), 0, model.device)  # (B, T)
        per_token = lambda vals: torch.cat([torch.full((n_tokens[i],), float(vals[i]))
                                            for i in micro]).to(model.device)  # (N,)
        sampled = torch.tensor([lp for i in micro for lp, m in zip(records[i]["logprobs"][1:],
                                                                   records[i]["mask"][1:]) if m])
        return ids, mask, per_token(adv.tolist()), per_token(weights), sampled

    with compiled_layers(model):  # on a GPU a big model's layers run compiled
        before = {}  # episode -> (logprobs before any update, the reference's), from a no-grad pass
        if several_steps or args.beta > 0:  # (--fsdp: on the gathered weights, rank by rank)
            with torch.no_grad(), amp, gathered(scorer), gathered(ref):
                for micro in micro_batches(trained):
                    ids, mask, *_ = tensors(micro)
                    sizes = [n_tokens[i] for i in micro]
                    old = scorer(ids, mask, args.temp)[0].split(sizes)
                    refs = ref(ids, mask, args.temp)[0].split(sizes) if ref else [None] * len(micro)
                    before.update({i: (o, r) for i, o, r in zip(micro, old, refs)})

        sums, grad_norm, skipped = Counter(), 0.0, 0
        for epoch in range(args.ppo_epochs):
            for minibatch in minibatches:
                if not sum_over_ranks([len(minibatch)])[0]:  # no rank has a gradient: no step
                    continue
                micros = micro_batches(minibatch)
                total_loss, behind = 0.0, passes_behind(scorer, len(micros))  # --fsdp: see ranks
                for micro in micros:
                    ids, mask, adv_tok, weight_tok, sampled = tensors(micro)
                    with amp:
                        logp, entropy = scorer(ids, mask, args.temp)  # (N,)
                    old_logp = torch.cat([before[i][0] for i in micro]) if several_steps \
                        else logp.detach()
                    ref_logp = torch.cat([before[i][1] for i in micro]) if ref else None
                    gap = old_logp.float().cpu() - sampled  # trainer vs sampler logprobs
                    is_weight = gap.exp().clamp(max=args.tis_cap).to(logp.device) \
                        if args.tis_cap else None
                    loss, clipped = policy_loss(logp, old_logp, adv_tok, weight_tok, args.loss,
                                                args.eps_low, args.eps_high, ref_logp, args.beta,
                                                [n_tokens[i] for i in micro], is_weight)
                    loss.backward()
                    total_loss += loss.item()
                    kl = kl_k3(logp.detach(), ref_logp).sum().item() if ref else 0.0
                    sums.update({"entropy": entropy.sum().item(), "clip_frac": clipped.sum().item(),
                                 "tokens": len(logp), "train_tokens": mask.numel(), "kl": kl,
                                 "logp_mismatch": gap.abs().sum().item() if epoch == 0 else 0.0})
                empty_passes(scorer, behind, amp)
                _, norm, stepped = optimizer_step(model, opt, total_loss)
                grad_norm, skipped = (norm, skipped) if stepped else (grad_norm, skipped + 1)
    keys = ("entropy", "clip_frac", "kl", "logp_mismatch", "tokens", "train_tokens")
    entropy, clip_frac, kl, mismatch, tokens, train_tokens = sum_over_ranks([sums[k] for k in keys])
    tokens = max(tokens, 1)
    return {"entropy": entropy / tokens, "clip_frac": clip_frac / tokens, "kl": kl / tokens,
            "grad_norm": grad_norm, "logp_mismatch": mismatch / max(tokens // args.ppo_epochs, 1),
            "train_tokens": train_tokens, "skipped": skipped}


# ----------------------------------------------------------------------------- 5. the loop
def rl_step(args, step, env, draw, policy, scorer, ref, opt, amp, first, device):
    """Steps 1-4 on this rank's share of the batch; returns the step's metrics, every rank's."""
    t0, tokens0 = time.time(), policy.gen_tokens
    # 1. rollouts: `group` episodes of each of the step's examples, a function of (seed, step)
    with gathered(scorer):  # --fsdp: each rank rolls out on the whole model
        examples, first_index = draw(0)
        records = sample_rollouts(env, examples, policy, args.group, first_index)
        records, draws = dynamic_sampling(env, records, draw, policy, args.group,
                                          args.dynamic_sampling)
    t_gen = time.time() - t0
    # 2. advantages: each episode's reward minus the mean of its example's group
    adv = group_advantages([r["reward"] for r in records], args.group, args.scale_rewards)
    # 3-4. the loss on the sampled tokens, and the optimizer step(s)
    opt.param_groups[0]["lr"] = lr = lr_at(step, args.lr, args.warmup, args.steps, "constant")
    scorer.model.train()
    with out_of_memory_says(f"in the update: lower --token_budget (now {args.token_budget}) "
                            "or add --grad_ckpt"):
        stats = update(scorer, records, adv, args, opt, amp, ref, first * args.group,
                       args.batch, env.max_turns * args.max_new_tokens)
    t_train = time.time() - t0 - t_gen
    keep = ("reward", "rewards", "metrics", "mask", "truncated")
    shares = gather_from_ranks(([{k: r[k] for k in keep} for r in records],
                                (adv == 0).tolist(), policy.gen_tokens - tokens0, draws))
    m = rollout_metrics([r for s in shares for r in s[0]])
    m.update({k: stats[k] for k in ("entropy", "clip_frac", "grad_norm", "logp_mismatch")},
             lr=lr, zero_adv=sum(z for s in shares for z in s[1]) / args.batch,
             gen_tokens_per_s=sum(s[2] for s in shares) / t_gen,
             train_tokens_per_s=stats["train_tokens"] / max(t_train, 1e-9),
             step_time=time.time() - t0, skipped_updates=stats["skipped"])
    m.update({"draws": max(s[3] for s in shares)} if args.dynamic_sampling else {},
             **({"kl": stats["kl"]} if ref else {}))
    if device.startswith("cuda"):
        m["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return m


class Exploiter:
    """--exploit N: every N steps (and at the first and last) the environment's exploit(policy)
    judges the greedy policy: (numbers logged as exploit_*, a score tuple, lower is better, examples
    where it errs, which up to half of each later step replays). The best score's weights (the later
    on a tie) go to DIR_best; exploit_stop ends the run at a verdict with nothing to replay."""
    KEYS = ("exploit_lines", "exploit_step", "exploit_best")  # its state, saved with the trainer's

    def __init__(self, env, every, out, rank, log, resume):
        self.env, self.every, self.best_dir = env, every, out.rstrip("/") + "_best"
        self.rank, self.log, self.stop = rank, log, getattr(env, "exploit_stop", False)
        self.replays = self.step = self.best = None
        if every and not hasattr(env, "exploit"):
            raise SystemExit("--exploit needs an environment with an exploit(policy) hook")
        if self.stop and not every:
            raise SystemExit("the environment's exploit_stop ends a run at a verdict of --exploit: "
                             "give --exploit N too")
        if resume and rank == 0:
            finish_save(self.best_dir)  # a save of the best weights that a crash interrupted

    def __call__(self, step, policy, scorer, tokenizer, last=False):
        """The verdict at `step` where it is due; True when exploit_stop ends the run here. Every
        rank calls it (rank 0 judges, all save)."""
        if self.every and self.step != step and (last or self.replays is None
                                                 or step % self.every == 0):
            found = better = summary = None
            scorer.model.eval()
            with gathered(scorer):
                if self.rank == 0:
                    t0, (summary, score, found) = time.time(), self.env.exploit(policy)
                    self.log(step, {**{f"exploit_{k}": v for k, v in summary.items()},
                                    "exploit_s": time.time() - t0})
                    better = self.best is None or list(score) <= self.best["score"]
                    self.best = {"score": list(score), "step": step} if better else self.best
                    print(f"exploit: step {step} scores {list(score)}, {len(found)} to replay; "
                          f"the best: step {self.best['step']}, {self.best_dir}")
            found, self.best, better = from_rank0((found, self.best, better))
            if better:
                save_run(scorer.model, tokenizer, self.best_dir, self.rank, {"step": step},
                         {"exploit.json": {"step": step, **(summary or {})}})
            if not last or step % self.every == 0:  # last: the replays of a resume with more steps
                self.replays, self.step = found, step
        if self.stop and self.replays == [] and self.step == step:
            print(f"exploit_stop: the verdict at step {step} finds nothing to replay: stopping")
            return True

    def replay(self, examples, step):
        """Up to half of a step's examples replaced, in turn, by the replays, with their seeds."""
        k = min(len(self.replays or []), len(examples) // 2)
        for j in range(k):
            examples[j] = {"seed": examples[j]["seed"],
                           **self.replays[(step * k + j) % len(self.replays)]}
        return examples


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--model", default="out/sft", help="hub id or save_pretrained directory (default: SFT's)")
    add("--env", default="tictactoe", help="environment NAME (env_NAME.py)")
    add("--env_args", default="{}", help="JSON keyword arguments for load_environment() "
        "(num_groups, where it takes one, defaults to batch/group)")
    add("--batch", type=int, default=256, help="episodes per step (batch/group examples x group)")
    add("--group", type=int, default=8, help="rollouts per example")
    add("--temp", type=float, default=1.0, help="sampling temperature (the loss uses the same)")
    add("--max_new_tokens", type=int, default=128, help="max generated tokens per turn")
    add("--gen_batch", type=int, default=512, help="max episodes played at once (each keeps its KV "
        "cache for its whole game: this bounds the rollouts' memory)")
    add("--engine", choices=["auto", "hf", "fast"], default="auto",
        help="rollouts: hf (generate(), the reference), fast (engine.py), auto")
    add("--dynamic_sampling", type=int, default=0, metavar="K", help="DAPO: up to K more draws a "
        "step replace groups of equal rewards by informative ones (0: off)")
    add("--steps", type=int, default=200, help="RL steps")
    add("--loss", choices=["cispo", "grpo", "gspo"], default="cispo", help="policy loss")
    add("--loss_agg", choices=["token", "sequence", "constant"], default="token", help="token: "
        "mean over the batch's tokens (DAPO, CISPO); sequence: per-episode mean (GRPO); constant: "
        "sum / (batch x max_turns x max_new_tokens) (Dr. GRPO)")
    add("--eps_low", type=float, default=None, help="lower clip 1-eps_low (unset: none for cispo, "
        "0.2 for grpo and gspo)")
    add("--eps_high", type=float, default=0.2, help="upper clip 1+eps_high (0.28: DAPO's)")
    add("--beta", type=float, default=0.0, help="KL penalty to the frozen initial model (0: none)")
    add("--scale_rewards", choices=["none", "group"], default="none",
        help="group: divide advantages by the group's reward std (GRPO; Dr. GRPO: none)")
    add("--mask_truncated", action="store_true", help="no gradient for episodes cut off at "
        "--max_new_tokens or at the environment's turn limit")
    add("--tis_cap", type=float, default=0.0, help="weight each token by min(pi_trainer / "
        "pi_sampler, C), for a sampler of another precision (truncated importance sampling; 0: off)")
    add("--ppo_epochs", type=int, default=1, help="passes over each batch")
    add("--minibatch", type=int, default=0, help="episodes per optimizer step (0: the whole batch)")
    add("--exploit", type=int, default=0, help="every N steps the environment's exploit() hook "
        "finds where the greedy policy errs, for half of each step to replay; best weights in "
        "DIR_best (0: off)")
    add_train_args(p, lr=1e-6, warmup=5, token_budget=32768, out="out/rl", eval_every=20,
                   eval_n=100, save_every=20)
    args = p.parse_args(argv)
    finite = (non_negative, "a finite number >= 0")
    check_flags(args, {**TRAIN_FLAG_RULES, "max_new_tokens": (at_least(1), ">= 1"),
                       "batch": (lambda b: b >= 1 and b % max(args.group, 1) == 0,
                                 f"a positive multiple of --group {args.group}"),
                       "group": (at_least(2), ">= 2: the advantage compares rollouts of an example"),
                       "eps_low": (lambda x: x is None or 0 <= x < 1, "in [0, 1), or unset"),
                       "temp": (positive, "a finite number > 0: the loss divides the logits by it"),
                       "eps_high": finite, "beta": finite, "tis_cap": finite,
                       "steps": (at_least(0), ">= 0"), "gen_batch": (at_least(1), ">= 1"),
                       "ppo_epochs": (at_least(1), ">= 1"),
                       "dynamic_sampling": (at_least(0), ">= 0 (0: off)"),
                       "minibatch": (at_least(0), ">= 0 (0: the whole batch)"),
                       "exploit": (at_least(0), ">= 0 (0: off)")})
    return args


def main():
    run_training(parse_args, train)  # SIGTERM, Ctrl-C: the step in flight ends, is saved, then exit


def train(args, preempt):
    t_start = time.time()
    rank, world, device = start_run(args)  # under torchrun, rank 0 alone prints and writes files
    os.makedirs(args.out, exist_ok=True)
    resume = checkpoint_to_resume(args, rank)
    log = RunLog(args, rank)
    # the environment (one difficulty bucket per example of a step, where it has num_groups)
    env_args, n_examples = parse_env_args(args.env_args), args.batch // args.group
    first, end = my_share(n_examples, args.group, rank, world)  # this rank's examples of each step
    env = load_env(args.env, env_args, defaults={"num_groups": n_examples})
    exploiter = Exploiter(env, args.exploit, args.out, rank, log, resume)
    # the model, the frozen reference (--beta), the sampling and greedy policies, the optimizer
    home = "cpu" if args.fsdp else device  # --fsdp: loaded on the CPU, then sharded to `device`
    model, tokenizer = load_model(args.out if resume else args.model, home, train=True)
    scorer = scorer_to_train(model, args, device)
    ref = scorer_to_train(load_model(args.model, home)[0].eval().requires_grad_(False), args,
                          device) if args.beta > 0 else None
    compile_layers(model, "off" if args.fsdp else "auto", device)
    play = dict(model=model, tokenizer=tokenizer, system_prompt=env.system_prompt,
                max_new_tokens=args.max_new_tokens, batch_size=args.gen_batch, engine=args.engine,
                tools=getattr(env, "tools", None))
    policy, greedy = HFPolicy(temp=args.temp, seed=args.seed, **play), HFPolicy(temp=0.0, **play)
    amp = train_autocast(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.99))
    trainer_state = start_or_resume(args, opt, resume, rank)
    step, bad_steps, eval_envs, signals = trainer_state["step"], 0, {}, []
    exploiter.replays, exploiter.step, exploiter.best = map(trainer_state.get, Exploiter.KEYS)

    def save():
        state = dict(zip(Exploiter.KEYS, (exploiter.replays, exploiter.step, exploiter.best)))
        save_run(model, tokenizer, args.out, rank, {"step": step, **state},
                 {"rl_args.json": vars(args)}, opt)
        if rank == 0:
            plot_curves([("", os.path.join(args.out, "metrics.jsonl"))],
                        os.path.join(args.out, "curves.png"), getattr(env, "curve_panels", None))

    def run_eval():  # every rank calls it, rank 0 evaluates; each setting's environment built once
        model.eval()
        with gathered(scorer):
            if rank == 0:
                evals = evaluate_standard(args.env, env_args, greedy, args.eval_n,
                                          10_000 + args.seed, args.out, eval_envs)
                log.evals(step, evals)
                print("\n".join(show(recs[0]) for _, recs in evals.values()))

    def draw(k):  # the step's examples (k = 0) or its k-th extra draw's, and their first number
        examples = env.examples(n_examples, seed=args.seed * 1_000_003 + step + k * EXTRA_DRAW)
        examples = exploiter.replay(examples, step) if k == 0 else examples
        return examples[first:end], k * EXTRA_DRAW + step * n_examples + first

    if resume and (step >= args.steps or exploiter.stop and exploiter.replays == []
                   and exploiter.step == step):  # all done
        print(f"--resume: {args.out} holds the final checkpoint (step {step}, --steps "
              f"{args.steps}): nothing to do")
        return stop_ranks()
    while step < args.steps:
        model.eval()
        if exploiter(step, greedy, scorer, tokenizer):
            break
        m = rl_step(args, step, env, draw, policy, scorer, ref, opt, amp, first, device)
        step, bad_steps = step + 1, bad_steps + 1 if m["skipped_updates"] else 0
        log(step, m)
        signal = m["zero_adv"] < 1 or args.beta > 0  # a gradient: unequal rewards, or the KL
        if rank == 0 and not signal and all(signals):  # the first such step
            print(f"note: step {step} has no gradient: every group's episodes had equal rewards")
        signals.append(signal)
        end_of_step(step, args.steps, args, preempt, rank, run_eval, save, bad_steps)

    exploiter(step, greedy, scorer, tokenizer, last=True)  # the last step's verdict, if not made
    run_eval()
    save()
    print(f"done: {step} steps in {time.time() - t_start:.0f}s, model in {args.out}")
    if rank == 0 and signals and not any(signals):
        print(f"warning: in all {len(signals)} steps every group's episodes had equal rewards "
              "(zero_adv 1): every advantage was 0, so nothing was trained and the weights are "
              "the model's as loaded. Raise --temp or --group, or use an environment whose rewards "
              "tell this model's episodes apart.")
    log.close()
    stop_ranks()


if __name__ == "__main__":
    main()
