"""docs/stage_times.py: a recorded speedrun's flags given back to its scripts, its stages found in order, and the
projection of a stage's time from a probe of its first steps."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "docs"))

import stage_times  # noqa: E402
import rl  # noqa: E402


def test_recorded_arguments_give_the_same_arguments_back():
    """A stage's rl_args.json (vars(args)) turned back into flags parses to the same arguments: lists, flags that
    take no value, None and JSON strings included; --resume is left out (a probe starts fresh)."""
    argv = ["--model", "out/x/sft", "--env_args", '{"show_cells": true, "puzzle_kind": ["block", "opening"]}',
            "--batch", "384", "--steps", "60", "--lr", "2e-4", "--eps_high", "0.28", "--exploit", "5", "--resume",
            "--out", "out/x/rl_puzzles"]
    recorded = json.loads(json.dumps(vars(rl.parse_args(argv))))  # as rl.py writes it
    assert recorded["report_to"] == "none" and recorded["resume"] is True
    again = vars(rl.parse_args(stage_times.argv_of(recorded, steps=5)))
    assert again == {**recorded, "steps": 5, "resume": False}
    # eval.py's one-letter flag, its list of settings and its --exploit
    assert stage_times.argv_of({"n": 200, "setting": ["optimal", "random"], "exploit": True, "report": None}) == \
        ["-n", "200", "--setting", "optimal", "random", "--exploit"]


def test_rl_stages_are_found_in_the_order_they_ran(tmp_path):
    """Each stage starts from the one before it or from its _best weights; the first from sft."""
    chain = {"rl_puzzles": "sft", "rl": "rl_puzzles", "rl_polish": "rl", "rl_wins": "rl_polish_best"}
    for stage, start in chain.items():
        os.makedirs(tmp_path / stage)
        (tmp_path / stage / "rl_args.json").write_text(json.dumps({"model": f"out/run/{start}"}))
    os.makedirs(tmp_path / "eval")
    assert stage_times.rl_stages(str(tmp_path)) == list(chain.items())


def test_a_stage_is_projected_from_its_time_on_the_same_steps():
    """The probe replays the recorded run's first steps: its time over theirs (its warm-up step aside) scales the
    rest of the recorded stage, and the certificates by their own ratio; its time outside steps and certificates
    is added as measured."""
    recorded = [{"step": s, "step_time": 10.0 + s} for s in range(20)]  # the steps grow as the stage goes on
    recorded += [{"step": s, "exploit_s": 30.0} for s in (0, 5, 10, 15, 20)]
    probe = [{"step": 0, "step_time": 60.0}] + [{"step": s, "step_time": 0.5 * (10.0 + s)} for s in range(1, 5)]
    probe += [{"step": s, "exploit_s": 3.0} for s in (0, 5)]
    wall = 7.0 + sum(r.get("step_time", 0) + r.get("exploit_s", 0) for r in probe)
    projected, recorded_s, ratio = stage_times.project(recorded, probe, wall)
    assert ratio == pytest.approx(0.5)
    rest = sum(10.0 + s for s in range(1, 20))
    assert projected == pytest.approx(7.0 + 60.0 + 0.5 * rest + 0.1 * 5 * 30.0)
    assert recorded_s == pytest.approx(sum(10.0 + s for s in range(20)) + 5 * 30.0)
