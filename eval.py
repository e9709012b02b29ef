"""
Evaluate a model (local, API or scripted) on an environment; --exploit runs its exploit hook.

    python eval.py --model out/rl --setting optimal -n 200 --out out/eval_rl_optimal  # GPU or CPU
    python eval.py --model oracle --env reverse -n 200                    # a scripted player
    python eval.py --model gpt-5-mini --api_base https://api.openai.com/v1 -n 100 --out out/api
    python eval.py --model out/rl --setting optimal random --exploit --out out/eval_rl  # one load
    python eval.py --model out/sft --env reverse -n 5 -r 3 --show 5       # watch it play

Writes DIR/rollouts.jsonl as episodes finish (--resume skips them) and DIR/summary.json: n,
reward_mean, reward_se (over examples), `<name>_rate` and `mean_<name>` of the environment's
metrics (`n_<name>` counts), reward_<component>, timings; with -r R > 1, pass@k (k = 1, 2, 4, ...,
R) and avg@R of its successes (pass_at_ks), each with `<key>_ci95`, its 95% interval.
"""
import argparse
import contextlib
import json
import math
import os
import random
import time

import torch

from common import (Preemption, at_least, can_write, check_flags, disk_full_says_what_is_kept,
                    eval_settings, load_env, parse_env_args)
from policies import POLICY_FLAG_RULES, APIError, add_policy_args, policy_from_args
from sample import rollout, show


# ----------------------------------------------------------------------------- summaries
Z95 = 1.96  # the normal distribution's 97.5% quantile: a two-sided 95% interval


def mean_se(xs):
    """The mean of xs and its standard error (their sample standard deviation over sqrt(len))."""
    mean = sum(xs) / len(xs)
    return mean, math.sqrt(sum((x - mean) ** 2 for x in xs) / max(len(xs) - 1, 1) / len(xs))


def pass_at_k(n, c, k):
    """Chen et al.'s (2021) unbiased pass@k of n samples, c of them successes: the chance that k of
    them drawn without replacement hold one (the first k samples' any() drops the other n - k and
    hangs on their order)."""
    return 1 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_ks(groups):
    """pass@k for k = 1, 2, 4, ..., R and avg@R (the mean success, pass@1's value) of `groups`,
    each example's R successes (bools), with `<key>_ci95`: a figure is the mean over examples of
    each one's own estimate, its interval the normal bound of that mean (in [0, 1]; see below). The
    examples are the independent draws, not the rollouts, which share their example's difficulty:
    as n·R independent draws the interval would be up to sqrt(R) too narrow."""
    r, out = min(map(len, groups)), {}
    ks = {f"pass@{k}": k for k in sorted({2 ** i for i in range(r.bit_length())} | {r})}
    for key, k in {**ks, f"avg@{r}": 1}.items():
        mean, se = mean_se([pass_at_k(len(g), sum(g), k) for g in groups])
        # all n at 1 (or 0), no spread: as P(X = 1) <= E[X] on [0, 1], a mean mu does so w.p. <= mu^n
        edge = 0.025 ** (1 / len(groups)) if se == 0 and mean in (0.0, 1.0) else None
        out[key], out[f"{key}_ci95"] = mean, [mean * edge, 1 - (1 - mean) * edge] if edge else [
            max(mean - Z95 * se, 0.0), min(mean + Z95 * se, 1.0)]
    return out


def summarize(records, best_reward=1.0):
    """Means over episodes: reward (its standard error over examples), environment metrics (named
    as above), reward components; with several rollouts an example, pass_at_ks of the successes:
    the environment's `success` metric where it has one, else a reward reaching best_reward."""
    n = len(records)
    if n == 0:
        return {"n": 0}
    by_example = {}  # the independent draws are the examples, not their rollouts (pass_at_ks)
    for r in records:
        by_example.setdefault(r["index"], []).append(r)
    mean, se = mean_se([sum(r["reward"] for r in g) / len(g) for g in by_example.values()])
    out = {"n": n, "reward_mean": mean, "reward_se": se}
    for k in records[0].get("metrics", {}):
        key = f"mean_{k[2:]}" if k.startswith("n_") else f"{k}_rate"
        out[key] = sum(r["metrics"][k] for r in records) / n
    for k in records[0]["rewards"]:
        out[f"reward_{k}"] = sum(r["rewards"][k] for r in records) / n
    if min(map(len, by_example.values())) > 1:
        out.update(pass_at_ks([[r["metrics"].get("success", r["reward"] >= best_reward) == 1
                                for r in g] for g in by_example.values()]))
    tasks = sorted({str(r["example"].get("task")) for r in records
                    if isinstance(r.get("example"), dict)})
    if len(tasks) > 1:  # a mix of tasks (reasoning-gym's): each task's own summary too
        out["by_task"] = {t: summarize([r for r in records if str(r["example"].get("task")) == t],
                                       best_reward) for t in tasks}
    return out


def format_summary(s, title=""):
    """A summary's lines: episodes, reward ± standard error, the rest (rates, pass@k in %)."""
    rows = [title] if title else []
    if "n" in s:
        rows.append(f"  {'episodes':<18} {s['n']}")
    if "reward_mean" in s:
        rows.append(f"  {'reward':<18} {s['reward_mean']:.4f} ± {s['reward_se']:.4f}")
    for k, v in s.items():
        if k not in ("n", "reward_mean", "reward_se", "by_task") and not k.endswith("_ci95"):
            ci = s.get(f"{k}_ci95")
            rows.append(f"  {k:<18} " + (f"{v:.1%} (95% CI {ci[0]:.1%} to {ci[1]:.1%})" if ci else
                                         f"{v:.1%}" if k.endswith("_rate") else
                                         f"{v:.4g}" if isinstance(v, float) else str(v)))
    for task, t in s.get("by_task", {}).items():
        rates = ", ".join(f"{k[:-5]} {v:.1%}" for k, v in t.items() if k.endswith("_rate"))
        rows.append(f"  {'task ' + task:<18} {t['n']} episodes, "
                    f"reward {t['reward_mean']:.4f}, {rates}")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- evaluation
def evaluate(env, policy, n, rollouts=1, seed=0, out=None, resume=False, progress=True):
    """Play n examples x rollouts into DIR/rollouts.jsonl, DIR/summary.json; (summary, records)."""
    examples, old, path = env.examples(n, seed), [], out and os.path.join(out, "rollouts.jsonl")
    os.makedirs(out or ".", exist_ok=True)
    if out and resume and os.path.exists(path):
        with open(path) as f:  # json.dumps escapes newlines: a line without one is cut by a crash
            old = [r for r in (json.loads(line) for line in f if line.endswith("\n"))
                   if r["index"] < n and r["rollout"] < rollouts]
        with open(path + ".part", "w") as f:  # whole rows, swapped in at once: a kill loses none
            f.writelines(json.dumps(r) + "\n" for r in old)
        os.replace(path + ".part", path)
    skip = {(r["index"], r["rollout"]) for r in old}
    t0, tokens0 = time.time(), policy.gen_tokens
    # line-buffered: each finished episode's row is on disk at once, for --resume to go on from
    with open(path, "a" if resume else "w", buffering=1) if out else contextlib.nullcontext() as f:
        new = rollout(env, examples, policy, group=rollouts, progress=progress, skip=skip,
                      on_done=f and (lambda rec: f.write(json.dumps(rec) + "\n")))
    wall = time.time() - t0
    records = sorted(old + new, key=lambda r: (r["index"], r["rollout"]))
    summary = summarize(records, getattr(env, "best_reward", 1.0))
    summary.update(wall_s=wall, episodes_per_s=len(new) / max(wall, 1e-9),
                   gen_tokens_per_s=(policy.gen_tokens - tokens0) / max(wall, 1e-9))
    if out:
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary, records


def evaluate_standard(env_name, env_args, policy, n, seed=10_000, out=None, envs=None):
    """{setting: evaluate()} under each of the environment's EVAL_SETTINGS (env_args overridden), or
    once as given. Callers keep `envs` to build each once a run (third-party ones start workers)."""
    results, envs = {}, {} if envs is None else envs
    for name, opp in eval_settings(env_name).items():
        if name not in envs:
            envs[name] = load_env(env_name, {**env_args, **opp})
        results[name] = evaluate(envs[name], policy, n, seed=seed, progress=False,
                                 out=os.path.join(out, f"eval_{name}") if out else None)
    return results


# ----------------------------------------------------------------------------- training curves
def stages_on_one_axis(stages):
    """Rows of [(name, metrics.jsonl)], each stage's steps shifted to start at the last step of the
    one before (whose final weights it starts from), and [(first step, name)] of those found."""
    rows, starts, offset = [], [], 0
    for name, path in stages:
        stage = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
        if stage:
            rows += [{**r, "step": r["step"] + offset} for r in stage]
            starts.append((offset, name))
            offset += max(r["step"] for r in stage)
    return rows, starts


def plot_curves(stages, png, panels=None):
    """Training curves as a PNG if matplotlib is installed (returns whether drawn) of stages [(name,
    rl.py metrics.jsonl)] on one step axis, starts dotted. Panels: reward, its components, entropy,
    reply length, grad norm, eval mean reward per setting; then `panels` [(title, keys)] (an env's
    curve_panels), else one of every exploit_* key; integer counts on symlog (hundreds to 0)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows, starts = stages_on_one_axis(stages)
    keys = lambda prefix, suffix="": list(dict.fromkeys(
        k for r in rows for k in r if k.startswith(prefix) and k.endswith(suffix)))
    train = ["reward"] + keys("reward_") + ["entropy", "reply_len", "grad_norm"]
    verdicts = [k for k in keys("exploit_") if k != "exploit_s"
                and all(isinstance(r.get(k, 0), (int, float)) for r in rows)]
    panels_of_train = [(k, [k]) for k in train if any(k in r for r in rows)]
    panels_of_train += [("greedy evaluation: mean reward", keys("eval_", "_reward_mean"))]
    panels = panels_of_train + ([(t, list(ks)) for t, ks in (panels or [("exploit", verdicts)])]
                                if verdicts else [])
    n_rows = (len(panels) + 3) // 4
    fig, axes = plt.subplots(n_rows, 4, figsize=(16, 3 * n_rows), squeeze=False)
    for ax, (title, panel) in zip(axes.flat, panels):
        for k in panel:
            pts = [(r["step"], r[k]) for r in rows if k in r]
            if pts:
                ax.plot(*zip(*pts), **({"linewidth": 0.8} if len(panel) == 1 else {
                    "marker": "o", "markersize": 3, "label": k.split("_", 1)[1]}))
        ax.set_title(title, fontsize=9)
        if len(panel) > 1 and ax.lines:
            ax.legend(fontsize=7)
        counts = all(isinstance(r[k], int) for k in panel for r in rows if k in r)
        if panel and panel[0].startswith("exploit_") and counts:
            ax.set_yscale("symlog", linthresh=1)
        ax.set_xlabel("step")
        for x, _ in starts[1:]:
            ax.axvline(x, color="grey", linewidth=0.6, linestyle=":")
    if len(starts) > 1:
        fig.suptitle("stages (dotted lines), from step: "
                     + ", ".join(f"{name} {x}" for x, name in starts), fontsize=10)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    # fixed margins: tight_layout measures every tick label first, a third of the drawing's time
    height = 3 * n_rows  # inches: room for the x labels below, the titles (and suptitle) above
    fig.subplots_adjust(left=0.04, right=0.99, bottom=0.55 / height,
                        top=1 - (0.3 + 0.3 * (len(starts) > 1)) / height, wspace=0.22, hspace=0.55)
    fig.savefig(png, dpi=80)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- CLI
def run_task(args, task, env_args, policy, out, env):
    """One setting's episodes, or the exploit hook's verdict; its summary printed and saved. `env`
    (loaded from env_args) plays where the setting changes none of them."""
    task_env_args = {**env_args, **eval_settings(args.env).get(task, {})}
    env = env if task_env_args == env_args else load_env(args.env, task_env_args)
    if task == "exploit":
        summary, score, found = env.exploit(policy, out)
        print(format_summary(summary, f"exploit hook on {args.model} (greedy): "
                                      f"score {list(score)}, {len(found)} examples where it errs"))
    else:
        summary, records = evaluate(env, policy, args.n, args.rollouts, args.seed, out, args.resume)
        for rec in records[:args.show]:
            print(show(rec) + "\n")
        print(format_summary(summary, f"{args.model} on {args.env} {json.dumps(task_env_args)}"))
    if out:
        with open(os.path.join(out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)


def main():
    p = add_policy_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    p.set_defaults(temp=0.0)
    add = p.add_argument
    add("-n", type=int, default=100, help="number of examples")
    add("-r", "--rollouts", type=int, default=1, help="rollouts per example")
    add("--setting", nargs="+", default=None, metavar="SETTING", help="EVAL_SETTINGS names; several"
        " (or one with --exploit) run in turn on one loaded model, each in a subdirectory of --out")
    add("--out", default=None, help="directory for summary.json and rollouts.jsonl")
    add("--resume", action="store_true", help="skip episodes already in DIR/rollouts.jsonl")
    add("--exploit", action="store_true", help="the environment's exploit(policy, out) hook on "
        "the greedy policy: its summary, and its report in --out")
    add("--show", type=int, default=2, help="transcripts to print")
    args = p.parse_args()
    check_flags(args, {**POLICY_FLAG_RULES, "n": (at_least(1), ">= 1"),
                       "rollouts": (at_least(1), ">= 1"), "show": (at_least(0), ">= 0"),
                       "out": (lambda d: d is None or can_write(d), "a directory you can write")})
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    env_args = dict(parse_env_args(args.env_args))
    if args.exploit and args.temp != 0:
        raise SystemExit("--exploit judges the greedy policy: use --temp 0")
    # tasks: each setting's episodes, then the exploit hook; the model is loaded once for all
    tasks = (list(args.setting or ([] if args.exploit else [None]))
             + (["exploit"] if args.exploit else []))
    env = load_env(args.env, env_args)
    settings = eval_settings(args.env)
    if unknown := sorted(set(args.setting or []) - set(settings)):
        raise SystemExit(f"--setting {' '.join(unknown)}: "
                         f"{args.env} names the settings {', '.join(settings)}")
    if args.exploit and not hasattr(env, "exploit"):
        raise SystemExit("--exploit needs an environment with an exploit(policy, out) hook: "
                         f"{args.env!r} has none")
    policy = policy_from_args(args, env)
    with Preemption(now=True) as preempt:  # SIGTERM, Ctrl-C: the rows written so far are kept
        for task in tasks:
            out = os.path.join(args.out, task) if args.out and len(tasks) > 1 else args.out
            try:
                run_task(args, task, env_args, policy, out, env)
            except APIError as e:
                raise SystemExit(str(e)) from None
            except KeyboardInterrupt:
                preempt.stop(f"the finished episodes are in {out}/rollouts.jsonl" if out
                             else "nothing is kept (no --out)")


if __name__ == "__main__":
    with disk_full_says_what_is_kept("The finished rows in --out's rollouts.jsonl are kept: "
                                     "free space, then rerun with --resume."):
        main()
