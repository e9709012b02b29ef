"""Tests for env_doublecheck: questions and exact answers, the final answer is the one scored, kept/fixed/broken,
the reply format, the scripted players, replies that must never raise, bad arguments."""
import re
import time

import pytest
from hypothesis import given, settings, strategies as st

import env_doublecheck as dc
import policies
import sample

EX = {"seed": 7, "question": "What is 47 + 85?", "answer": 132}
QUESTION = re.compile(r"What is ([0-9]+) ([-+*]) ([0-9]+)\?")


def play(first, final, example=EX):
    """Rewards and metrics of an episode with these two replies; checks the turn structure on the way."""
    env = dc.load_environment()
    state, prompt = env.reset(example)
    assert prompt == example["question"]
    assert env.step(state, first) == dc.DOUBLE_CHECK and not state["done"]
    assert env.step(state, final) is None and state["done"]
    return env.rewards(state), env.metrics(state)


def summary(name, n, seed=0):
    env = dc.load_environment()
    recs = sample.rollout(env, env.examples(n, seed), policies.ScriptedPolicy(env, name), progress=False)
    roles = ["system", "user", "assistant", "user", "assistant"]  # the question, a reply, the double-check, a reply
    assert len(recs) == n and all([m["role"] for m in r["messages"]] == roles for r in recs)
    assert all(r["messages"][3]["content"] == dc.DOUBLE_CHECK for r in recs)
    return {k: sum(r["metrics"][k] for r in recs) / n for k in recs[0]["metrics"]}, recs


# ----------------------------------------------------------------------------- examples

def test_examples_deterministic_with_exact_answers():
    env = dc.load_environment()
    rows = env.examples(300, seed=5)
    assert rows == env.examples(300, seed=5) and rows != env.examples(300, seed=6)
    assert rows[:10] == env.examples(10, seed=5)
    ops = set()
    for r in rows:
        assert set(r) == {"seed", "question", "answer"} and type(r["seed"]) is int and type(r["answer"]) is int
        a, op, b = QUESTION.fullmatch(r["question"]).groups()
        a, b = int(a), int(b)
        assert r["answer"] == {"+": a + b, "-": a - b, "*": a * b}[op]
        assert 2 <= a <= 99 and 2 <= b <= 99 and (op != "*" or min(a, b) <= 9)
        assert dc.make_example(r["seed"], 99) == r  # drawn from its own seed alone
        ops.add(op)
    assert ops == {"+", "-", "*"}
    assert any(r["answer"] < 0 for r in rows) and len({r["question"] for r in rows}) > 250
    assert {a for r in rows for a in map(int, QUESTION.fullmatch(r["question"]).group(1, 3))} >= {2, 9, 99}


def test_examples_are_pinned():
    """The same rows on every machine and Python version (random.Random's integers are stable): a change in how
    questions are drawn changes every published evaluation, so it must be deliberate."""
    assert dc.load_environment().examples(3) == [
        {"seed": 1654615998, "question": "What is 33 + 80?", "answer": 113},
        {"seed": 1806341205, "question": "What is 72 + 76?", "answer": 148},
        {"seed": 173879092, "question": "What is 63 * 6?", "answer": 378}]


def test_max_value_bounds_operands():
    for max_value in (2, 5, 1000):
        for r in dc.load_environment(max_value=max_value).examples(200, seed=1):
            a, op, b = QUESTION.fullmatch(r["question"]).groups()
            assert 2 <= int(a) <= max_value and 2 <= int(b) <= max_value
    assert max(int(x) for r in dc.load_environment(max_value=1000).examples(200) for x in
               QUESTION.fullmatch(r["question"]).group(1, 3)) > 500


# ----------------------------------------------------------------------------- scripted players

def test_oracle_is_always_right_and_well_formed():
    means, recs = summary("oracle", 200)
    assert means == {"first_correct": 1.0, "correct": 1.0, "kept": 1.0, "fixed": 0.0, "broken": 0.0, "format": 1.0}
    assert all(r["rewards"] == {"correct": 1.0, "format": 1.0} and r["reward"] == pytest.approx(1.1) for r in recs)


def test_hasty_is_fixed_at_the_double_check():
    means, recs = summary("hasty", 300)
    assert 0.62 <= means["first_correct"] <= 0.78
    assert means["correct"] == 1.0 and means["broken"] == 0.0 and means["format"] == 1.0
    assert means["fixed"] == pytest.approx(1 - means["first_correct"]) and means["kept"] == means["first_correct"]
    for r in recs:  # wrong by a small nonzero amount
        first = int(re.search(r"<answer>(-?[0-9]+)</answer>", r["messages"][2]["content"]).group(1))
        assert first - r["example"]["answer"] in (0, -2, -1, 1, 2)
    assert summary("hasty", 300)[1] == recs  # deterministic


def test_players_only_read_the_state_and_unknown_name():
    env = dc.load_environment()
    state, _ = env.reset(EX)
    assert env.scripted_player("oracle")(state) == "<think>47 + 85 = 132.</think><answer>132</answer>"
    with pytest.raises(ValueError, match=r"unknown scripted player 'minimax' for doublecheck: use 'oracle' or 'hasty'"):
        env.scripted_player("minimax")


# ----------------------------------------------------------------------------- rewards and metrics

@pytest.mark.parametrize("first,final,correct,metrics", [
    ("<answer>131</answer>", "<answer>132</answer>", 1.0, (0, 1, 0, 1, 0)),   # fixed
    ("<answer>132</answer>", "<answer>131</answer>", 0.0, (1, 0, 0, 0, 1)),   # broken: the final answer counts
    ("<answer>132</answer>", "<answer>132</answer>", 1.0, (1, 1, 1, 0, 0)),   # kept
    ("<answer>130</answer>", "<answer>131</answer>", 0.0, (0, 0, 0, 0, 0)),   # wrong twice
    ("<answer>132</answer>", "I am sure.", 0.0, (1, 0, 0, 0, 1)),             # no final answer
])
def test_final_answer_is_scored(first, final, correct, metrics):
    rewards, got = play(first, final)
    assert rewards == {"correct": correct, "format": 0.5 if final == "I am sure." else 1.0}
    names = ("first_correct", "correct", "kept", "fixed", "broken")
    assert tuple(got[k] for k in names) == metrics and all(type(got[k]) is float for k in got)


def test_double_check_message_does_not_reveal_correctness():
    env = dc.load_environment()
    msgs = {env.step(env.reset(EX)[0], reply) for reply in ("<answer>132</answer>", "<answer>7</answer>", "", None)}
    assert msgs == {dc.DOUBLE_CHECK} and "Are you sure?" in dc.DOUBLE_CHECK


def test_format_is_the_share_of_well_formed_replies():
    assert play("<answer>132</answer>", "the answer: <answer>132</answer>")[0] == {"correct": 1.0, "format": 0.5}
    assert play("132", "<think>sure</think> <answer>132</answer>\n")[0] == {"correct": 1.0, "format": 0.5}
    assert play("132", "<answer>132</answer><answer>132</answer>")[0] == {"correct": 0.0, "format": 0.0}
    assert play("<answer>-5</answer>", "<answer>-132</answer>")[1]["format"] == 1.0


def test_steps_after_the_end_change_nothing():
    env = dc.load_environment()
    state, _ = env.reset(EX)
    env.step(state, "<answer>1</answer>"), env.step(state, "<answer>132</answer>")
    assert env.step(state, "<answer>5</answer>") is None and state["final"] == 132 and state["turns"] == 2
    assert "132" in env.describe(state) and "first answer: 1," in env.describe(state)


@pytest.mark.parametrize("reply,answer,ok", [
    ("<answer>132</answer>", 132, True),
    ("<think>47 + 85 = 132.</think><answer>132</answer>", 132, True),
    ("  <think>\nmulti\nline < 5</think>\n<answer>-7</answer>\n", -7, True),
    ("<think></think><answer>0</answer>", 0, True),
    ("<answer> 132 </answer>", 132, False),
    ("The answer is <answer>132</answer>", 132, False),
    ("<answer>132</answer> done", 132, False),
    ("<think>x</think>junk<answer>132</answer>", 132, False),
    ("<think><think>x</think></think><answer>132</answer>", 132, False),
    ("<think><answer>1</answer></think><answer>132</answer>", None, False),
    ("<answer>132</answer><answer>132</answer>", None, False),
    ("<answer>1<answer>132</answer>", None, False),
    ("<answer>132.0</answer>", None, False),
    ("<answer>١٣٢</answer>", None, False),
    ("<answer></answer>", None, False),
    ("<answer>132", None, False),
    ("<ANSWER>132</ANSWER>", None, False),
    ("132", None, False),
    ("", None, False),
])
def test_parse_and_well_formed_cases(reply, answer, ok):
    assert dc.parse_answer(reply) == answer
    assert (dc.WELL_FORMED.fullmatch(reply) is not None) is ok
    env = dc.load_environment()
    state, _ = env.reset(EX)
    env.step(state, reply)
    assert state["first"] == answer and state["well_formed"] == ok


# ----------------------------------------------------------------------------- untrusted replies

class Unprintable:
    def __str__(self):
        raise RuntimeError("no")


def check_step_never_raises(replies):
    env = dc.load_environment()
    state, _ = env.reset(EX)
    assert env.step(state, replies[0]) == dc.DOUBLE_CHECK and env.step(state, replies[1]) is None
    rewards, metrics = env.rewards(state), env.metrics(state)
    assert set(rewards) == {"correct", "format"} and 0.0 <= rewards["format"] <= 1.0
    assert all(v in (0.0, 1.0) for k, v in metrics.items() if k != "format")
    return state


@settings(derandomize=True, max_examples=300, deadline=None, database=None)
@given(st.lists(st.text(alphabet=st.sampled_from(list("<>/ answerthink0123456789-.\n١")) | st.characters(), max_size=80)
                | st.none() | st.integers() | st.binary() | st.lists(st.text(max_size=5)), min_size=2, max_size=2))
def test_step_never_raises_property(replies):
    state = check_step_never_raises(replies)
    for reply, answer in zip(replies, (state["first"], state["final"])):
        text = reply if isinstance(reply, str) else str(reply)
        tags = re.findall(r"<answer>\s*(-?[0-9]{1,30})\s*</answer>", text)
        assert answer == (int(tags[0]) if text.count("<answer>") == 1 and tags else None)


def test_huge_and_strange_replies_are_fast():
    huge = ["<answer>" * 200_000 + "1", "<answer>" + " " * 3_000_000 + "x", "<think>" * 300_000,
            "<think>" + "x" * 3_000_000 + "</think><answer>132</answer>", "9" * 3_000_000,
            "<answer>" + "9" * 1_000_000 + "</answer>"]
    for reply in huge:
        t0 = time.perf_counter()
        check_step_never_raises([reply, reply])
        assert time.perf_counter() - t0 < 2.0
    assert check_step_never_raises([huge[3], huge[3]])["final"] == 132
    for odd in (None, 132, 10**5000, b"<answer>132</answer>", ["<answer>132</answer>"], Unprintable(), "\ud800"):
        check_step_never_raises([odd, odd])


# ----------------------------------------------------------------------------- bad arguments

@pytest.mark.parametrize("value", [True, False, 1, 0, -5, 2.5, 99.0, "99", None, 10**9 + 1])
def test_bad_max_value_raises_naming_it(value):
    with pytest.raises(ValueError, match=r"max_value=.*: must be an integer from 2 to"):
        dc.load_environment(max_value=value)


def test_unknown_argument_raises_naming_it():
    with pytest.raises(TypeError, match="max_turns"):
        dc.load_environment(max_turns=3)
    assert dc.load_environment.__doc__ and dc.load_environment(max_value=10**9).max_value == 10**9
