"""OpenEnv environments as they are (env_openenv.py) on three of our own (tests/openenv_envs: a single-step text
Action with a TaskProvider, a multi-step game with an int Action played by tool calls, an MCP environment's tools),
each in the guard's worker on a venv of its own with openenv==0.10.0 (made here with uv, then reused: .venv-openenv;
openenv brings about 110 packages, gradio and fastmcp among them, that the trainer needs none of). The Action built
from the reply, observations, rewards and done, junk replies, a restarted worker's replay, the seed-ignoring
environments (seeded, or refused), what is refused and why, and rl.py / eval.py on each."""
import json
import random
import subprocess

import pytest

import common
import env_openenv as eo
from conftest import ROOT, play, run_main, uv_venv

VENV = ROOT / ".venv-openenv"
ENVS = ROOT / "tests" / "openenv_envs"
QA, GUESS, LOOKUP = (str(ENVS / f"{name}.py") for name in ("qa", "guess", "lookup"))
TRAIN_PAIRS = [(a, b) for a in range(1, 6) for b in range(1, 6)]  # qa.py's train split
DONE = {"error": 0.0, "timeout": 0.0}  # the guard's metrics of an episode that ran without a failure


@pytest.fixture(scope="module")
def python():
    """The venv with openenv 0.10.0: made once (about 2-4 s here, uv's cache warm or cold), then reused; the tests
    skip where uv cannot install it (offline without the cache)."""
    try:
        return uv_venv(VENV, "openenv", "0.10.0")
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"uv could not install openenv==0.10.0: {e}")


def load(python, path, **kw):
    return eo.load_environment(path=path, python=python, **kw)


@pytest.fixture(scope="module")
def qa(python):
    env = load(python, QA, id="SumEnvironment")
    yield env
    env.close()


@pytest.fixture(scope="module")
def guess(python):
    env = load(python, GUESS, id="GuessEnvironment")
    yield env
    env.close()


@pytest.fixture(scope="module")
def lookup(python):
    env = load(python, LOOKUP)
    yield env
    env.close()


def call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def test_a_text_action_takes_the_reply_and_examples_walk_the_task_provider(qa, python):
    assert qa.tools is None and qa.reward_weights == {"reward": 1.0} and qa.max_turns == 16
    assert qa.system_prompt == "SumEnvironment environment"  # openenv's get_metadata() description
    examples = qa.examples(4, seed=3)
    assert examples == qa.examples(4, seed=3) and len({e["seed"] for e in examples}) == 4
    indices = [e["index"] for e in examples]
    assert {e["split"] for e in examples} == {"train"} and indices == [(indices[0] + i) % 25 for i in range(4)]
    for example in examples:
        a, b = TRAIN_PAIRS[example["index"]]
        for reply, reward in ((f" {a + b}\n", 1.0), (f"{a + b + 1}", 0.0), (f"{a} + {b}", 0.0)):
            said, rewards, metrics = play(qa, example, [reply])
            assert said == [f"What is {a} + {b}?", None]
            assert rewards == {"reward": reward} and metrics == {"n_invalid": 0, "n_steps": 1, "cut_off": 0, **DONE}
    other = load(python, QA, id="SumEnvironment", args={"prefix": "Compute"}, split="test")
    firsts = {other.reset(e)[1] for e in other.examples(6, seed=0)}
    assert firsts == {"Compute 7 + 8?", "Compute 9 + 9?"}
    other.close()


def bisect(env, example):
    """Guess by halving the range on each hint, through tool calls: (the guesses, the tool messages, the state)."""
    state, first = env.reset(example)
    assert first == "hint: Guess a number from 1 to 8.\nguesses_left: 4"
    low, high, guesses, said = 1, 8, [], []
    while True:
        guesses.append((low + high) // 2)
        said.append(env.step(state, f"Let me try. {call('GuessAction', guess=guesses[-1])}"))
        if said[-1] is None:
            return guesses, said, state
        hint = said[-1]["content"].split("\n")[0]
        low, high = (guesses[-1] + 1, high) if hint == "hint: Higher." else (low, guesses[-1] - 1)


def test_tool_calls_build_a_non_text_action_and_rewards_sum_over_its_steps(guess):
    assert guess.tools == [{"type": "function", "function": {
        "name": "GuessAction", "description": "Guess the number.", "parameters": {
            "additionalProperties": False, "description": "Guess the number.",
            "properties": {"guess": {"title": "Guess", "type": "integer"}}, "required": ["guess"], "type": "object"}}}]
    assert "<tool_call>" in guess.system_prompt
    for example in guess.examples(6, seed=1):
        secret = random.Random(example["seed"]).randint(1, 8)  # guess.py's draw: its reset got the example's seed
        guesses, said, state = bisect(guess, example)
        assert guesses[-1] == secret and len(guesses) <= 4
        assert all(m["role"] == "tool" and m["content"].endswith(f"guesses_left: {4 - i}")
                   for i, m in enumerate(said[:-1], 1))
        # -0.1 a wrong guess, 1 the right one: a sum of at most 4 terms, off by float rounding only (< 1e-15);
        # a step's reward lost or counted twice moves it by 0.1 at least
        assert guess.rewards(state)["reward"] == pytest.approx(1.0 - 0.1 * (len(guesses) - 1), abs=1e-12)
        assert guess.metrics(state) == {"n_invalid": 0, "n_steps": len(guesses), "cut_off": 0, **DONE}
    example = {"seed": 5}
    secret = random.Random(5).randint(1, 8)
    wrong = [g for g in range(1, 9) if g != secret]
    # two calls in one reply: two steps, two tool messages; arguments may come as a JSON string too
    two = call("GuessAction", guess=wrong[0]) + ' and <tool_call>{"name": "GuessAction", "arguments": ' \
        + json.dumps(json.dumps({"guess": wrong[1]})) + "}</tool_call>"
    replies = [two, call("GuessAction", guess=wrong[2]), call("GuessAction", guess=wrong[3]),
               call("GuessAction", guess=secret)]
    said, rewards, metrics = play(guess, example, replies)
    assert [m["role"] for m in said[1]] == ["tool", "tool"] and said[2]["role"] == "tool"
    assert said[3:] == [None]  # the 4th wrong guess ends it
    assert rewards["reward"] == pytest.approx(-0.4, abs=1e-12) and metrics["n_steps"] == 4 and metrics["cut_off"] == 0
    # the worker killed mid-episode (a hang in C ends so): the next call replays the episode's replies in another
    state, _ = guess.reset(example)
    guess.step(state, call("GuessAction", guess=wrong[0]))
    restarts = guess.restarts
    guess._kill()
    assert guess.step(state, call("GuessAction", guess=secret)) is None and guess.restarts == restarts + 1
    assert guess.rewards(state)["reward"] == pytest.approx(0.9, abs=1e-12) and guess.metrics(state)["n_steps"] == 2


def test_mcp_tools_are_offered_and_called_and_a_submit_ends_the_episode(lookup):
    assert [t["function"]["name"] for t in lookup.tools] == ["lookup", "submit"]
    assert lookup.tools[0]["function"] == {"name": "lookup", "description": "The value of a key.", "parameters": {
        "additionalProperties": False, "properties": {"key": {"type": "string"}}, "required": ["key"],
        "type": "object"}}
    for example in lookup.examples(4, seed=2):
        state, first = lookup.reset(example)  # a plain Observation: its metadata is the task
        key = first.removeprefix("Find the value of ").removesuffix(" and submit it.")
        value = lookup.step(state, call("lookup", key=key))
        assert value["role"] == "tool" and value["content"] in ("apple", "brick", "cloud", "dune", "ember", "frost",
                                                                 "grove", "haze")
        assert lookup.step(state, call("lookup", key="nope") + call("lookup", key=key)) == [
            {"role": "tool", "content": "error: Error calling tool 'lookup': no key 'nope'"}, value]
        assert lookup.step(state, call("look", key=key)) == "(invalid action: unknown tool 'look' (tools: lookup, " \
                                                            "submit))"
        assert lookup.step(state, call("submit", value=value["content"])) is None
        assert lookup.rewards(state) == {"reward": 1.0}
        assert lookup.metrics(state) == {"n_invalid": 1, "n_steps": 4, "cut_off": 0, **DONE}
        said, rewards, metrics = play(lookup, example, [call("submit", value="x")])
        assert said[1:] == [None] and rewards == {"reward": 0.0} and metrics["n_steps"] == 1


JUNK = ["", " ", "\x00\x01", "\ud800", "9" * 5000, "<tool_call>" * 1000, "<tool_call>{bad json</tool_call>",
        '{"name": "GuessAction", "arguments": {"guess": 3}}', call("x"), call("GuessAction", guess="many"),
        call("GuessAction", guess=1, extra=2), call("GuessAction", guess=1.5),
        '<tool_call>{"name": "GuessAction", "arguments": [1]}</tool_call>', "<|im_end|>", "{{ system }}"]


def test_junk_replies_never_raise_and_cost_their_turn(qa, guess, lookup, python):
    """Junk is an answer to the text Action (scored 0); to the tool environments an invalid action each, which
    costs its turn (then a right guess, a wrong submit end the episode), until max_turns cuts the episode off."""
    for reply in JUNK:
        said, rewards, metrics = play(qa, qa.examples(1)[0], [reply])
        assert said[1:] == [None] and rewards == {"reward": 0.0} and metrics["n_invalid"] == 0
    short = load(python, GUESS, id="GuessEnvironment", max_turns=5)
    secret = random.Random(3).randint(1, 8)
    for env, last, reward in ((guess, call("GuessAction", guess=secret), 1.0), (lookup, call("submit", value="x"), 0.0),
                              (short, None, 0.0)):
        said, rewards, metrics = play(env, {"seed": 3}, JUNK + [last])
        invalid = said[1:-1]
        assert all(m.startswith("(invalid action: ") and "\n" not in m for m in invalid) and said[-1] is None
        assert metrics["n_invalid"] == (5 if env is short else len(JUNK)) == len(invalid) + (env is short)
        assert rewards == {"reward": reward}
        assert metrics["cut_off"] == (env is short) and metrics["n_steps"] == (env is not short)
        assert metrics["error"] == 0
    short.close()


def test_an_environment_that_ignores_the_seed_is_seeded_and_one_no_seed_reaches_is_refused(python):
    """GlobalRandomSum draws from the global `random`, ignoring reset's seed: the episode's own seeded random state
    makes it the same for the same seed (in another worker too) and different across seeds; so for MovingGuess,
    which draws at every step too. UnseededSum draws from the system's entropy: the probe at load sees two resets
    differ and refuses it, saying why."""
    first, second = (load(python, QA, id="GlobalRandomSum") for _ in range(2))
    examples = first.examples(6, seed=4)
    questions = [first.reset(e)[1] for e in examples]
    assert questions == [second.reset(e)[1] for e in reversed(examples)][::-1]
    assert len(set(questions)) == 6  # these seeds' draws (of 2500 pairs: a repeat had a 15/2500 chance)
    first.close()
    second.close()
    # MovingGuess draws from the global `random` at reset and at every step: interleaved episodes each draw the
    # sequence that random.Random(their seed) gives, as alone
    moving = load(python, GUESS, id="MovingGuess")
    examples = moving.examples(6, seed=0)
    states, hints = [moving.reset(e)[0] for e in examples], [[] for _ in examples]
    for _ in range(4):
        for state, said in zip(states, hints):
            if None not in said:
                said.append(moving.step(state, call("GuessAction", guess=4)))
    for example, said in zip(examples, hints):
        rng, expected = random.Random(example["seed"]), []
        for left in (3, 2, 1, 0):
            secret = rng.randint(1, 8)
            expected.append(None if secret == 4 or left == 0 else
                            {"role": "tool", "content": f"hint: {'Higher' if secret > 4 else 'Lower'}.\n"
                                                        f"guesses_left: {left}"})
            if expected[-1] is None:
                break
        assert said == expected
    moving.close()
    with pytest.raises(ValueError, match=r"UnseededSum is not deterministic: two resets with the same seed"):
        load(python, QA, id="UnseededSum")


def test_what_cannot_run_is_refused_in_one_line(python, tmp_path):
    """A server URL, and each way of naming no runnable Environment class: a one-line SystemExit from load_env,
    saying what to change (the worker's errors included: a constructor that raises)."""
    for url in ({"url": "http://localhost:8000"}, {"base_url": "https://x.hf.space"}):
        with pytest.raises(SystemExit, match=r"is not run here: this runs the Environment class itself.*name it "
                                             r"instead") as refused:
            common.load_env("openenv", {**url, "python": python})
        assert "\n" not in str(refused.value)
    (tmp_path / "plain.py").write_text("X = 1\n")
    (tmp_path / "bare.py").write_text(
        "from openenv.core.env_server.interfaces import Environment\n"
        "class Bare(Environment):\n    def reset(self, seed=None, episode_id=None, **kw): pass\n"
        "    def step(self, action): pass\n    state = None\n")
    (tmp_path / "broken.py").write_text(
        "from openenv.core.env_server.interfaces import Environment\n"
        "class Broken(Environment):\n    def __init__(self):\n        raise OSError('no dataset here')\n"
        "    def reset(self, seed=None, episode_id=None, **kw): pass\n    def step(self, action): pass\n"
        "    state = None\n")
    cases = [({"path": QA}, "defines 3 Environment classes (SumEnvironment, GlobalRandomSum, UnseededSum): "
                            "name one as id"),
             ({"path": str(tmp_path / "plain.py")}, "defines 0 Environment classes"),
             ({"path": "no/such.py"}, "no such .py file"),
             ({"id": "SumEnvironment"}, 'give "module:Class"'),
             ({"id": "no_such_module:Env"}, "No module named 'no_such_module'"),
             ({"id": "json:JSONDecoder"}, "is not an openenv Environment class"),
             ({"path": QA, "id": "SumEnvironment", "args": [1]}, "must be a JSON object"),
             ({"path": QA, "id": "SumEnvironment", "args": {"nope": 1}}, "unexpected keyword argument 'nope'"),
             ({"path": QA, "id": "SumEnvironment", "split": "dev"}, "split='dev': SumEnvironment has the splits"),
             ({"path": str(tmp_path / "bare.py")}, "Bare declares no Action class"),
             ({"path": str(tmp_path / "broken.py")}, "OSError: no dataset here"),
             ({"path": GUESS, "python": "/no/python"}, "not an executable")]
    for env_args, why in cases:
        with pytest.raises(SystemExit) as refused:
            common.load_env("openenv", {"python": python, **env_args})
        assert why in str(refused.value) and "\n" not in str(refused.value), (env_args, str(refused.value))


def bisect_guesses(secret):
    """How many guesses players.py's bisect takes to find `secret`."""
    low, high, guesses = 1, 8, 1
    while (low + high) // 2 != secret:
        low, high = ((low + high) // 2 + 1, high) if (low + high) // 2 < secret else (low, (low + high) // 2 - 1)
        guesses += 1
    return guesses


def test_rl_and_eval_run_on_each(python, tiny_model_dir, tmp_path, torch_single_thread, qa, guess):
    """rl.py 2 steps on each environment (max_turns 3: the tiny model's replies are junk to the tool ones; its last
    step evaluates); eval.py with a scripted player of each, written against the messages (players.py): rewards as
    the environments give them, on the episodes our own instance deals for the same seed."""
    players = str(ENVS / "players.py")
    secrets = [random.Random(e["seed"]).randint(1, 8) for e in guess.examples(6, seed=5)]
    for name, env_args, player, reward in (
            ("qa", {"path": QA, "id": "SumEnvironment"}, "add", 1.0),
            ("guess", {"path": GUESS, "id": "GuessEnvironment"}, "bisect",
             sum(1.1 - 0.1 * bisect_guesses(s) for s in secrets) / 6),
            ("lookup", {"path": LOOKUP}, "look_up_and_submit", 1.0)):
        env_args = json.dumps({**env_args, "python": python, "max_turns": 3})
        out = run_main("rl", ["--model", tiny_model_dir, "--env", "openenv", "--env_args", env_args, "--batch", "4",
                              "--group", "2", "--steps", "2", "--max_new_tokens", "8", "--eval_every", "0",
                              "--eval_n", "2", "--out", str(tmp_path / name / "rl")])
        assert "step 2 |" in out and "step 2 | eval_" in out
        run_main("eval", ["--model", f"{players}:{player}", "--env", "openenv", "--env_args", env_args, "-n", "6",
                          "--seed", "5", "--out", str(tmp_path / name / "eval")])
        summary = json.load(open(tmp_path / name / "eval" / "summary.json"))
        assert summary["n"] == 6 and summary["error_rate"] == summary["mean_invalid"] == summary["cut_off_rate"] == 0
        assert summary["reward_mean"] == pytest.approx(reward, abs=1e-12)  # float rounding only, as above
    episodes = [json.loads(line) for line in open(tmp_path / "qa" / "eval" / "rollouts.jsonl")]
    firsts = sorted(e["messages"][1]["content"] for e in episodes)
    assert firsts == sorted(qa.reset(ex)[1] for ex in qa.examples(6, seed=5)) and len(set(firsts)) == 6
