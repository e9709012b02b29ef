"""Tests for env_reverse: the similarity reward, answer parsing, generated and file-loaded texts, bad arguments."""
import difflib
import json
import random
import time

import pytest
from hypothesis import given, settings, strategies as st

import env_reverse as rev

TAG, END = "<reversed_text>", "</reversed_text>"


def score(text, reply):
    env = rev.load_environment()
    state, prompt = env.reset({"seed": 0, "text": text})
    assert prompt == f"input: {text}"
    assert env.step(state, reply) is None and state["done"]
    return env.rewards(state)["similarity"], env.metrics(state)


# ----------------------------------------------------------------------------- rewards

def test_exact_answer_scores_one():
    env = rev.load_environment()
    oracle = env.scripted_player("oracle")
    for ex in env.examples(50, seed=1):
        state, _ = env.reset(ex)
        env.step(state, oracle(state))
        assert env.rewards(state) == {"similarity": 1.0}
        assert env.metrics(state) == {"tagged": 1.0, "exact": 1.0}
    assert "target: " in env.describe(state) and "answer: " in env.describe(state)


@pytest.mark.parametrize("reply", ["", "olleh", "the answer is olleh", "<reversed_text>olleh", "olleh</reversed_text>",
                                   "<REVERSED_TEXT>olleh</REVERSED_TEXT>", "<reversed>olleh</reversed>"])
def test_no_tag_scores_zero(reply):
    sim, metrics = score("hello", reply)
    assert sim == 0.0
    assert metrics == {"tagged": 0.0, "exact": 0.0}


@pytest.mark.parametrize("answer", ["olle", "ollhe", "hello", "olleh olleh", "xl", "oll eh", "OLLeh", "ollehh"])
def test_partial_answers_strictly_between(answer):
    sim, metrics = score("hello", f"{TAG}{answer}{END}")
    assert 0.0 < sim < 1.0, (answer, sim)
    assert metrics == {"tagged": 1.0, "exact": 0.0}


def test_unrelated_and_empty_answers():
    assert score("hello", f"{TAG}zzz{END}")[0] == 0.0
    assert score("hello", f"{TAG}{END}")[0] == 0.0
    assert score("hello", f"{TAG}{END}")[1]["tagged"] == 1.0


def test_matches_sequence_matcher_ratio():
    rng = random.Random(3)
    env = rev.load_environment()
    checked = 0
    for ex in env.examples(300, seed=2):
        target = ex["text"][::-1]
        answer = list(target)
        for _ in range(rng.randrange(6)):  # edits: delete, insert, swap
            i = rng.randrange(len(answer) + 1)
            op = rng.randrange(3)
            if op == 0 and i < len(answer):
                del answer[i]
            elif op == 1:
                answer.insert(i, rng.choice("abcxyz ."))
            elif i + 1 < len(answer):
                answer[i], answer[i + 1] = answer[i + 1], answer[i]
        answer = "".join(answer).strip()
        if rng.random() < 0.2:
            answer = ex["text"]  # the unreversed text
        state, _ = env.reset(ex)
        env.step(state, f"<think>reversing</think>{TAG}{answer}{END}")
        expected = difflib.SequenceMatcher(None, answer, target).ratio()
        assert env.rewards(state)["similarity"] == pytest.approx(expected, abs=1e-12)
        assert rev.similarity(answer, target) == pytest.approx(expected, abs=1e-12)
        checked += 1
    assert checked == 300


@settings(derandomize=True, max_examples=300, deadline=None, database=None)
@given(st.text(max_size=40).map(str.strip), st.text(min_size=1, max_size=40))
def test_similarity_property(answer, target):
    s = rev.similarity(answer, target)
    assert 0.0 <= s <= 1.0
    assert (s == 1.0) == (answer == target)
    if len(answer) <= 2 * len(target):
        assert s == pytest.approx(difflib.SequenceMatcher(None, answer, target).ratio(), abs=1e-12)


def test_similarity_edge_cases():
    assert rev.similarity(None, "abc") == 0.0
    assert rev.similarity("", "") == 1.0
    assert rev.similarity("abc", "") == 0.0
    assert rev.similarity("", "abc") == 0.0


def test_long_answer_is_bounded_by_its_full_length():
    target = "abcdef"
    # matched on the first 12 characters only, but the full length is in the denominator
    long = target + "x" * 994
    assert rev.similarity(long, target) == pytest.approx(2 * 6 / (1000 + 6))
    assert rev.similarity(target * 100, target) == pytest.approx(2 * 6 / (600 + 6))


def test_multi_megabyte_reply_scores_fast():
    text = "The quick brown fox jumps over the lazy dog."
    target = text[::-1]
    replies = [
        TAG + target * 100_000 + END,
        "<think>" + "x" * 3_000_000 + "</think>" + TAG + target + END,
        TAG + "".join(random.Random(0).choices("abc .<>/", k=3_000_000)) + END,
        "".join(random.Random(1).choices("<>/reversed_text", k=3_000_000)),
    ]
    for reply in replies:
        assert len(reply) >= 3_000_000
        t0 = time.perf_counter()
        sim, _ = score(text, reply)
        assert time.perf_counter() - t0 < 2.0
        assert 0.0 <= sim <= 1.0
    assert score(text, replies[1])[0] == 1.0
    assert score(text, replies[0])[0] < 0.001


PATHOLOGICAL_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
import env_reverse as r
print(r.parse_answer("<reversed_text>" * 40_000 + "x"))  # 600 kB of unclosed opening tags
"""


def test_many_unclosed_tags_parse_fast(run_python_within):
    run_python_within(PATHOLOGICAL_SCRIPT, 1.5, "parse_answer on a 600 kB reply")


def test_last_tag_used_when_repeated():
    assert rev.parse_answer(f"{TAG}first{END} then {TAG}second{END}") == "second"
    assert rev.parse_answer(f"{TAG}a{END}{TAG}b{END}{TAG}c{END}") == "c"
    assert rev.parse_answer(f"{TAG}\nmulti\nline\n{END}") == "multi\nline"
    assert rev.parse_answer("nothing") is None
    assert score("hello", f"{TAG}olleh{END}{TAG}wrong{END}")[0] < 1.0
    assert score("hello", f"{TAG}wrong{END}{TAG}olleh{END}")[0] == 1.0


def test_non_string_reply_is_read_as_text():
    env = rev.load_environment()
    state, _ = env.reset({"seed": 0, "text": "ab"})
    env.step(state, None)
    assert state["answer"] is None and env.rewards(state)["similarity"] == 0.0


# ----------------------------------------------------------------------------- examples

def test_examples_deterministic_and_varied():
    env = rev.load_environment()
    rows = env.examples(300, seed=5)
    assert rows == env.examples(300, seed=5)
    assert rows != env.examples(300, seed=6)
    assert all(set(r) == {"seed", "text"} and isinstance(r["seed"], int) for r in rows)
    lengths = [len(r["text"].split()) for r in rows]
    assert min(lengths) == 3 and max(lengths) == 12
    assert len(set(lengths)) == 10
    vocab = {w.strip(".!?").lower() for r in rows for w in r["text"].split()}
    assert len(vocab) > 150
    assert vocab <= {w.lower() for w in rev.WORDS}
    assert len({r["text"] for r in rows}) == 300
    assert {r["text"][-1] for r in rows} == {".", "!", "?"}
    assert all(r["text"][0] == r["text"][0].upper() for r in rows)


def test_min_max_words_respected():
    env = rev.load_environment(min_words=5, max_words=5)
    assert all(len(r["text"].split()) == 5 for r in env.examples(50, seed=0))
    env = rev.load_environment(min_words=1, max_words=2)
    assert {len(r["text"].split()) for r in env.examples(100, seed=0)} == {1, 2}


@pytest.mark.parametrize("kwargs", [{"min_words": 0}, {"min_words": 5, "max_words": 4}, {"max_words": 0},
                                    {"min_words": 2.5}, {"max_words": "12"}, {"min_words": -3}])
def test_bad_word_counts_raise(kwargs):
    with pytest.raises(ValueError, match="min_words"):
        rev.load_environment(**kwargs)


def test_unknown_argument_and_player():
    with pytest.raises(TypeError, match="max_chars"):
        rev.load_environment(max_chars=10)
    with pytest.raises(ValueError, match="minimax"):
        rev.load_environment().scripted_player("minimax")


# ----------------------------------------------------------------------------- data_path

def test_txt_data_path(tmp_path):
    path = tmp_path / "texts.txt"
    path.write_text("first paragraph here\n\n   \n  second one, padded  \nthird — ünïcode ✓\n", encoding="utf-8")
    env = rev.load_environment(data_path=str(path))
    assert env.texts == ["first paragraph here", "second one, padded", "third — ünïcode ✓"]
    rows = env.examples(60, seed=0)
    assert {r["text"] for r in rows} == set(env.texts)
    assert rows == env.examples(60, seed=0)
    oracle = env.scripted_player("oracle")
    for r in rows:
        state, _ = env.reset(r)
        env.step(state, oracle(state))
        assert env.rewards(state)["similarity"] == 1.0


def test_jsonl_data_path(tmp_path):
    path = tmp_path / "texts.jsonl"
    lines = [json.dumps({"text": "alpha beta", "id": 1}), "", json.dumps({"text": "gamma delta", "extra": [1, 2]}),
             json.dumps({"text": "ε ζ η"}, ensure_ascii=False)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    env = rev.load_environment(data_path=str(path))
    assert env.texts == ["alpha beta", "gamma delta", "ε ζ η"]
    assert {r["text"] for r in env.examples(50, seed=1)} == set(env.texts)


@pytest.mark.parametrize("bad_line", ["{not json", '{"content": "no text field"}', "[1, 2, 3]", '"just a string"', "42"])
def test_malformed_jsonl_raises_naming_file_and_line(tmp_path, bad_line):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + bad_line + "\n", encoding="utf-8")
    with pytest.raises(ValueError) as err:
        rev.load_environment(data_path=str(path))
    assert "broken.jsonl:2" in str(err.value) and "text" in str(err.value)


def test_missing_file_raises_naming_it(tmp_path):
    path = tmp_path / "nowhere.txt"
    with pytest.raises(FileNotFoundError, match="nowhere.txt"):
        rev.load_environment(data_path=str(path))


@pytest.mark.parametrize("name,content", [("empty.txt", "\n  \n\n"), ("empty.jsonl", "\n\n")])
def test_empty_data_file_raises(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=name):
        rev.load_environment(data_path=str(path))


def test_oracle_scores_one_on_jsonl_text_with_surrounding_whitespace(tmp_path):
    path = tmp_path / "ws.jsonl"
    path.write_text(json.dumps({"text": "line with a newline\n"}) + "\n", encoding="utf-8")
    env = rev.load_environment(data_path=str(path))
    (ex,) = env.examples(1, seed=0)
    state, _ = env.reset(ex)
    env.step(state, env.scripted_player("oracle")(state))
    assert env.rewards(state)["similarity"] == 1.0
