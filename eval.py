"""
Evaluate a model (local, API or scripted) on an environment; --certify proves a greedy policy's play.

    python eval.py --model out/rl --opponent optimal -n 200 --out out/eval_rl_optimal     # GPU or CPU
    python eval.py --model minimax --opponent random -n 200                                # scripted baseline
    python eval.py --model gpt-5-mini --api_base https://api.openai.com/v1 --opponent optimal -n 100 --out out/api
    python eval.py --model out/rl --certify --out out/cert_rl                              # every opponent line
    python eval.py --model out/rl --opponent optimal random --certify --out out/eval_rl    # all three, one model load
    python eval.py --model out/sft --env reverse -n 5 -r 3

Writes DIR/rollouts.jsonl as episodes finish (an interrupted run keeps them; --resume skips them) and
DIR/summary.json. Summary keys: n, reward_mean, reward_se, reward_<component>, and from the environment's
per-episode metrics `<name>_rate` (indicators and fractions; tic-tac-toe: win, draw, loss, format, invalid,
cut_off) and `mean_<name>` (counts named n_<name>), plus wall_s, episodes_per_s, gen_tokens_per_s.
"""
import argparse
import json
import math
import os
import random
import time

import torch

from common import at_least, can_write, check_flags, disk_full_says_what_is_kept, eval_settings, load_env, parse_env_args
from sample import POLICY_FLAG_RULES, APIError, add_policy_args, policy_from_args, rollout, show

# ----------------------------------------------------------------------------- summaries


def summarize(records):
    """Means over episodes: rewards, components, and metrics by the naming convention above."""
    n = len(records)
    if n == 0:
        return {"n": 0}
    rewards = [r["reward"] for r in records]
    mean = sum(rewards) / n
    var = sum((x - mean) ** 2 for x in rewards) / max(n - 1, 1)
    out = {"n": n, "reward_mean": mean, "reward_se": math.sqrt(var / n)}
    for k in records[0]["rewards"]:
        out[f"reward_{k}"] = sum(r["rewards"][k] for r in records) / n
    for k in records[0].get("metrics", {}):
        key = f"mean_{k[2:]}" if k.startswith("n_") else f"{k}_rate"
        out[key] = sum(r["metrics"][k] for r in records) / n
    return out


def format_summary(s, title=""):
    rows = [title] if title else []
    order = ["win_rate", "draw_rate", "loss_rate", "format_rate", "invalid_rate", "cut_off_rate", "mean_turns"]
    keys = [k for k in order if k in s] + [k for k in s if k not in order and k not in ("n", "reward_mean", "reward_se")]
    if "n" in s:
        rows.append(f"  {'episodes':<18} {s['n']}")
    if "reward_mean" in s:
        rows.append(f"  {'reward':<18} {s['reward_mean']:.4f} ± {s['reward_se']:.4f}")
    for k in keys:
        v = s[k]
        rows.append(f"  {k:<18} " + (f"{v:.1%}" if k.endswith("_rate") else f"{v:.4g}" if isinstance(v, float) else str(v)))
    return "\n".join(rows)


# ----------------------------------------------------------------------------- evaluation


def evaluate(env, policy, n, rollouts=1, seed=0, out=None, resume=False, progress=True):
    """Play n examples x rollouts; write DIR/rollouts.jsonl as they finish and DIR/summary.json. Returns (summary, records)."""
    examples = env.examples(n, seed)
    old, path = [], None
    if out:
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, "rollouts.jsonl")
        if resume and os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        old.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass  # a line cut by a crash: that episode is simply played again
        old = [r for r in old if r["index"] < n and r["rollout"] < rollouts]
    skip = {(r["index"], r["rollout"]) for r in old}
    if path and resume:  # keep only the complete lines (a cut line never stays), swapped in whole: a kill loses none
        with open(path + ".part", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in old)
        os.replace(path + ".part", path)
    sink = open(path, "a" if resume else "w") if path else None

    def write(rec):
        if sink:
            sink.write(json.dumps(rec) + "\n")
            sink.flush()
    t0, tokens0 = time.time(), policy.gen_tokens
    try:
        new = rollout(env, examples, policy, group=rollouts, on_done=write, progress=progress, skip=skip)
    finally:
        if sink:
            sink.close()
    wall = time.time() - t0
    records = sorted(old + new, key=lambda r: (r["index"], r["rollout"]))
    summary = summarize(records)
    summary.update(wall_s=wall, episodes_per_s=len(new) / max(wall, 1e-9),
                   gen_tokens_per_s=(policy.gen_tokens - tokens0) / max(wall, 1e-9))
    if out:
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary, records


def evaluate_standard(env_name, env_args, policy, n, seed=10_000, out=None):
    """evaluate() under each of the environment module's EVAL_SETTINGS (env_args overrides; tic-tac-toe:
    the optimal and the random opponent), or once with env_args as given. Returns {setting: (summary, records)}; sft.py and rl.py use it."""
    results = {}
    for name, opp in eval_settings(env_name).items():
        env = load_env(env_name, {**env_args, **opp})
        results[name] = evaluate(env, policy, n, seed=seed, out=os.path.join(out, f"eval_{name}") if out else None, progress=False)
    return results


# ----------------------------------------------------------------------------- the speedrun's report


def stages_on_one_axis(stages):
    """The metrics rows of [(name, metrics.jsonl)], each stage's steps shifted to start where the one before ended
    (its last step: the next stage starts from weights of that run), and [(first step, name)] of the stages found."""
    rows, starts, offset = [], [], 0
    for name, path in stages:
        stage = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
        if stage:
            rows += [{**r, "step": r["step"] + offset} for r in stage]
            starts.append((offset, name))
            offset += max(r["step"] for r in stage)
    return rows, starts


def plot_curves(stages, png):
    """Training curves as a PNG, when matplotlib is installed (no run needs it); returns whether drawn. stages:
    [(name, metrics.jsonl of an rl.py run)], drawn one after another on one step axis, each from its step 0 (rl.py:
    its own run; the speedrun's report: its RL stages, their starts dotted and named). Panels: the training episodes'
    numbers, the greedy evaluations, and --exploit's certificates (lost lines and mistakes on a symlog axis; the
    optimal-move share and the exact win rate against the random opponent)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows, starts = stages_on_one_axis(stages)
    train = [r for r in rows if "reward" in r]
    evals = [r for r in rows if any(k.startswith("eval_") for k in r)]
    cert = [r for r in rows if "certify_lines_lost" in r]
    keys = [k for k in ("reward", "win", "loss", "invalid", "format", "reward_optimal", "entropy", "reply_len", "grad_norm")
            if any(k in r for r in train)]
    n_panels = len(keys) + 1 + 2 * bool(cert)
    n_rows = (n_panels + 3) // 4
    fig, axes = plt.subplots(n_rows, 4, figsize=(16, 3 * n_rows), squeeze=False)
    axes = axes.flatten()
    for ax, k in zip(axes, keys):
        pts = [(r["step"], r[k]) for r in train if k in r]
        ax.plot(*zip(*pts), linewidth=0.8)
        ax.set_title(k)
    ax = axes[len(keys)]
    eval_keys = {k for r in evals for k in r if k.startswith("eval_")}
    games = {k for k in eval_keys if k.endswith(("win_rate", "loss_rate"))}  # a game's; else the mean reward
    for k in sorted(games or {k for k in eval_keys if k.endswith("reward_mean")}):
        ax.plot(*zip(*[(r["step"], r[k]) for r in evals if k in r]), marker="o", label=k[5:])
    ax.set_title("greedy evaluation")
    if ax.lines:
        ax.legend(fontsize=7)
    cert_panels = (("certificate (greedy, every opponent line)", ("lines_lost", "mistakes")),
                   ("certificate: optimal moves, exact wins vs random", ("optimal_move_rate", "random_win_rate")))
    for ax, (title, panel) in zip(axes[len(keys) + 1:] if cert else [], cert_panels):
        for k in panel:
            pts = [(r["step"], r[f"certify_{k}"]) for r in cert if f"certify_{k}" in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, label=k)
        ax.set_title(title, fontsize=9)
        if ax.lines:
            ax.legend(fontsize=7)
    if cert:  # lost lines fall from hundreds to 0: a symlog axis shows both
        axes[len(keys) + 1].set_yscale("symlog", linthresh=1)
    for ax in axes[:n_panels]:
        ax.set_xlabel("step")
        for x, _ in starts[1:]:
            ax.axvline(x, color="grey", linewidth=0.6, linestyle=":")
    if len(starts) > 1:
        fig.suptitle("stages (dotted lines), from step: " + ", ".join(f"{name} {x}" for x, name in starts), fontsize=10)
    for ax in axes[n_panels:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)
    return True


def write_report(out, times, teacher, teacher_p, sft_args, rl_args, env_args, puzzle_args="", polish_args="", wins_args="",
                 resumed=False):
    """OUT/results.json and OUT/report.md from the evaluations speedrun.sh wrote to OUT/eval/{teacher,sft,rl}/
    {optimal,random,certify}; times = (SFT, RL, total) in seconds, or None; the SFT teacher (minimax with random-move
    probability teacher_p, or a rules teacher) and the other arguments name the run's recipe."""
    import platform
    t_sft, t_rl, t_all = times or (None, None, None)
    load = lambda who, task: json.load(open(os.path.join(out, "eval", who, task, "summary.json")))
    res = {w: {"optimal": load(w, "optimal"), "random": load(w, "random"), "certificate": load(w, "certify")} for w in ("teacher", "sft", "rl")}
    # a resumed speedrun (RESUME=1) times only its own invocation: the stages finished before it count ~0
    res["times_s"] = {"sft": int(t_sft), "rl": int(t_rl), "total": int(t_all), "resumed": resumed} if times else None
    res["machine"] = f"{platform.machine()}, {os.cpu_count()} cores" + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", CPU only")
    # the RL stages speedrun.sh ran, in order: (directory, the model it starts from, its flags, its name); the last
    # gives the RL model, its best certificate's weights
    stages = [stage for stage in (("rl_puzzles", "sft", puzzle_args, "puzzle stage "),
                                  ("rl", "rl_puzzles" if puzzle_args else "sft", rl_args, ""),
                                  ("rl_polish", "rl", polish_args, "third stage "),
                                  ("rl_wins", "rl_polish_best", wins_args, "fourth stage ")) if stage[0] == "rl" or stage[2]]
    best = os.path.join(out, stages[-1][0] + "_best", "certificate.json")
    res["rl_step"] = json.load(open(best))["step"] if os.path.exists(best) else None  # the RL model's step
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(res, f, indent=2)
    max_new = json.load(open(os.path.join(out, "eval", "rl", "optimal", "args.json")))["max_new_tokens"]
    teacher_flags = f"--teacher minimax --teacher_random_prob {teacher_p}" if teacher == "minimax" else f"--teacher {teacher}"
    name = {"teacher": f"teacher (minimax, random moves p={teacher_p})" if teacher == "minimax" else
                       f"teacher ({teacher}: a random legal move, no strategy)", "sft": "SFT model",
            "rl": "RL model" + (f" ({stages[-1][3]}step {res['rl_step']}: the best certificate)"
                                if res["rl_step"] is not None else "")}
    rows = ["| model | opponent | win | draw | loss | format | games with invalid move |", "|---|---|---|---|---|---|---|"]
    for w in ("teacher", "sft", "rl"):
        for o in ("random", "optimal"):
            s = res[w][o]
            rows.append(f"| {name[w]} | {o} | {s['win_rate']:.1%} | {s['draw_rate']:.1%} | {s['loss_rate']:.1%} | {s['format_rate']:.1%} | {s['invalid_rate']:.1%} |")
    cert = ["| model | lines | won | drawn | lost | mistaken decisions | optimal moves | wins taken | threats blocked | "
            "other moves optimal | true `Wins:` checks | own wins stated | random opponent, exact: win / loss |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in ("teacher", "sft", "rl"):
        c = res[w]["certificate"]
        cert.append(f"| {name[w]} | {c['lines']} | {c['lines_won']} | {c['lines_drawn']} | {c['lines_lost']} | "
                    f"{c['mistakes']} of {c['decisions']} | {c['optimal_move_rate']:.1%} | {c['wins_taken']} of "
                    f"{c['win_positions']} | {c['threats_blocked']} of {c['block_positions']} | {c['quiet_optimal']} of {c['quiet_positions']} | "
                    f"{c['checks_true']} of {c['decisions']} | {c['wins_stated']} of {c['win_positions']} | "
                    f"{c['random_win_rate']:.1%} / {c['random_loss_rate']:.1%} |")
    # where the RL model still errs: the certificate's positions (board row by row, X = the model)
    errs = json.load(open(os.path.join(out, "eval", "rl", "certify", "certificate.json")))["mistake_positions"]
    shown = [f"- {m['kind']}: {m['board'][:3]}/{m['board'][3:6]}/{m['board'][6:]}, it replied "
             f"`{' '.join(m['reply'].split())}`" for m in errs[:20]]
    n = res["rl"]["optimal"]["n"]
    errors = (f"The RL model's mistaken decisions: {len(errs)} (the first {len(shown)} below; all in {out}/eval/rl/certify/certificate.json)"
              if errs else "The RL model makes no mistaken decision: each of its moves on every line is minimax-optimal.")
    nl = "\n"
    drawn = plot_curves([(d, os.path.join(out, d, "metrics.jsonl")) for d, *_ in stages], os.path.join(out, "curves.png"))
    metrics = ", ".join(f"{out}/{d}/metrics.jsonl" for d, *_ in stages)
    rl_commands = "".join(f"    python rl.py --model {out}/{start} {args} --out {out}/{d}{nl}" for d, start, args, _ in stages)
    report = f"""# speedrun report

Machine: {res['machine']}. {f"Wall time{' of this resumed invocation alone (RESUME=1; earlier ones not counted)' if resumed else ''}: SFT {t_sft}s, RL {t_rl}s, total with evaluation {t_all}s" if times else "Wall time: not given (--times)"}.

## Greedy play, {n} games per opponent
{nl.join(rows)}

## Certificate: the greedy policy against every opponent line (moving first and second)
{nl.join(cert)}

Each decision by what its position demands: a win to take (the model can complete a line at once), else a threat to
block (the opponent could), else another move, optimal by minimax (where forks are made or stopped). A true check:
the reply's <think> opens with `Wins: me A, opponent B.` and it is right (and its `Then: me C.`, where written);
own wins stated: at the positions with a win to take, the check's `me` part names exactly those cells. Random
opponent, exact: the greedy policy's results against a uniformly random opponent, every line weighted by its
probability (the games above sample them, 200 to about 2 points).

{errors}
{nl.join(shown)}

## Commands
    python sft.py --model scratch {teacher_flags} {sft_args} --out {out}/sft
{rl_commands}    python eval.py --model MODEL --opponent optimal random --certify -n {n} --temp 0 --max_new_tokens {max_new} --env_args '{env_args}' --out {out}/eval/WHO

Training curves: {f"{out}/curves.png (the RL stages one after another)" if drawn else "none drawn (matplotlib is not installed)"}; the metrics: {metrics}
"""
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(report)
    print(report)


# ----------------------------------------------------------------------------- CLI


def run_task(args, task, env_args, policy, out):
    """One opponent's games, or the certificate, with its summary printed and written to out."""
    task_env_args = {**env_args, **eval_settings(args.env).get(task, {})}
    env = load_env(args.env, task_env_args)
    if task == "certify":
        summary, mistakes = env.certify(policy, out)
        for m in mistakes[:args.show]:
            print(json.dumps(m) + "\n")
        print(format_summary(summary, f"certificate for {args.model} (greedy)"))
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
    p.add_argument("-n", type=int, default=100, help="number of examples")
    p.add_argument("-r", "--rollouts", type=int, default=1, help="rollouts per example")
    p.add_argument("--opponent", nargs="+", default=None, metavar="SETTING",
                   help="evaluation settings the environment names in its EVAL_SETTINGS (tictactoe: optimal, random); "
                        "several (or one with --certify) run one after the other on one loaded model, each into its own "
                        "subdirectory of --out")
    p.add_argument("--out", default=None, help="directory for summary.json and rollouts.jsonl")
    p.add_argument("--resume", action="store_true", help="skip episodes already in DIR/rollouts.jsonl")
    p.add_argument("--certify", action="store_true", help="the environment's certify hook (tictactoe: the greedy policy "
                   "against every opponent line)")
    p.add_argument("--show", type=int, default=2, help="transcripts to print")
    p.add_argument("--report", default=None, metavar="OUT", help="write OUT/report.md and OUT/results.json from the "
                   "evaluations speedrun.sh left in OUT/eval (no model is loaded); with --times, --sft_args, --rl_args, "
                   "--teacher and --random_move_prob (the SFT teacher's) and --env_args (the evaluation's) naming the run")
    p.add_argument("--teacher", choices=["minimax", "rules", "rules_wins", "rules_then"], default="minimax", help="--report: the "
                   "SFT teacher (speedrun.sh TEACHER): minimax with --random_move_prob, or rules / rules_wins / rules_then (random "
                   "legal moves)")
    p.add_argument("--times", type=int, nargs=3, default=None, metavar=("SFT", "RL", "TOTAL"), help="--report: wall times in seconds")
    p.add_argument("--resumed", action="store_true", help="--report: --times are those of a resumed run's last invocation alone (speedrun.sh RESUME=1)")
    p.add_argument("--sft_args", default="", help="--report: the flags the run gave sft.py")
    p.add_argument("--rl_args", default="", help="--report: the flags the run gave rl.py")
    p.add_argument("--puzzle_args", default="", help="--report: the flags of an RL stage on puzzles before it, if any")
    p.add_argument("--polish_args", default="", help="--report: the flags of an RL stage after it (speedrun.sh POLISH_STEPS), if any")
    p.add_argument("--wins_args", default="", help="--report: the flags of a fourth RL stage from the third's best weights "
                   "(speedrun.sh WINS_STEPS), if any")
    args = p.parse_args()
    check_flags(args, {**POLICY_FLAG_RULES, "n": (at_least(1), ">= 1"), "rollouts": (at_least(1), ">= 1"),
                       "show": (at_least(0), ">= 0"), "out": (lambda d: d is None or can_write(d), "a directory you can write")})
    if args.report:
        return write_report(args.report, args.times, args.teacher, args.random_move_prob, args.sft_args, args.rl_args, args.env_args,
                            args.puzzle_args, args.polish_args, args.wins_args, args.resumed)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    env_args = dict(parse_env_args(args.env_args))
    if args.certify and args.temp != 0:
        raise SystemExit("--certify proves the greedy policy: use --temp 0")
    # tasks: each opponent's games, then the certificate; the model is loaded once for all of them
    tasks = list(args.opponent or ([] if args.certify else [None])) + (["certify"] if args.certify else [])
    env = load_env(args.env, env_args)
    settings = eval_settings(args.env)
    unknown = sorted(set(args.opponent or []) - set(settings))
    if unknown:
        raise SystemExit(f"--opponent {' '.join(unknown)}: {args.env} names the settings {', '.join(settings)}")
    if args.certify and not hasattr(env, "certify"):
        raise SystemExit(f"--certify needs an environment with a certify(policy, out) hook (tictactoe), not {args.env!r}")
    policy = policy_from_args(args, env)
    for task in tasks:
        out = os.path.join(args.out, task) if args.out and len(tasks) > 1 else args.out
        try:
            run_task(args, task, env_args, policy, out)
        except APIError as e:
            raise SystemExit(str(e)) from None


if __name__ == "__main__":
    with disk_full_says_what_is_kept("The finished rows in --out's rollouts.jsonl are kept: free space, then rerun with --resume."):
        main()
