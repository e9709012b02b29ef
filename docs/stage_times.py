"""
How long a recorded speedrun would take on this machine, without running it whole: each of its stages runs again
for a few steps, with the flags the run recorded (sft_args.json, each RL stage's rl_args.json, the evaluations'
args.json), from the weights that stage started from, and the recorded stage's time is scaled by how long those
same first steps take here. For the GPU budget of docs/RANDOM_TEACHER.md (the recipe end to end in 15 minutes on
one H100) in a few minutes of device time.

    python docs/stage_times.py bundle out/rt_seed0 out/rt_bundle         # a finished run's records and weights (~22 MB)
    python docs/stage_times.py time out/rt_bundle --out out/stage_times  # on the machine to time (carry out/rt_bundle)

A stage's projection: the probe's time outside its steps and certificates (loading, SFT's data, the final
evaluation and save) and its first step (a warm-up), plus the rest of the recorded stage's steps and certificates,
each scaled by the probe's time over the recorded time on the steps and certificates both ran. With the same flags,
seed and starting weights the probe replays the recorded run's first steps (on the same kind of machine, token for
token), and a stage's steps grow or shrink as its policy's games do, so a ratio on the same steps carries to the
rest of the stage better than a mean step. The evaluations run whole.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja")
RECORDS = ("sft_args.json", "rl_args.json", "metrics.jsonl")


def rl_stages(run):
    """The run's RL stages in the order they ran: [(directory name, name of the weights it started from)], each
    stage starting from the one before (or its _best weights), the first from sft."""
    stages = {}
    for name in sorted(os.listdir(run)):
        path = os.path.join(run, name, "rl_args.json")
        if os.path.exists(path):
            stages[name] = os.path.basename(json.load(open(path))["model"].rstrip("/"))
    order, start = [], "sft"
    while True:
        nxt = [s for s, frm in stages.items() if frm in (start, start + "_best") and s not in dict(order)]
        if not nxt:
            return order
        order.append((nxt[0], stages[nxt[0]]))
        start = nxt[0]


def bundle(run, dest):
    """Copy what `time` needs from a finished speedrun directory: the records of SFT and every RL stage, the weights
    each stage and evaluation started from, the evaluations' args.json."""
    stages = rl_stages(run)
    if not os.path.exists(os.path.join(run, "sft", "sft_args.json")) or not stages:
        raise SystemExit(f"{run}: not a finished speedrun directory (it needs sft/sft_args.json and RL stages with rl_args.json)")
    evals = {who: json.load(open(os.path.join(run, "eval", who, "optimal", "args.json")))
             for who in sorted(os.listdir(os.path.join(run, "eval")))}
    weights = {frm for _, frm in stages} | {os.path.basename(a["model"].rstrip("/")) for a in evals.values()
                                             if os.path.isdir(a["model"])}
    for name in {"sft", *dict(stages)} | weights:
        os.makedirs(os.path.join(dest, name), exist_ok=True)
        keep = (RECORDS if name in {"sft", *dict(stages)} else ()) + (MODEL_FILES if name in weights else ())
        for f in keep:
            if os.path.exists(os.path.join(run, name, f)):
                shutil.copy2(os.path.join(run, name, f), os.path.join(dest, name, f))
    for who, args in evals.items():
        os.makedirs(os.path.join(dest, "eval", who), exist_ok=True)
        with open(os.path.join(dest, "eval", who, "args.json"), "w") as f:
            json.dump(args, f, indent=2)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dest) for f in fs)
    print(f"{dest}: {size / 2**20:.1f} MiB (SFT, RL stages {', '.join(s for s, _ in stages)}, evaluations {', '.join(evals)})")


def argv_of(args, **override):
    """Command-line flags that give a script these parsed arguments (its recorded vars(args)), some replaced."""
    out = []
    for key, value in {**args, **override}.items():
        if value is None or value is False or value == "" or key == "resume":
            continue
        flag = f"-{key}" if len(key) == 1 else f"--{key}"  # eval.py's -n
        if value is True:
            out.append(flag)
        elif isinstance(value, list):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def run_script(script, argv, log):
    """Run one of the project's scripts, its output to `log`; its wall time in seconds."""
    t0 = time.time()
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, os.path.join(ROOT, script), *argv], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{script} failed (exit {done.returncode}); its output: {log}")
    return time.time() - t0


def rows(path):
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def project(recorded, probe, wall):
    """(projected seconds, recorded seconds, this machine's time over the recorded one's) of one stage. The probe
    replays the recorded run's first steps (same flags, seed and weights): its time on those steps over theirs
    scales the rest of the stage, whose steps grow or shrink as the policy's games do. Its first step (a warm-up
    here) is taken as measured."""
    steps = {r["step"]: r["step_time"] for r in probe if "step_time" in r}
    certs = {r["step"]: r["exploit_s"] for r in probe if "exploit_s" in r}
    rec_steps = {r["step"]: r["step_time"] for r in recorded if "step_time" in r}
    rec_certs = {r["step"]: r["exploit_s"] for r in recorded if "exploit_s" in r}
    first = min(steps)
    same = [s for s in steps if s != first and s in rec_steps] or [first]
    ratio = sum(steps[s] for s in same) / sum(rec_steps[s] for s in same)
    same_certs = [s for s in certs if s in rec_certs]
    cert_ratio = sum(certs[s] for s in same_certs) / sum(rec_certs[s] for s in same_certs) if same_certs else ratio
    overhead = wall - sum(steps.values()) - sum(certs.values())
    projected = (overhead + steps[first] + ratio * (sum(rec_steps.values()) - rec_steps.get(first, 0))
                 + cert_ratio * sum(rec_certs.values()))
    return projected, sum(rec_steps.values()) + sum(rec_certs.values()), ratio


def time_stages(bundle_dir, out, steps):
    """Every stage of a bundle here for a few steps (SFT 10x as many), the evaluations whole; the projected table
    to stdout and OUT/stage_times.md, .json."""
    os.makedirs(out, exist_ok=True)
    at = lambda *p: os.path.join(bundle_dir, *p)
    table = []

    sft_args = json.load(open(at("sft", "sft_args.json")))
    probe_steps = min(steps * 10, sft_args["max_steps"])  # SFT steps are short and vary with the games' lengths
    wall = run_script("sft.py", argv_of(sft_args, max_steps=probe_steps, save_every=probe_steps, out=os.path.join(out, "sft")),
                      os.path.join(out, "sft.log"))
    table.append(("sft", sft_args["max_steps"], 0, *project(rows(at("sft", "metrics.jsonl")),
                                                             rows(os.path.join(out, "sft", "metrics.jsonl")), wall)))
    print(f"sft: {table[-1][3]:.0f} s projected", flush=True)

    for stage, start in rl_stages(bundle_dir):
        args = json.load(open(at(stage, "rl_args.json")))
        recorded = rows(at(stage, "metrics.jsonl"))
        wall = run_script("rl.py", argv_of(args, model=at(start), steps=steps, out=os.path.join(out, stage)),
                          os.path.join(out, f"{stage}.log"))
        table.append((stage, sum("step_time" in r for r in recorded), sum("exploit_s" in r for r in recorded),
                      *project(recorded, rows(os.path.join(out, stage, "metrics.jsonl")), wall)))
        print(f"{stage}: {table[-1][3]:.0f} s projected", flush=True)

    t_eval = 0.0
    for who in sorted(os.listdir(at("eval"))):
        args = json.load(open(at("eval", who, "args.json")))
        model = at(os.path.basename(args["model"].rstrip("/")))
        t_eval += run_script("eval.py", argv_of(args, model=model if os.path.isdir(model) else args["model"], show=0,
                                                out=os.path.join(out, "eval", who)), os.path.join(out, f"eval_{who}.log"))
    table.append(("evaluation", 0, 0, t_eval, None, None))

    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU only, {os.cpu_count()} cores"
    lines = [f"Projected wall time of the run in {bundle_dir} on this machine ({device}), {steps} probe steps a stage:", "",
             "| stage | steps | certificates | projected s | recorded s (steps and certificates) | time here / recorded |",
             "|---|---|---|---|---|---|"]
    for name, n, c, projected, rec, ratio in table:
        lines.append(f"| {name} | {n} | {c} | {projected:.0f} | {'' if rec is None else f'{rec:.0f}'} | "
                     f"{'' if ratio is None else f'{ratio:.2f}'} |")
    total = sum(t[3] for t in table)
    lines += ["", f"Projected in all: {total:.0f} s ({total / 60:.1f} min)."]
    print("\n".join(lines))
    with open(os.path.join(out, "stage_times.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, "stage_times.json"), "w") as f:
        json.dump({"device": device, "probe_steps": steps, "total_s": total,
                   "stages": [dict(zip(("stage", "steps", "certificates", "projected_s", "recorded_s", "ratio"), t))
                              for t in table]}, f, indent=2)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bundle", help="copy a finished run's records and starting weights to a directory to carry")
    b.add_argument("run", help="a finished speedrun's OUT directory")
    b.add_argument("dest", help="where to write the bundle")
    t = sub.add_parser("time", help="run every stage of a bundle for a few steps here and project the whole run's time")
    t.add_argument("bundle", help="a directory written by `bundle`")
    t.add_argument("--steps", type=int, default=5, help="RL steps a stage runs here (SFT: 10x as many); 5 also replays "
                   "the recorded certificate at step 5 of a stage with --exploit 5")
    t.add_argument("--out", default="out/stage_times", help="where the probes and the table (stage_times.md/.json) go")
    args = p.parse_args()
    if args.cmd == "bundle":
        bundle(args.run, args.dest)
    else:
        time_stages(args.bundle, args.out, args.steps)


if __name__ == "__main__":
    main()
