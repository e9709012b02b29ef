"""Tests for env_reasoning_gym: oracle and blank on exact tasks and a mix, rows that do not repeat across steps and
stay JSON-clean, the refused tasks (broken, unsafe, unreproducible scorers), scorers that raise or would run the
answer as code, quiet stdout, bad env_args, and a two-step rl.py run evaluated by eval.py."""
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT

pytest.importorskip("reasoning_gym")
import env_reasoning_gym as rgenv  # noqa: E402
import reasoning_gym  # noqa: E402

EXACT = ["leg_counting", "basic_arithmetic", "chain_sum", "gcd", "spell_backward", "letter_counting"]
MIX = {"tasks": {"leg_counting": 1, "basic_arithmetic": 2},
       "config": {"leg_counting": {"max_animals": 4}, "basic_arithmetic": {"max_terms": 3, "max_digits": 2}}}
_ENVS = {}


def env_of(**kw):
    key = json.dumps(kw, sort_keys=True)
    if key not in _ENVS:
        _ENVS[key] = rgenv.ReasoningGym(**kw)
    return _ENVS[key]


def total(env, rewards):
    return sum(env.reward_weights[k] * v for k, v in rewards.items())


def play(env, row, reply):
    state, question = env.reset(row)
    assert isinstance(question, str) and question
    assert env.step(state, reply) is None and state["done"]
    rewards, metrics = env.rewards(state), env.metrics(state)
    assert set(rewards) == {"score", "format"} and set(metrics) == {"solved", "format", "score"}
    assert all(0.0 <= v <= 1.0 for v in [*rewards.values(), *metrics.values()]), (rewards, metrics)
    return state, rewards, metrics


# ----------------------------------------------------------------------------- oracle and blank


@pytest.mark.parametrize("env_args", [{"task": t} for t in EXACT] + [MIX], ids=EXACT + ["mix"])
def test_oracle_solves_and_blank_scores_zero(env_args):
    env = env_of(**env_args)
    oracle, blank = env.scripted_player("oracle"), env.scripted_player("blank")
    for row in env.examples(8, seed=3):
        state, rewards, metrics = play(env, row, oracle(env.reset(row)[0]))
        assert rewards == {"score": 1.0, "format": 1.0} and metrics["solved"] == 1.0, env.describe(state)
        assert total(env, rewards) == pytest.approx(1.0)
        state, rewards, metrics = play(env, row, blank(env.reset(row)[0]))
        assert rewards == {"score": 0.0, "format": 0.0} and metrics["solved"] == 0.0
        assert total(env, rewards) == 0.0
    assert "reference: " in env.describe(state)
    with pytest.raises(ValueError, match="oracle"):
        env.scripted_player("minimax")


def test_partial_credit_is_not_solved():
    """The library's default scorer gives an answer that contains the reference partial credit: `score` keeps it,
    `solved` does not; a malformed right answer keeps its score, loses the format reward."""
    env = env_of(task="leg_counting")
    row = env.examples(1, seed=0)[0]
    ref = env.reset(row)[0]["reference"]
    _, rewards, metrics = play(env, row, f"<answer>{ref} legs</answer>")
    assert 0.0 < rewards["score"] < 1.0 and metrics["solved"] == 0.0 and rewards["format"] == 1.0
    _, rewards, metrics = play(env, row, f"The total is <answer>{ref}</answer>")
    assert rewards == {"score": 1.0, "format": 0.0} and metrics["solved"] == 1.0
    _, rewards, _ = play(env, row, f"<think>counting legs</think>\n<answer> {ref} </answer>\n")
    assert rewards == {"score": 1.0, "format": 1.0}
    _, rewards, _ = play(env, row, f"<answer>{ref}</answer> done")
    assert rewards == {"score": 1.0, "format": 0.0}
    _, rewards, _ = play(env, row, f"<answer>0</answer><answer>{ref}</answer>")  # the last answer counts
    assert rewards == {"score": 1.0, "format": 0.0}


# ----------------------------------------------------------------------------- rows


def test_consecutive_steps_share_no_question():
    """rl.py draws step s's examples with seed*1_000_003 + s. The library's entry i is Random(dataset_seed + i): two
    consecutive dataset seeds over range(n) would share n - 1 entries; our rows share none."""
    naive = [reasoning_gym.create_dataset("leg_counting", seed=s) for s in (100, 101)]
    assert len({naive[0][i]["question"] for i in range(32)} & {naive[1][i]["question"] for i in range(32)}) == 31
    for task in ("leg_counting", "gsm_symbolic"):  # gsm_symbolic: a BOUNDED task (indices within its size)
        env = env_of(task=task)
        for seed in (0, 1):
            steps = [env.examples(32, seed=seed * 1_000_003 + step) for step in (5, 6)]
            questions = [{env.entry(r)["question"] for r in rows} for rows in steps]
            assert len(questions[0]) == len(questions[1]) == 32, task
            assert not questions[0] & questions[1], task


@pytest.mark.parametrize("task", ["leg_counting", "rearc", "maze", "countdown", "acre"])
def test_rows_are_deterministic_json_clean_and_regenerate(task):
    env = env_of(task=task)
    rows = env.examples(4, seed=7)
    assert rows == env.examples(4, seed=7) and rows != env.examples(4, seed=8)
    assert json.loads(json.dumps(rows)) == rows
    assert all(set(r) == {"seed", "task", "dataset_seed", "index", "config"} and isinstance(r["seed"], int) for r in rows)
    assert len({r["seed"] for r in rows}) == 4
    fresh = rgenv.ReasoningGym(task=task)  # another environment regenerates the same entries from the rows
    for row in json.loads(json.dumps(rows)):
        assert fresh.reset(row)[1] == env.reset(row)[1]


def test_library_metadata_is_not_json_clean():
    """Why rows keep only what regenerates the entry: the library's metadata holds tuples (lost in a JSON round trip)."""
    entry = reasoning_gym.create_dataset("leg_counting", seed=0)[0]
    assert json.loads(json.dumps(entry["metadata"])) != entry["metadata"]


def test_mix_weights_and_per_task_config():
    env = env_of(**MIX)
    rows = env.examples(300, seed=1)
    share = sum(r["task"] == "basic_arithmetic" for r in rows) / len(rows)
    assert 0.58 < share < 0.75, share
    for row in rows[:40]:
        entry = env.entry(row)
        if row["task"] == "leg_counting":
            assert row["config"] == {"max_animals": 4} and entry["metadata"]["num_animals"] <= 4
        else:
            assert row["config"] == {"max_terms": 3, "max_digits": 2} and entry["metadata"]["num_terms"] <= 3


def test_config_seed_moves_the_data():
    a = {env_of(task="leg_counting").entry(r)["question"] for r in env_of(task="leg_counting").examples(5, seed=0)}
    env = env_of(task="leg_counting", config={"seed": 1})
    assert not a & {env.entry(r)["question"] for r in env.examples(5, seed=0)}


# ----------------------------------------------------------------------------- refused tasks


@pytest.mark.parametrize("task,junk", [("game_of_life_halting", "x"), ("coin_flip", "0")])
def test_broken_scorers_are_refused_unless_allowed(task, junk):
    with pytest.raises(ValueError, match=f"task '{task}' has a broken scorer.*allow_broken_scorer"):
        rgenv.ReasoningGym(task=task)
    env = rgenv.ReasoningGym(task=task, allow_broken_scorer=True)
    assert task in env.broken
    solved = [play(env, row, f"<answer>{junk}</answer>")[2]["solved"] for row in env.examples(6, seed=0)]
    assert sum(solved) >= 2  # junk solves


def test_the_probe_catches_an_unlisted_broken_scorer(monkeypatch):
    """Beyond the listed tasks, the probe at load refuses any task (and config) whose scorer gives junk full marks."""
    monkeypatch.setattr(rgenv, "BROKEN_SCORERS", {})
    with pytest.raises(ValueError, match="coin_flip' has a broken scorer: the junk answer '0' gets full marks"):
        rgenv.ReasoningGym(task="coin_flip")
    dataset_cls = type(reasoning_gym.create_dataset("leg_counting", seed=0))
    monkeypatch.setattr(dataset_cls, "score_answer", lambda self, answer, entry: 1.0)
    with pytest.raises(ValueError, match="leg_counting' has a broken scorer: the junk answer 'x' gets full marks on 6 of 6"):
        rgenv.ReasoningGym(task="leg_counting")


@pytest.mark.parametrize("env_args,flag", [({"task": "simple_integration"}, "allow_unsafe_scorer"),
                                           ({"tasks": {"leg_counting": 1, "isomorphic_strings": 1}}, "allow_unreproducible"),
                                           ({"task": "codeio"}, "allow_unreproducible")])
def test_unsafe_and_unreproducible_tasks_are_refused_unless_allowed(env_args, flag):
    with pytest.raises(ValueError, match=flag):
        rgenv.ReasoningGym(**env_args)
    assert rgenv.ReasoningGym(**env_args, **{flag: True}).names


def test_unreproducible_list_matches_two_processes():
    """The scan's method, on three tasks: the same rows in two processes with different PYTHONHASHSEED."""
    script = ("import json, sys; sys.path.insert(0, sys.argv[1]); import env_reasoning_gym as m\n"
              "env = m.ReasoningGym(tasks={'leg_counting': 1, 'basic_arithmetic': 1, 'ransom_note': 1}, "
              "allow_unreproducible=True)\n"
              "print(json.dumps({r['task'] + str(i): env.entry(r)['question'] for i, r in enumerate(env.examples(12, 0))}))")
    outs = [json.loads(subprocess.run([sys.executable, "-c", script, str(ROOT)], capture_output=True, text=True, check=True,
                                      env={**os.environ, "PYTHONHASHSEED": h}).stdout) for h in ("1", "2")]
    differs = {k.rstrip("0123456789") for k in outs[0] if outs[0][k] != outs[1][k]}
    assert differs == {"ransom_note"} and "ransom_note" in rgenv.UNREPRODUCIBLE


# ----------------------------------------------------------------------------- untrusted replies


def test_a_raising_scorer_scores_zero():
    env = env_of(task="prime_factorization")
    row = env.examples(1, seed=0)[0]
    state, _ = env.reset(row)
    dataset = reasoning_gym.create_dataset("prime_factorization", seed=0)
    with pytest.raises(Exception):
        dataset.score_answer("x", state["entry"])  # the library raises on this junk ...
    assert play(env, row, "<answer>x</answer>")[1]["score"] == 0.0  # ... here it scores 0


def test_answers_are_never_run_as_code():
    """string_insertion's scorer evals the answer (eval is ast.literal_eval there now); countdown's parses it with
    sympy (only plain arithmetic reaches it); a power tower would hang it."""
    attack = "__import__('sys').modules.__setitem__('rg_pwned', 1)"
    env = env_of(task="string_insertion")
    row = env.examples(1, seed=0)[0]
    ref = env.reset(row)[0]["reference"]
    assert play(env, row, f"<answer>{attack}</answer>")[1]["score"] == 0.0
    assert play(env, row, f"<answer>{list(ref)!r}</answer>")[1]["score"] == 0.1  # the list partial credit still works
    env = env_of(task="countdown")
    row = env.examples(1, seed=0)[0]
    t0 = time.time()
    for answer in (attack, "9**9**9**9", "(9**9)**(9**9)", "__import__('os').getpid()"):
        assert play(env, row, f"<answer>{answer}</answer>")[1]["score"] == 0.0
    assert time.time() - t0 < 2
    assert "rg_pwned" not in sys.modules


REPLIES = ["", "<answer>", "</answer>", "<answer></answer>", "<answer>\x00\ud800</answer>", "<answer>😀 ∑ ü</answer>",
           "<think><answer>1</answer>", "<answer>" * 10_000, "<answer>" + "(" * 3000 + "</answer>",
           "<answer>" + "9" * 5000 + "</answer>", "<answer>1e999999999</answer>", "<answer>nan</answer>",
           "<answer>[[[[[[[[</answer>", "<answer>{'a': }</answer>", "<answer>" + "x" * 3_000_000 + "</answer>",
           "<think>" + "y" * 3_000_000 + "</think><answer>1</answer>", None, 12, b"<answer>1</answer>"]


@pytest.mark.parametrize("task", ["leg_counting", "countdown", "string_insertion", "prime_factorization",
                                  "complex_arithmetic", "decimal_arithmetic", "spiral_matrix", "time_intervals"])
def test_step_never_raises_on_junk(task):
    env = env_of(task=task)
    row = env.examples(1, seed=0)[0]
    t0 = time.time()
    for reply in REPLIES:
        play(env, row, reply)
    assert time.time() - t0 < 5


def test_library_prints_are_silenced(capsys):
    dataset = reasoning_gym.create_dataset("bf", seed=0)
    dataset[0]
    assert capsys.readouterr().out  # the library prints while it generates bf ...
    env = rgenv.ReasoningGym(task="bf")
    for row in env.examples(2, seed=0):
        play(env, row, env.scripted_player("oracle")(env.reset(row)[0]))
        play(env, row, "<answer>x</answer>")
    assert capsys.readouterr().out == ""  # ... not here


# ----------------------------------------------------------------------------- bad env_args


@pytest.mark.parametrize("env_args,message", [
    ({}, "give one of task"),
    ({"task": "leg_counting", "tasks": {"gcd": 1}}, "give one of task"),
    ({"task": "leg_count"}, "no reasoning-gym task 'leg_count' \\(did you mean leg_counting"),
    ({"task": "composite"}, "for a mix use tasks"),
    ({"task": 3}, "task=3: must be a task name"),
    ({"tasks": {}}, "non-empty"),
    ({"tasks": {"gcd": 0}}, "positive number"),
    ({"tasks": {"gcd": True}}, "positive number"),
    ({"tasks": {"gcd": float("nan")}}, "positive number"),
    ({"tasks": {"gcd": 1, "nope": 1}}, "no reasoning-gym task 'nope'"),
    ({"tasks": {"gcd": 1}, "config": {"lcm": {}}}, "not in tasks"),
    ({"tasks": {"gcd": 1}, "config": {"gcd": 5}}, "must be a JSON object"),
    ({"task": "leg_counting", "config": [1]}, "must be a JSON object"),
    ({"task": "leg_counting", "config": {"nope": 1}}, "config for leg_counting: TypeError.*nope"),
    ({"task": "leg_counting", "config": {"min_animals": 0}}, "config for leg_counting: AssertionError: min_animals"),
    ({"task": "leg_counting", "config": {"seed": -1}}, "seed=-1 must be an integer"),
    ({"task": "leg_counting", "config": {"seed": "a"}}, "seed='a' must be an integer"),
    ({"task": "leg_counting", "allow_broken_scorer": 1}, "allow_broken_scorer=1: must be true or false"),
])
def test_bad_env_args_say_what_to_change(env_args, message):
    with pytest.raises(ValueError, match=message):
        rgenv.ReasoningGym(**env_args)


def test_load_env_turns_bad_args_into_a_message():
    import common
    with pytest.raises(SystemExit, match="bad --env_args for reasoning_gym: no reasoning-gym task 'nope'"):
        common.load_env("reasoning_gym", '{"task": "nope"}')


# ----------------------------------------------------------------------------- the scripts


def test_rl_two_steps_then_eval(tiny_model_dir, tmp_path):
    from conftest import run_main
    out = str(tmp_path / "rl")
    env_args = '{"task": "leg_counting"}'
    printed = run_main("rl", ["--env", "reasoning_gym", "--env_args", env_args, "--model", tiny_model_dir, "--batch", "4",
                              "--group", "2", "--steps", "2", "--max_new_tokens", "8", "--eval_every", "0", "--eval_n", "2",
                              "--save_every", "0", "--device", "cpu", "--out", out])
    assert "step 2 | reward" in printed
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps = [r for r in rows if "reward" in r and "step" in r]
    assert [r["step"] for r in steps][-2:] == [1, 2] and all("solved" in r and "score" in r for r in steps)
    printed = run_main("eval", ["--model", out, "--env", "reasoning_gym", "--env_args", env_args, "-n", "2",
                                "--max_new_tokens", "8", "--device", "cpu", "--show", "0", "--out", str(tmp_path / "ev")])
    assert "solved_rate" in printed
    summary = json.load(open(tmp_path / "ev" / "summary.json"))
    assert summary["n"] == 2 and 0.0 <= summary["reward_mean"] <= 1.0
    printed = run_main("eval", ["--model", "oracle", "--env", "reasoning_gym", "--env_args", env_args, "-n", "4",
                                "--show", "0", "--out", str(tmp_path / "oracle")])
    assert json.load(open(tmp_path / "oracle" / "summary.json"))["solved_rate"] == 1.0


def test_a_size_in_the_config_is_a_fixed_pool_of_entries():
    env = rgenv.ReasoningGym(task="basic_arithmetic", config={"size": 5})
    rows = [r for s in range(20) for r in env.examples(10, seed=s)]
    assert {r["index"] for r in rows} == set(range(5)) and {r["dataset_seed"] for r in rows} == {0}
    assert len({env.entry(r)["question"] for r in rows}) == 5


def test_a_mix_reports_each_tasks_score(tmp_path):
    from conftest import run_main
    printed = run_main("eval", ["--model", "oracle", "--env", "reasoning_gym", "--env_args", json.dumps(MIX), "-n", "12",
                                "--out", str(tmp_path)])
    by_task = json.load(open(tmp_path / "summary.json"))["by_task"]
    assert set(by_task) == set(MIX["tasks"]) and sum(t["n"] for t in by_task.values()) == 12
    assert all(t["solved_rate"] == 1.0 for t in by_task.values()) and "task leg_counting" in printed
