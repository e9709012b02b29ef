"""
RL with verifiable rewards: a readable GRPO/CISPO loop for one GPU.

    python rl.py --batch 256 --temp 1.1                   # GPU: RL from out/sft (a 0.35B-2B model fits one GPU)
    python rl.py --env reverse --batch 64 --group 8 --max_new_tokens 32 --model out/sft_reverse
    python rl.py --model out/sft --batch 16 --group 4 --steps 2 --eval_every 0 --out /tmp/rl   # CPU smoke run (it
                                  # says so where its groups' rewards were all equal: then nothing was trained)
    torchrun --standalone --nproc_per_node 8 rl.py --batch 256 --temp 1.1   # 8 GPUs, the same global batch

One step, in the order of this file:
  1. rollouts: batch/group examples (consecutive ones balance difficulty), each rolled out `group` times at --temp
     with the same seed, so rewards differ only by the policy; each draw is keyed by (--seed, episode, rollout,
     turn), so the rollouts do not depend on --gen_batch or on the number of ranks;
  2. group advantages: A = R - mean(R of its group)  (--scale_rewards group: / std of the group, as in GRPO);
  3. the loss on the sampled tokens only (the trajectory's `mask`), recomputed from the rollouts' exact token ids
     with the logits divided by the temperature: cispo = -sg(clip(r, 1-eps_low, 1+eps_high)) * A * log pi, or
     grpo = PPO's clipped objective;
  4. the update: one optimizer step per batch (--minibatch / --ppo_epochs for several, where the ratio matters);
  5. the loop: log, evaluate, checkpoint, and with --exploit the environment's exploiter (Exploiter).
Simplifications, on purpose: on-policy by default (one optimizer step per batch: r = 1, and both losses are
REINFORCE with a group-mean baseline); one advantage for every token of an episode (no per-turn credit, no value
function, no discount); no KL penalty unless --beta > 0, no entropy bonus; rollouts on the training weights
(sample.py: no vLLM, no async); a reply the environment forces (its forced_reply hook) is trained like a sampled
one; episodes of advantage 0 skip the backward pass but count in the normaliser. Under torchrun each rank rolls
out its share of the examples and the gradients are summed, so N ranks take the update one process takes.
Writes DIR (out/rl): metrics.jsonl, curves.png, evaluations, checkpoints (save_pretrained + trainer_state.pt).
"""
import argparse
import math
import os
import time
from collections import Counter

import torch

from common import (GRAD_CLIP, TRAIN_FLAG_RULES, RunLog, add_train_args, at_least, check_flags, checkpoint_to_resume,
                    disk_full_says_what_is_kept, finish_save, load_env, load_model, lr_at,
                    non_negative, out_of_memory_says, pad_batch, parse_env_args, positive, save_checkpoint, save_run,
                    start_or_resume, start_run, token_logprobs, token_microbatches, train_autocast)
from engine import compile_layers, compiled_layers, enable_grad_ckpt
from eval import evaluate_standard, plot_curves
from ranks import from_rank0, gather_from_ranks, my_share, stop_ranks, sum_gradients, sum_over_ranks
from sample import HFPolicy, rollout, rollout_metrics, show

MAX_BAD_STEPS = 3  # non-finite updates in a row before a run stops

# ----------------------------------------------------------------------------- 1. rollouts


def sample_rollouts(env, examples, policy, group, first_index):
    """`group` rollouts of every example, example by example, numbered from first_index (a number no other example
    of the run has: an episode's draws are keyed by it). The KV caches grow with every turn of the rollouts."""
    with out_of_memory_says(f"in the rollouts: lower --gen_batch (now {policy.batch_size}) or --max_new_tokens"):
        return rollout(env, examples, policy, group=group, start_index=first_index, progress=False)


# ----------------------------------------------------------------------------- 2. group advantages


def group_advantages(rewards, group, scale_rewards="none"):
    """Advantages (B,) of a step's E * group episodes, an example's rollouts side by side: A = R - mean(R of the
    group), and with --scale_rewards group / (its std, Bessel-corrected as torch.std and TRL, + 1e-4). Equal rewards
    give exactly 0 (the update skips them): rewards are first taken relative to the group's first, in float64."""
    rewards = torch.as_tensor(rewards, dtype=torch.float64).view(-1, group)  # (E, G)
    rewards = rewards - rewards[:, :1]
    adv = rewards - rewards.mean(1, keepdim=True)
    if scale_rewards == "group":
        adv = adv / (rewards.std(1, keepdim=True) + 1e-4)
    return adv.float().flatten()  # (B,)


# ----------------------------------------------------------------------------- 3. the loss


def kl_k3(logp, ref_logp):
    d = ref_logp - logp  # per-token KL(policy || reference) from sampled tokens' logprobs: Schulman's k3
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
    ratio, hi = torch.exp(logp - old_logp), 1.0 + eps_high
    if loss == "cispo":
        lo = None if eps_low is None else 1.0 - eps_low
        per_token = -ratio.clamp(min=lo, max=hi).detach() * adv * logp
        clipped = (ratio > hi) | ((ratio < lo) if lo is not None else torch.zeros_like(ratio, dtype=torch.bool))
    else:  # grpo
        lo = 1.0 - (0.2 if eps_low is None else eps_low)
        per_token = -torch.min(ratio * adv, ratio.clamp(lo, hi) * adv)
        clipped = ((ratio > hi) & (adv > 0)) | ((ratio < lo) & (adv < 0))
    if beta > 0:
        per_token = per_token + beta * kl_k3(logp, ref_logp)
    return (per_token * weight).sum(), clipped


def loss_weights(n_tokens, loss_agg, batch_tokens, batch_episodes):
    """Each episode's token weight (see policy_loss), over the whole step's batch (all ranks', all minibatches'),
    every episode counted, one of advantage 0 that the update skips included."""
    if loss_agg == "token":
        return [1.0 / max(batch_tokens, 1)] * len(n_tokens)
    return [1.0 / (max(t, 1) * batch_episodes) for t in n_tokens]


# ----------------------------------------------------------------------------- 4. the update


def update(model, records, adv, args, opt, amp, ref_model=None, first=0, batch=None):
    """The optimizer step(s) of a batch of rollouts (ids, mask, logprobs) with advantages adv (B,): --minibatch
    episodes a step (default all), each taken --ppo_epochs times, the ratio against the logprobs before the first;
    micro-batches of at most --token_budget padded tokens. Under torchrun `records` are episodes first.. of the
    step's `batch`, and each step sums the ranks' gradients."""
    batch = batch or len(records)
    n_tokens = [sum(r["mask"][1:]) for r in records]  # loss tokens: position t predicts token t + 1
    weights = loss_weights(n_tokens, args.loss_agg, sum_over_ranks([sum(n_tokens)])[0], batch)
    trained = [i for i in range(len(records)) if n_tokens[i] and (adv[i] != 0 or args.beta > 0)]  # the rest has no gradient
    per_step = args.minibatch or batch  # episodes per optimizer step
    minibatches = [[i for i in trained if lo <= first + i < lo + per_step] for lo in range(0, batch, per_step)]
    several_steps = args.ppo_epochs > 1 or len(minibatches) > 1

    def micro_batches(episodes):
        """(ids, mask, advantage per token, weight per token) for each micro-batch of `episodes`."""
        for micro in token_microbatches([len(records[i]["ids"]) for i in episodes], args.token_budget):
            micro = [episodes[j] for j in micro]
            ids, mask = pad_batch(([records[i]["ids"] for i in micro], [records[i]["mask"] for i in micro]), 0, model.device)  # (B, T)
            per_token = lambda vals: torch.cat([torch.full((n_tokens[i],), float(vals[i])) for i in micro]).to(model.device)  # (N,)
            yield micro, ids, mask, per_token(adv.tolist()), per_token(weights)

    sampled = lambda micro: torch.tensor([lp for i in micro for lp, m in zip(records[i]["logprobs"][1:], records[i]["mask"][1:]) if m])
    with compiled_layers(model):  # on a GPU a big model's layers run compiled (common.compile_layers)
        before = {}  # episode -> (logprobs before any update, the reference's logprobs), from a no-grad pass
        if several_steps or args.beta > 0:
            with torch.no_grad(), amp:
                for micro, ids, mask, _, _ in micro_batches(trained):
                    sizes = [n_tokens[i] for i in micro]
                    old = token_logprobs(model, ids, mask, args.temp)[0].split(sizes)
                    ref = token_logprobs(ref_model, ids, mask, args.temp)[0].split(sizes) if ref_model else [None] * len(micro)
                    before.update({i: (o, r) for i, o, r in zip(micro, old, ref)})

        sums, grad_norm, skipped = Counter(), 0.0, 0
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
                    loss, clipped = policy_loss(logp, old_logp, adv_tok, weight_tok, args.loss, eps_low=args.eps_low,
                                                eps_high=args.eps_high, ref_logp=ref_logp, beta=args.beta)
                    loss.backward()
                    total_loss += loss.item()
                    # logp_mismatch: how far the trainer's logprobs (before any update) are from the sampler's
                    sums.update({"entropy": entropy.sum().item(), "clip_frac": clipped.sum().item(), "tokens": len(logp),
                                 "train_tokens": mask.numel(), "kl": kl_k3(logp.detach(), ref_logp).sum().item() if ref_model else 0.0,
                                 "logp_mismatch": (old_logp.cpu() - sampled(micro)).abs().sum().item() if epoch == 0 else 0.0})
                sum_gradients(model)
                total_loss = sum_over_ranks([total_loss])[0]
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
                if math.isfinite(total_loss) and torch.isfinite(norm):
                    opt.step()
                    grad_norm = norm.item()
                else:
                    print(f"warning: non-finite loss {total_loss} or grad norm {norm.item()}: update skipped")
                    skipped += 1
                opt.zero_grad(set_to_none=True)
    keys = ("entropy", "clip_frac", "kl", "logp_mismatch", "tokens", "train_tokens")
    entropy, clip_frac, kl, mismatch, tokens, train_tokens = sum_over_ranks([sums[k] for k in keys])
    tokens = max(tokens, 1)
    return {"entropy": entropy / tokens, "clip_frac": clip_frac / tokens, "kl": kl / tokens, "grad_norm": grad_norm,
            "logp_mismatch": mismatch / max(tokens // args.ppo_epochs, 1), "train_tokens": train_tokens, "skipped": skipped}


# ----------------------------------------------------------------------------- 5. the loop


class Exploiter:
    """--exploit N: every N steps (and at a run's first and last) the environment's exploit(policy) hook judges the
    greedy policy: (numbers to log, a rank, lower is better, the examples where it errs), which up to half of each
    later step's examples replay. The weights of the best rank (the later on a tie) are kept in DIR_best, and an
    environment's exploit_stop ends the run at a verdict with nothing to replay. Under torchrun rank 0 judges."""
    KEYS = ("exploit_lines", "exploit_step", "exploit_best")  # its state, saved and resumed with the trainer's

    def __init__(self, env, every, out, rank, log, resume):
        self.env, self.every, self.best_dir, self.rank, self.log = env, every, out.rstrip("/") + "_best", rank, log
        self.replays, self.step, self.best, self.stop = None, None, None, getattr(env, "exploit_stop", False)
        if every and not hasattr(env, "exploit"):
            raise SystemExit("--exploit needs an environment with an exploit() hook (tictactoe)")
        if self.stop and not every:
            raise SystemExit("the environment's exploit_stop ends a run at a verdict of --exploit: give --exploit N too")
        if resume and rank == 0:
            finish_save(self.best_dir)  # a save of the best weights that a crash interrupted

    def __call__(self, step, policy, model, tokenizer, last=False):
        """The verdict at `step` where it is due; True when exploit_stop ends the run here."""
        if self.every and self.step != step and (last or self.replays is None or step % self.every == 0):
            found = None
            model.eval()
            if self.rank == 0:
                t0, (summary, key, found) = time.time(), self.env.exploit(policy)
                self.log(step, {**{f"certify_{k}": v for k, v in summary.items()}, "certify_s": time.time() - t0})
                if self.best is None or list(key) <= self.best["key"]:
                    self.best = {"key": list(key), "step": step}
                    save_checkpoint(model, tokenizer, self.best_dir, {"step": step}, {"certificate.json": {"step": step, **summary}})
                print(f"exploit: step {step} ranks {list(key)}, {len(found)} to replay; the best: step {self.best['step']}, {self.best_dir}")
            found, self.best = from_rank0((found, self.best))
            if not last or step % self.every == 0:  # at the last step: the replays of a --resume with more --steps
                self.replays, self.step = found, step
        if self.stop and self.replays == [] and self.step == step:
            print(f"exploit_stop: the verdict at step {step} finds nothing to replay: stopping")
            return True

    def replay(self, examples, step):
        """Up to half of a step's examples replaced, in turn, by the replays, each keeping its example's seed."""
        k = min(len(self.replays or []), len(examples) // 2)
        for j in range(k):
            examples[j] = {"seed": examples[j]["seed"], **self.replays[(step * k + j) % len(self.replays)]}
        return examples


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="out/sft", help="hub id or save_pretrained directory to start from (default: the SFT output)")
    p.add_argument("--env", default="tictactoe", help="environment NAME (env_NAME.py)")
    p.add_argument("--env_args", default="{}", help="JSON keyword arguments for load_environment(); num_groups defaults to batch/group")
    p.add_argument("--batch", type=int, default=256, help="episodes per step (batch/group examples x group rollouts)")
    p.add_argument("--group", type=int, default=8, help="rollouts per example")
    p.add_argument("--temp", type=float, default=1.0, help="sampling temperature (the loss uses the same)")
    p.add_argument("--max_new_tokens", type=int, default=128, help="max generated tokens per turn")
    p.add_argument("--gen_batch", type=int, default=512, help="max episodes played at once (each batch keeps one KV cache for its whole game: this bounds the rollouts' memory)")
    p.add_argument("--engine", choices=["auto", "hf", "fast"], default="auto", help="rollouts: hf (generate(), the reference), fast (engine.py), auto")
    p.add_argument("--steps", type=int, default=200, help="RL steps")
    p.add_argument("--loss", choices=["cispo", "grpo"], default="cispo", help="policy loss")
    p.add_argument("--loss_agg", choices=["token", "sequence"], default="token", help="token: DAPO/CISPO averaging over the batch; sequence: GRPO per-episode mean")
    p.add_argument("--eps_low", type=float, default=None, help="lower clip 1-eps_low (unset: none for cispo, 0.2 for grpo)")
    p.add_argument("--eps_high", type=float, default=0.2, help="upper clip 1+eps_high (0.28 = DAPO clip-higher)")
    p.add_argument("--beta", type=float, default=0.0, help="KL penalty to the frozen initial model (0: no reference loaded)")
    p.add_argument("--scale_rewards", choices=["none", "group"], default="none", help="group: divide advantages by the group's reward std")
    p.add_argument("--ppo_epochs", type=int, default=1, help="passes over each batch")
    p.add_argument("--minibatch", type=int, default=0, help="episodes per optimizer step (0: the whole batch)")
    p.add_argument("--exploit", type=int, default=0, help="every N steps the environment's exploit() hook (tictactoe: its "
                   "certificate) finds where the greedy policy errs, for half of each step to replay; best weights in DIR_best (0: off)")
    add_train_args(p, lr=1e-6, warmup=5, token_budget=32768, out="out/rl", eval_every=20, eval_n=100, save_every=20)
    args = p.parse_args(argv)
    finite = (non_negative, "a finite number >= 0")
    check_flags(args, {**TRAIN_FLAG_RULES, "max_new_tokens": (at_least(1), ">= 1"),
                       "batch": (lambda b: b >= 1 and b % max(args.group, 1) == 0, f"a positive multiple of --group {args.group}"),
                       "group": (at_least(2), ">= 2: the advantage compares rollouts of the same example"), "eps_high": finite,
                       "eps_low": (lambda x: x is None or 0 <= x < 1, "in [0, 1), or unset"),
                       "temp": (positive, "a finite number > 0: the loss divides the logits by it"), "beta": finite,
                       "steps": (at_least(0), ">= 0"),
                       "gen_batch": (at_least(1), ">= 1"), "ppo_epochs": (at_least(1), ">= 1"),
                       "minibatch": (at_least(0), ">= 0 (0: the whole batch)"), "exploit": (at_least(0), ">= 0 (0: off)")})
    return args


def main():
    args = parse_args()
    t_start = time.time()
    rank, world, device = start_run(args)  # under torchrun, rank 0 alone prints and writes files
    os.makedirs(args.out, exist_ok=True)
    resume = checkpoint_to_resume(args, rank)
    log = RunLog(args, rank)

    # the environment (one difficulty bucket per example of a step, where it has num_groups), model and optimizer
    env_args, n_examples = parse_env_args(args.env_args), args.batch // args.group
    first, end = my_share(n_examples, args.group, rank, world)  # under torchrun: this rank's examples of each step
    env = load_env(args.env, env_args, defaults={"num_groups": n_examples})
    exploiter = Exploiter(env, args.exploit, args.out, rank, log, resume)
    model, tokenizer = load_model(args.out if resume else args.model, device, train=True)
    ref_model = load_model(args.model, device)[0].eval().requires_grad_(False) if args.beta > 0 else None
    enable_grad_ckpt(model, args.grad_ckpt, device)
    compile_layers(model, "auto", device)
    tools = getattr(env, "tools", None)  # offered through the chat template
    policy = HFPolicy(model, tokenizer, env.system_prompt, temp=args.temp, max_new_tokens=args.max_new_tokens,
                      batch_size=args.gen_batch, seed=args.seed, engine=args.engine, tools=tools)
    greedy = HFPolicy(model, tokenizer, env.system_prompt, temp=0.0, max_new_tokens=args.max_new_tokens,
                      batch_size=args.gen_batch, engine=args.engine, tools=tools)
    amp = train_autocast(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.99))  # fp32 weights and state
    trainer_state = start_or_resume(args, opt, resume, rank)
    step, bad_steps = trainer_state["step"], 0
    exploiter.replays, exploiter.step, exploiter.best = (trainer_state.get(k) for k in Exploiter.KEYS)

    def save():
        exploit_state = dict(zip(Exploiter.KEYS, (exploiter.replays, exploiter.step, exploiter.best)))
        save_run(model, tokenizer, args.out, rank, {"optimizer": opt.state_dict(), "step": step, **exploit_state}, {"rl_args.json": vars(args)})
        if rank == 0:
            plot_curves([("", os.path.join(args.out, "metrics.jsonl"))], os.path.join(args.out, "curves.png"), getattr(env, "certify_curves", None))

    eval_envs = {}

    def run_eval():
        model.eval()
        evals = evaluate_standard(args.env, env_args, greedy, args.eval_n, 10_000 + args.seed, args.out, eval_envs)
        log.evals(step, evals)
        print("\n".join(show(recs[0]) for _, recs in evals.values()))

    if resume and (step >= args.steps or exploiter.stop and exploiter.replays == [] and exploiter.step == step):  # all done
        print(f"--resume: {args.out} holds the final checkpoint (step {step}, --steps {args.steps}): nothing to do")
        return stop_ranks()
    steps_run, steps_with_signal = 0, 0
    while step < args.steps:
        model.eval()
        if exploiter(step, greedy, model, tokenizer):
            break
        t0, tokens0 = time.time(), policy.gen_tokens
        # 1. rollouts: `group` episodes of each of the step's examples, a function of (seed, step) (under torchrun: of
        # this rank's share of them)
        examples = exploiter.replay(env.examples(n_examples, seed=args.seed * 1_000_003 + step), step)[first:end]
        records = sample_rollouts(env, examples, policy, args.group, step * n_examples + first)
        t_gen = time.time() - t0
        # 2. advantages: each episode's reward minus the mean of its example's group (a group is never split)
        adv = group_advantages([r["reward"] for r in records], args.group, args.scale_rewards)  # (episodes of this rank,)
        # 3-4. the loss on the sampled tokens, and the optimizer step(s)
        opt.param_groups[0]["lr"] = lr = lr_at(step, args.lr, args.warmup, args.steps, "constant")
        model.train()
        with out_of_memory_says(f"in the update: lower --token_budget (now {args.token_budget}) or add --grad_ckpt"):
            stats = update(model, records, adv, args, opt, amp, ref_model, first * args.group, args.batch)
        t_train, step = time.time() - t0 - t_gen, step + 1
        bad_steps = bad_steps + 1 if stats["skipped"] else 0
        # the step's metrics over the whole batch: every rank's episodes, in the order one process would have them
        shares = gather_from_ranks(([{k: r[k] for k in ("reward", "rewards", "metrics", "mask", "truncated")} for r in records],
                                    (adv == 0).tolist(), policy.gen_tokens - tokens0))
        m = rollout_metrics([r for s in shares for r in s[0]])
        m.update({k: stats[k] for k in ("entropy", "clip_frac", "grad_norm", "logp_mismatch")}, lr=lr,
                 zero_adv=sum(z for s in shares for z in s[1]) / args.batch,
                 gen_tokens_per_s=sum(s[2] for s in shares) / t_gen, train_tokens_per_s=stats["train_tokens"] / max(t_train, 1e-9),
                 step_time=time.time() - t0, skipped_updates=stats["skipped"], **({"kl": stats["kl"]} if ref_model else {}),
                 **({"peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30} if device.startswith("cuda") else {}))
        log(step, m)
        steps_run, steps_with_signal = steps_run + 1, steps_with_signal + (m["zero_adv"] < 1 or args.beta > 0)
        if bad_steps >= MAX_BAD_STEPS:
            raise SystemExit(f"{bad_steps} non-finite updates in a row: stopping. The last good checkpoint is in {args.out}; "
                             "lower --lr, or check the model's dtype.")
        if rank == 0 and args.eval_every and step % args.eval_every == 0 and step < args.steps:
            run_eval()  # the other ranks wait at the next collective
        if args.save_every and step % args.save_every == 0 and step < args.steps:
            save()

    exploiter(step, greedy, model, tokenizer, last=True)  # the last step's verdict, where not just made
    if rank == 0:
        run_eval()
    save()
    print(f"done: {step} steps in {time.time() - t_start:.0f}s, model in {args.out}")
    if rank == 0 and steps_run and not steps_with_signal:
        print(f"warning: in all {steps_run} steps every group's episodes had equal rewards (zero_adv 1): every "
              "advantage was 0, so nothing was trained and the weights are the model's as loaded. Raise --temp or "
              "--group, or use an environment whose rewards tell this model's episodes apart.")
    log.close()
    stop_ranks()


if __name__ == "__main__":
    with disk_full_says_what_is_kept("The last complete checkpoint in --out is kept: free space, then rerun with --resume."):
        main()
