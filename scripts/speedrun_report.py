"""
The speedrun's report: OUT/results.json, OUT/report.md and OUT/curves.png (where matplotlib is
installed) from the evaluations a speedrun script left in OUT/eval/{teacher,sft,rl}/{optimal,random,
exploit}, loading no model. speedrun.sh and speedrun_random_teacher.sh run it as their last stage:

    python scripts/speedrun_report.py out/speedrun --times 600 250 926 --teacher minimax \\
        --sft_args "..." --rl_args "..." --env_args '{"show_cells": true}'

It sits apart from the project's scripts (it is the speedrun's, as speedrun.sh is), one level down.
"""
import argparse
import json
import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rl_stages(rl_args, puzzle_args="", polish_args="", wins_args=""):
    """The RL stages the run had, in order: (directory, the model it starts from, its flags, its
    name); the last gives the RL model (its best certificate's weights, and their step)."""
    return [stage for stage in (("rl_puzzles", "sft", puzzle_args, "puzzle stage "),
                                ("rl", "rl_puzzles" if puzzle_args else "sft", rl_args, ""),
                                ("rl_polish", "rl", polish_args, "third stage "),
                                ("rl_wins", "rl_polish_best", wins_args, "fourth stage "))
            if stage[0] == "rl" or stage[2]]


def gather_results(out, times, resumed, stages):
    """results.json: each model's greedy games and certificate from OUT/eval, the wall times, the
    machine, and the step of the last stage's best certificate (rl_step, None without one)."""
    import torch
    t_sft, t_rl, t_all = times or (None, None, None)
    load = lambda who, task: json.load(open(os.path.join(out, "eval", who, task, "summary.json")))
    res = {w: {"optimal": load(w, "optimal"), "random": load(w, "random"),
               "certificate": load(w, "exploit")} for w in ("teacher", "sft", "rl")}
    # a resumed speedrun (RESUME=1) times only its own invocation: earlier stages count ~0
    res["times_s"] = ({"sft": int(t_sft), "rl": int(t_rl), "total": int(t_all), "resumed": resumed}
                      if times else None)
    res["machine"] = f"{platform.machine()}, {os.cpu_count()} cores" + (
        f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", CPU only")
    best = os.path.join(out, stages[-1][0] + "_best", "exploit.json")
    res["rl_step"] = json.load(open(best))["step"] if os.path.exists(best) else None
    return res


def play_table(res, name):
    """The greedy games' rows: each model against each opponent."""
    rows = ["| model | opponent | win | draw | loss | format | games with invalid move |",
            "|---|---|---|---|---|---|---|"]
    for w in ("teacher", "sft", "rl"):
        for o in ("random", "optimal"):
            s = res[w][o]
            rows.append(f"| {name[w]} | {o} | {s['win_rate']:.1%} | {s['draw_rate']:.1%} | "
                        f"{s['loss_rate']:.1%} | {s['format_rate']:.1%} | "
                        f"{s['invalid_rate']:.1%} |")
    return rows


def certificate_table(res, name):
    """The certificates' rows: lines, decisions by what their position demands, the exact results
    against a random opponent."""
    cert = ["| model | lines | won | drawn | lost | mistaken decisions | optimal moves | "
            "wins taken | threats blocked | other moves optimal | true `Wins:` checks | "
            "own wins stated | random opponent, exact: win / loss |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in ("teacher", "sft", "rl"):
        c = res[w]["certificate"]
        cert.append(f"| {name[w]} | {c['lines']} | {c['lines_won']} | {c['lines_drawn']} | "
                    f"{c['lines_lost']} | {c['mistakes']} of {c['decisions']} | "
                    f"{c['optimal_move_rate']:.1%} | {c['wins_taken']} of {c['win_positions']} | "
                    f"{c['threats_blocked']} of {c['block_positions']} | "
                    f"{c['quiet_optimal']} of {c['quiet_positions']} | "
                    f"{c['checks_true']} of {c['decisions']} | "
                    f"{c['wins_stated']} of {c['win_positions']} | "
                    f"{c['random_win_rate']:.1%} / {c['random_loss_rate']:.1%} |")
    return cert


def rl_mistakes(out):
    """Where the RL model still errs: the sentence saying how often, and the first 20 positions of
    its certificate (board row by row, X = the model), each with its reply."""
    errs = json.load(open(os.path.join(out, "eval", "rl", "exploit",
                                       "certificate.json")))["mistake_positions"]
    shown = [f"- {m['kind']}: {m['board'][:3]}/{m['board'][3:6]}/{m['board'][6:]}, it replied "
             f"`{' '.join(m['reply'].split())}`" for m in errs[:20]]
    errors = (f"The RL model's mistaken decisions: {len(errs)} (the first {len(shown)} below; "
              f"all in {out}/eval/rl/exploit/certificate.json)" if errs else
              "The RL model makes no mistaken decision: each of its moves on every line is "
              "minimax-optimal.")
    return errors, shown


def write_report(out, times, teacher, teacher_p, sft_args, rl_args, env_args, puzzle_args="",
                 polish_args="", wins_args="", resumed=False, env="tictactoe"):
    """OUT/results.json, OUT/report.md and OUT/curves.png from the evaluations a speedrun script
    wrote to OUT/eval/{teacher,sft,rl}/{optimal,random,exploit}; times = (SFT, RL, total) seconds
    or None; the SFT teacher (minimax with random-move probability teacher_p, or a rules teacher),
    the other arguments and env (the commands' --env, where not tictactoe) name the run's recipe."""
    from env_tictactoe import CURVE_PANELS
    from eval import plot_curves
    stages = rl_stages(rl_args, puzzle_args, polish_args, wins_args)
    res = gather_results(out, times, resumed, stages)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(res, f, indent=2)
    max_new = json.load(open(os.path.join(out, "eval", "rl", "optimal",
                                          "args.json")))["max_new_tokens"]
    name = {"teacher": f"teacher (minimax, random moves p={teacher_p})" if teacher == "minimax" else
                       f"teacher ({teacher}: a random legal move, no strategy)", "sft": "SFT model",
            "rl": "RL model" + (f" ({stages[-1][3]}step {res['rl_step']}: the best certificate)"
                                if res["rl_step"] is not None else "")}
    errors, shown = rl_mistakes(out)
    n, nl = res["rl"]["optimal"]["n"], "\n"
    env_flag = "" if env == "tictactoe" else f" --env {env}"  # the environment its commands ran
    drawn = plot_curves([(d, os.path.join(out, d, "metrics.jsonl")) for d, *_ in stages],
                        os.path.join(out, "curves.png"), CURVE_PANELS)
    metrics = ", ".join(f"{out}/{d}/metrics.jsonl" for d, *_ in stages)
    rl_commands = "".join(f"    python rl.py --model {out}/{start}{env_flag} {args} "
                          f"--out {out}/{d}{nl}" for d, start, args, _ in stages)
    t_sft, t_rl, t_all = times or (None, None, None)
    alone = (" of this resumed invocation alone (RESUME=1; earlier ones not counted)"
             if resumed else "")
    wall = (f"Wall time{alone}: SFT {t_sft}s, RL {t_rl}s, total with evaluation {t_all}s"
            if times else "Wall time: not given (--times)")
    curves = (f"{out}/curves.png (the RL stages one after another)" if drawn
              else "none drawn (matplotlib is not installed)")
    # the report's text; a backslash at a line's end joins the next source line to it
    report = f"""# speedrun report

Machine: {res['machine']}. {wall}.

## Greedy play, {n} games per opponent
{nl.join(play_table(res, name))}

## Certificate: the greedy policy against every opponent line (moving first and second)
{nl.join(certificate_table(res, name))}

Each decision by what its position demands: a win to take (the model can complete a line at \
once), else a threat to
block (the opponent could), else another move, optimal by minimax (where forks are made or \
stopped). A true check:
the reply's <think> opens with `Wins: me A, opponent B.` and it is right (and its `Then: me C.`, \
where written);
own wins stated: at the positions with a win to take, the check's `me` part names exactly those \
cells. Random
opponent, exact: the greedy policy's results against a uniformly random opponent, every line \
weighted by its
probability (the games above sample them, 200 to about 2 points).

{errors}
{nl.join(shown)}

## Commands
    python sft.py --model scratch{env_flag} --teacher {teacher} {sft_args} --out {out}/sft
{rl_commands}    python eval.py --model MODEL{env_flag} --setting optimal random --exploit \
-n {n} --temp 0 --max_new_tokens {max_new} --env_args '{env_args}' --out {out}/eval/WHO

Training curves: {curves}; the metrics: {metrics}
"""
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(report)
    print(report)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    add = p.add_argument
    add("out", metavar="OUT", help="the speedrun's directory (its OUT), holding OUT/eval")
    add("--times", type=int, nargs=3, default=None, metavar=("SFT", "RL", "TOTAL"),
        help="wall times in seconds")
    add("--resumed", action="store_true",
        help="--times are those of a resumed run's last invocation alone (RESUME=1)")
    add("--teacher", default="minimax", help="the SFT teacher: minimax with --teacher_random_prob "
        "(speedrun.sh), or a teacher of random legal moves, tictactoe_lab's rules, rules_wins or "
        "rules_then (speedrun_random_teacher.sh TEACHER)")
    add("--teacher_random_prob", type=float, default=0.2,
        help="the minimax teacher's player_random_prob (its --env_args)")
    add("--sft_args", default="", help="the flags the run gave sft.py")
    add("--rl_args", default="", help="the flags the run gave rl.py (its main RL stage)")
    add("--puzzle_args", default="",
        help="the flags of an RL stage on puzzles before it, if any (PUZZLE_STEPS)")
    add("--polish_args", default="",
        help="the flags of an RL stage after it, if any (POLISH_STEPS)")
    add("--wins_args", default="",
        help="the flags of a fourth RL stage from the third's best weights, if any (WINS_STEPS)")
    add("--env", default="tictactoe", help="the environment the run's commands named (--env)")
    add("--env_args", default="{}", help="the evaluation's --env_args")
    args = p.parse_args()
    sys.path.insert(0, ROOT)  # run from scripts/: the project's modules are one level up
    write_report(args.out, args.times, args.teacher, args.teacher_random_prob, args.sft_args,
                 args.rl_args, args.env_args, args.puzzle_args, args.polish_args, args.wins_args,
                 args.resumed, args.env)


if __name__ == "__main__":
    main()
