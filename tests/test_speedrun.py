"""The shortened speedruns (QUICK=1): the whole pipeline scratch -> SFT -> RL -> eval + certificate -> report, of
speedrun.sh (the minimax teacher) and speedrun_random_teacher.sh (a random teacher, its puzzle stages); and the scripts
themselves: short, straight-line shell, no inline Python."""
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# the flagship recipe (speedrun.sh), and the random teacher's puzzle recipe (speedrun_random_teacher.sh, on tictactoe_lab;
# `rules` and `rules_then` share its script; their scripted players are tested in test_env_tictactoe_lab, its checks'
# exit statuses too)
TEACHERS = ["minimax", "rules_wins"]
SCRIPT = {"minimax": "speedrun.sh", "rules_wins": "speedrun_random_teacher.sh"}


@pytest.fixture(scope="module")
def speedruns(tmp_path_factory):
    """The quick speedruns at once, one thread each (each is mostly one process at a time: run one after another,
    they would leave a core idle): {teacher: (OUT, RL_FLAGS, return code, stdout + stderr)}."""
    started = {}
    for teacher in TEACHERS:
        out = str(tmp_path_factory.mktemp(teacher) / "run")
        # RL_FLAGS: extra rl.py flags, which win over the recipe's (the rules_wins run passes one, and a third and fourth stage)
        rl_flags = "--loss_agg sequence" if teacher == "rules_wins" else ""
        env = {**os.environ, "QUICK": "1", "OUT": out, "OMP_NUM_THREADS": "1", "TEACHER": teacher, "RL_FLAGS": rl_flags,
               "POLISH_STEPS": "2" if teacher == "rules_wins" else "0",
               # and a fourth stage, which runs where the third's best certificate loses a line (this tiny model's does)
               "WINS_STEPS": "2" if teacher == "rules_wins" else "0",
               # a block stage that goes on until its solver reward averages 0.99: this tiny model's never does, so
               # it runs its 2 quick steps, then is resumed to the quick maximum, 4
               "PUZZLE_UNTIL": "0.99" if teacher == "rules_wins" else "0"}
        # a session of its own, so that a run past its time is stopped with its python children, which hold the pipe
        started[teacher] = out, rl_flags, subprocess.Popen(["bash", SCRIPT[teacher]], cwd=ROOT, stdout=subprocess.PIPE,
                                                           stderr=subprocess.STDOUT, text=True, env=env,
                                                           start_new_session=True)
    finished = {}
    for teacher, (out, rl_flags, proc) in started.items():
        try:
            output, _ = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        finished[teacher] = out, rl_flags, proc.returncode, output
    return finished


def report_main(*argv):
    """scripts/speedrun_report.py ARGV in this process (as the speedrun runs it, less an interpreter's start)."""
    import contextlib
    import io
    import runpy
    saved = sys.argv
    sys.argv = ["scripts/speedrun_report.py", *argv]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(os.path.join(ROOT, "scripts", "speedrun_report.py"), run_name="__main__")
    finally:
        sys.argv = saved


@pytest.mark.parametrize("teacher", TEACHERS)
def test_quick_speedrun(speedruns, teacher):
    out, rl_flags, returncode, output = speedruns[teacher]
    assert returncode == 0, output[-6000:]
    results = json.load(open(os.path.join(out, "results.json")))
    for who in ("teacher", "sft", "rl"):
        for opp in ("optimal", "random"):
            s = results[who][opp]
            assert s["n"] == 4 and abs(s["win_rate"] + s["draw_rate"] + s["loss_rate"] - 1) < 1e-9
        cert = results[who]["certificate"]
        assert cert["lines"] == cert["lines_won"] + cert["lines_drawn"] + cert["lines_lost"] > 0
        assert abs(cert["random_win_rate"] + cert["random_draw_rate"] + cert["random_loss_rate"] - 1) < 1e-9
    assert results["teacher"]["certificate"]["lines_lost"] > 0  # the imperfect teacher loses some line
    report = open(os.path.join(out, "report.md")).read()
    assert ("| RL model (fourth stage step " if teacher == "rules_wins" else "| RL model (step ") in report and "Certificate" in report and "| mistaken decisions |" in report
    rl_cert = results["rl"]["certificate"]
    assert f"| {rl_cert['random_win_rate']:.1%} / {rl_cert['random_loss_rate']:.1%} |" in report
    curves_line = next(line for line in report.splitlines() if line.startswith("Training curves:"))
    # one figure of every RL stage, named only where drawn (matplotlib is optional); every stage's metrics named
    assert (f"{out}/curves.png" in curves_line) == os.path.exists(os.path.join(out, "curves.png"))
    assert os.path.exists(os.path.join(out, "curves.png")) == (importlib.util.find_spec("matplotlib") is not None)
    for stage in ("rl_puzzles", "rl", "rl_polish", "rl_wins"):
        assert (f"{out}/{stage}/metrics.jsonl" in curves_line) == os.path.exists(os.path.join(out, stage, "metrics.jsonl"))
    keep = "format=1,loss=0" if teacher == "minimax" else "all"  # the report's commands are the ones the run ran
    assert "--exploit -n 4 --temp 0 --max_new_tokens 24 --env_args" in report
    assert f" --teacher {teacher} " in report and f" --keep {keep} --seed 0 " in report
    # every stage's command on the recipe's environment: the game (speedrun.sh), or tictactoe_lab, the game with the
    # research options (speedrun_random_teacher.sh); the report names it where it is not the default
    on_lab = teacher == "rules_wins"
    commands = [line for line in report.split("## Commands")[1].splitlines() if line.startswith("    python ")]
    assert len(commands) == 3 + 3 * on_lab  # SFT, the RL stages (a block stage, a third and a fourth), the evaluation
    assert [line.split()[1] for line in commands] == ["sft.py", *["rl.py"] * (len(commands) - 2), "eval.py"]
    assert all((" --env tictactoe_lab " in line) == (" --env " in line) == on_lab for line in commands)
    assert commands[0].startswith("    python sft.py --model scratch" + " --env tictactoe_lab" * on_lab + f" --teacher {teacher} ")
    for stage in ("sft", "rl") if teacher == "minimax" else ("sft", "rl_puzzles", "rl", "rl_polish", "rl_wins"):
        args_file = os.path.join(out, stage, "sft_args.json" if stage == "sft" else "rl_args.json")
        assert json.load(open(args_file))["env"] == ("tictactoe_lab" if on_lab else "tictactoe")
    replies = [m["content"] for line in open(os.path.join(out, "sft", "data.jsonl"))
               for m in json.loads(line)["messages"] if m["role"] == "assistant"]
    if teacher == "rules_wins":  # random moves, the think stating the wins, every game kept; games from random-X
        # openings; RL first on block and opening puzzles, then on games and threat and opening puzzles, each stage's
        # command in the report
        assert "| teacher (rules_wins: a random legal move, no strategy) |" in report
        assert all(r.startswith("<think>Wins: me ") and "threat" not in r for r in replies)
        assert sum(1 for _ in open(os.path.join(out, "sft", "teacher_games.jsonl"))) == len(open(os.path.join(out, "sft", "data.jsonl")).readlines())
        assert "moves so far" in open(os.path.join(out, "sft", "data.jsonl")).read()
        puzzle_args = json.load(open(os.path.join(out, "rl_puzzles", "rl_args.json")))
        assert json.loads(puzzle_args["env_args"])["puzzles"] == 1.0 and puzzle_args["steps"] == 4 and puzzle_args["exploit"] == 0
        assert "the block stage at step 2: solver reward " in output and "the block stage at step 4" not in output
        assert [json.loads(line)["step"] for line in open(os.path.join(out, "rl_puzzles", "metrics.jsonl"))
                if "reward_optimal" in line] == [1, 2, 3, 4]  # resumed where it stopped
        assert json.loads(puzzle_args["env_args"])["puzzle_kind"] == ["block", "block", "opening"]
        assert json.loads(json.load(open(os.path.join(out, "rl", "rl_args.json")))["env_args"])["puzzle_kind"] == ["threat", "opening"]
        assert f"python rl.py --model {out}/sft " in report and f"--out {out}/rl_puzzles" in report
        assert report.split(f"--out {out}/rl_puzzles")[0].splitlines()[-1].count("--steps 4 ") == 1
        assert f"python rl.py --model {out}/rl_puzzles " in report
    else:
        assert any("threatens" in r for r in replies)
    assert os.path.exists(os.path.join(out, "rl", "model.safetensors"))
    loss_agg = json.load(open(os.path.join(out, "rl", "rl_args.json")))["loss_agg"]
    assert loss_agg == ("sequence" if rl_flags else "token") and (rl_flags in report.split("python rl.py")[-1].splitlines()[0])
    if teacher == "rules_wins":  # the second stage without the exploiter; the third (POLISH_STEPS) with it, exploring;
        # the fourth (WINS_STEPS) the third again from its best weights, win puzzles among its puzzles
        assert not os.path.exists(os.path.join(out, "rl_best"))
        polish = json.load(open(os.path.join(out, "rl_polish", "rl_args.json")))
        assert polish["model"] == os.path.join(out, "rl") and polish["exploit"] == 5 and polish["steps"] == 2
        assert json.loads(polish["env_args"])["replay_explore"] == "rules_wins" and json.loads(polish["env_args"])["exploit_stop"] is True
        assert "the third stage's best certificate: " in output
        wins = json.load(open(os.path.join(out, "rl_wins", "rl_args.json")))
        assert wins["model"] == os.path.join(out, "rl_polish_best") and wins["exploit"] == 5 and wins["steps"] == 2
        assert json.loads(wins["env_args"]) == {**json.loads(polish["env_args"]), "puzzle_kind": ["threat", "win", "opening"]}
        best = json.load(open(os.path.join(out, "rl_wins_best", "exploit.json")))
        assert results["rl_step"] == best["step"] in (0, 2) and results["rl"]["certificate"]["lines_lost"] == best["lines_lost"]
        assert json.load(open(os.path.join(out, "eval", "rl", "optimal", "args.json")))["model"] == os.path.join(out, "rl_wins_best")
        assert f"python rl.py --model {out}/rl " in report and f"--out {out}/rl_polish" in report
        assert f"python rl.py --model {out}/rl_polish_best " in report and f"--out {out}/rl_wins" in report
        return
    # the RL model evaluated is the exploiter's best certificate (2 RL steps, --exploit 5: certificates at steps 0 and 2)
    best = json.load(open(os.path.join(out, "rl_best", "exploit.json")))
    assert results["rl_step"] == best["step"] in (0, 2)
    assert results["rl"]["certificate"]["lines_lost"] == best["lines_lost"]
    # a resumed run's report (speedrun.sh RESUME=1 passes --resumed) says its times leave out the earlier invocations
    assert "Wall time: SFT " in report and results["times_s"]["resumed"] is False
    report_main(out, "--times", "1", "2", "3", "--resumed")
    assert "Wall time of this resumed invocation alone (RESUME=1; earlier ones not counted): SFT 1s" in open(os.path.join(out, "report.md")).read()
    assert json.load(open(os.path.join(out, "results.json")))["times_s"] == {"sft": 1, "rl": 2, "total": 3, "resumed": True}


@pytest.mark.parametrize("script, setting, value, says", [
    ("speedrun.sh", "TEACHER", "rules_wins", "speedrun.sh runs the minimax teacher; use speedrun_random_teacher.sh"),
    ("speedrun_random_teacher.sh", "TEACHER", "minimax", "use rules, rules_wins or rules_then (the minimax teacher: speedrun.sh)"),
    ("speedrun_random_teacher.sh", "SHOW_WINS", "yes", "use true or false"),
    # TEACHER=rules has no puzzles and no third stage is asked for
    ("speedrun_random_teacher.sh", "WINS_STEPS", "2", "the fourth stage needs a third (POLISH_STEPS > 0)")])
def test_a_bad_setting_stops_the_speedrun_before_any_stage(tmp_path, script, setting, value, says):
    out = tmp_path / "run"
    env = {**os.environ, "QUICK": "1", "OUT": str(out), "TEACHER": "rules", setting: value}
    if script == "speedrun.sh" and setting != "TEACHER":
        del env["TEACHER"]
    proc = subprocess.run(["bash", script], cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2 and f"{setting}={value}: {says}" in proc.stderr and not out.exists()
    assert len(proc.stderr.strip().splitlines()) == 1  # one clear line


@pytest.mark.parametrize("script", ["speedrun.sh", "speedrun_random_teacher.sh"])
def test_the_speedrun_scripts_are_short_straight_shell(script):
    """speedrun.sh reads like a recipe: at most 100 lines; neither script hides Python in the shell (`python -c`, a
    heredoc fed to python) or edits JSON by pattern substitution: every command it runs is a script of the project."""
    text = open(os.path.join(ROOT, script)).read()
    if script == "speedrun.sh":
        assert len(text.splitlines()) <= 100
    code = [line.split("#")[0] for line in text.splitlines()]  # the commands, the comments left out
    assert not any(re.search(r"python3?\s+-c\b|python3?\s+-\s*<<|python3?\s+<<", line) for line in code)
    assert not any("<<" in line for line in code)  # no heredoc at all
    assert not any(re.search(r"\$\{\w+(%|/)", line) for line in code)  # no ${VAR%...} / ${VAR/.../...} on the JSON
    ran = {m.group(1) for line in code for m in re.finditer(r"\bpython3?\s+(\S+)", line)}
    assert ran and all(os.path.exists(os.path.join(ROOT, f)) for f in ran), ran
