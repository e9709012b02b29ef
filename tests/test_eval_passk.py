"""eval.py's pass@k and avg@R (pass_at_k, pass_at_ks, summarize): the unbiased estimator, not a count of the
first k samples; intervals over examples, not over rollouts; what counts as a success. Scripted players and
made-up records only: no model."""
import itertools
import json
import math
from fractions import Fraction

import pytest

from conftest import run_main

import common
import eval as eval_mod
from policies import ScriptedPolicy

# pass_at_k is 1 - a / b: a division and a subtraction, each result <= 1 and rounded by at most 2^-53
PASS_AT_K_ERR = 2 * 2**-53
# a mean of ten such numbers: their errors, plus the rounding of each of the ten sums (each <= 10, 10 * 2^-53)
# and of the division: well within 200 * 2^-53; the interval adds 1.96 * se, se's own rounding as small
MEAN_ERR = 200 * 2**-53


def records(successes):
    """Rollout records: successes[i][j] is whether the j-th rollout of example i succeeded (reward 1, else 0)."""
    return [{"index": i, "rollout": j, "reward": float(s), "rewards": {"win": float(s)},
             "metrics": {"success": float(s)}} for i, row in enumerate(successes) for j, s in enumerate(row)]


def figures(summary):
    return [k for k in summary if k.startswith(("pass@", "avg@")) and not k.endswith("_ci95")]


def test_pass_at_k_is_the_unbiased_estimator():
    # over every order of the n samples, the mean of "a success in the first k" is pass@k, the estimator's value
    for n, c, k in [(5, 2, 2), (6, 1, 3), (4, 4, 2), (4, 0, 1), (8, 3, 8), (7, 3, 4)]:
        orders = set(itertools.permutations([1] * c + [0] * (n - c)))
        exact = Fraction(sum(any(o[:k]) for o in orders), len(orders))
        assert abs(eval_mod.pass_at_k(n, c, k) - exact) <= PASS_AT_K_ERR, (n, c, k)
    # one order, the successes last: pass@2 of [0, 0, 0, 1] is 1 - C(3, 2) / C(4, 2) = 1/2, of [0, 0, 1, 1]
    # 1 - 1/6 = 5/6, where the first two samples say 0 and 0, and 1 - (1 - c/n)^2 says 7/16 and 3/4
    s = eval_mod.summarize(records([[0, 0, 0, 1], [0, 0, 1, 1]]))
    assert abs(s["pass@2"] - (1 / 2 + 5 / 6) / 2) <= MEAN_ERR
    assert s["pass@1"] == s["avg@4"] == 3 / 8 and s["pass@4"] == 1.0  # sums of quarters: exact
    assert figures(s) == ["pass@1", "pass@2", "pass@4", "avg@4"]
    # k = 1, 2, 4, ... and R itself; one rollout an example has no pass@k
    assert figures(eval_mod.summarize(records([[1, 0, 0, 1, 0, 1]]))) == ["pass@1", "pass@2", "pass@4", "pass@6",
                                                                         "avg@6"]
    assert figures(eval_mod.summarize(records([[1], [0]]))) == []


def test_the_interval_is_over_examples_not_rollouts():
    """Each of 10 examples always or never succeeds (5 of each): its R rollouts say no more than one does, so
    the interval must not narrow as R grows (counted as n·R independent draws it would, by sqrt(R)). Over the
    examples it is 0.5 ± 1.96 se, se = sd / sqrt(10) = sqrt(10 * 0.25 / 9) / sqrt(10) = 1/6."""
    want = [0.5 - 1.96 / 6, 0.5 + 1.96 / 6]  # [0.173, 0.827]; as 80 draws: 0.5 ± 0.110
    for r in (2, 8):
        s = eval_mod.summarize(records([[s] * r for s in [1] * 5 + [0] * 5]))
        assert abs(s["reward_se"] - 1 / 6) <= MEAN_ERR, r
        for key in figures(s):
            assert s[key] == 0.5 and max(abs(a - b) for a, b in zip(s[key + "_ci95"], want)) <= 2 * MEAN_ERR, (r, key)
    # every example at 1 (or 0) shows no spread, yet 3 examples say little: a mean mu makes all 3 succeed with
    # chance <= mu^3 (P(X = 1) <= E[X] for X in [0, 1]), so the interval reaches down to 0.025^(1/3) = 0.29
    edge = 0.025 ** (1 / 3)
    assert eval_mod.summarize(records([[1, 1]] * 3))["pass@1_ci95"] == [edge, 1.0]
    assert eval_mod.summarize(records([[0, 0]] * 3))["pass@2_ci95"] == [0.0, 1 - edge]


def test_success_is_the_environments_metric_else_the_best_reward(ttt_env):
    # tic-tac-toe and its lab name it: a game not lost (won or drawn); a scripted player's rollouts of one example
    # are the same game (its and the opponent's random moves are seeded by the example), so pass@2 is pass@1
    for env in (ttt_env, common.load_env("tictactoe_lab")):
        s, recs = eval_mod.evaluate(env, ScriptedPolicy(env, "random"), 20, 2, progress=False)
        assert all(m["success"] == m["win"] + m["draw"] == 1 - m["loss"] for m in (r["metrics"] for r in recs))
        assert 0 < s["success_rate"] < 1 and s["pass@1"] == s["pass@2"] == s["success_rate"]
    # no success metric (add): a reward reaching the environment's best_reward, 1 by default
    add = common.load_env("add")
    oracle = ScriptedPolicy(add, "oracle")  # right and well-formed: reward 1 + 0.2
    assert eval_mod.evaluate(add, oracle, 4, 2, progress=False)[0]["pass@2"] == 1.0
    add.best_reward = 1.5
    assert eval_mod.evaluate(add, oracle, 4, 2, progress=False)[0]["pass@2"] == 0.0


def test_eval_cli_reports_pass_at_k(tmp_path):
    """eval.py -r 3: pass@1, 2, 3 and avg@3 with their intervals, printed and in summary.json."""
    printed = run_main("eval", ["--model", "random", "--setting", "optimal", "-n", "20", "-r", "3", "--show", "0",
                                "--out", str(tmp_path)])
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["n"] == 60 and figures(s) == ["pass@1", "pass@2", "pass@3", "avg@3"]
    for key in figures(s):
        low, high = s[key + "_ci95"]
        assert 0 <= low <= s[key] <= high <= 1
        assert f"{key:<18} {s[key]:.1%} (95% CI {low:.1%} to {high:.1%})" in printed
    assert math.isclose(s["pass@1"], 1 - s["loss_rate"], abs_tol=MEAN_ERR)
