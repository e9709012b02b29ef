"""Verifiers v1 environments (verifiers 0.4.0; env_verifiers_v1.py) beside the classic ones (0.3.1, this
process's): the two generations cannot share one installation, so the v1 leg runs its guard workers in a venv of
its own, made here with uv (about 10 s the first time, then reused: .venv-vf04). Rewards equal Verifiers' own
(its trace's reward) and this file's own reading of the environments (weights included), @vf.stop and max_turns,
junk replies, what is refused and why, and rl.py / eval.py on a single-turn and a multi-turn environment."""
import difflib
import json
import re
import time

import pytest

import env_verifiers as ev
from conftest import ROOT, run_main, uv_venv
from sample import total_reward

VENV = ROOT / ".venv-vf04"
REVERSE = str(ROOT / "docs" / "vf_v1_reverse.py")
GUESS = str(ROOT / "tests" / "vf_v1" / "v1_guess.py")
CALC = str(ROOT / "tests" / "vf_v1" / "v1_calc.py")


@pytest.fixture(scope="module")
def python():
    """The venv with verifiers 0.4.0 (uv, from requirements-test.txt): made once, then reused."""
    return uv_venv(VENV, "verifiers", "0.4.0")


@pytest.fixture(scope="module")
def reverse(python):
    env = ev.load_environment(path=REVERSE, python=python, timeout=60)
    yield env
    env.close()


@pytest.fixture(scope="module")
def guess(python):
    env = ev.load_environment(path=GUESS, python=python, timeout=60)
    yield env
    env.close()


@pytest.fixture(scope="module")
def calc(python):
    env = ev.load_environment(path=CALC, python=python, timeout=60)
    yield env
    env.close()


def play(env, row, replies):
    """(rewards, metrics, what Verifiers said, the messages after each reply) of one episode."""
    state, first = env.reset({"seed": 0, "row": row})
    said = [first]
    for reply in replies:
        said.append(env.step(state, reply))
        if said[-1] is None:
            break
    return env.rewards(state), env.metrics(state), env.describe(state), said


def verifiers_reward(description):
    """Verifiers' own total: its trace's reward (the weighted sum of its Reward records)."""
    return float(re.search(r"reward (-?[\d.e-]+)", description).group(1))


def test_single_turn_rewards_are_verifiers_own_and_as_written(reverse):
    assert reverse.reward_weights == {"similarity": 1.0, "formatted": 0.2}
    assert reverse.system_prompt == "Reply with <answer>the reversed text</answer>."
    for row in range(6):
        state, first = reverse.reset({"seed": 0, "row": row})
        word = first.removeprefix("Reverse: ")
        reverse.step(state, "")  # ended: the single turn
        for reply in (f"<answer>{word[::-1]}</answer>", f"<answer>{word}</answer>", f"so: <answer>{word[1:]}</answer>",
                      word[::-1], ""):
            rewards, metrics, description, said = play(reverse, row, [reply])
            found = re.search(r"<answer>(.*?)</answer>", reply)
            similarity = difflib.SequenceMatcher(None, found.group(1) if found else "", word[::-1]).ratio()
            formatted = float(bool(re.fullmatch(r"\s*<answer>[^<]*</answer>\s*", reply)))
            assert said == [first, None]
            assert rewards == pytest.approx({"similarity": similarity, "formatted": formatted})
            assert total_reward(reverse, rewards) == pytest.approx(similarity + 0.2 * formatted)
            assert total_reward(reverse, rewards) == pytest.approx(verifiers_reward(description))
            assert metrics == {"n_reply_chars": len(reply.strip()), "cut_off": 0, "error": 0, "timeout": 0}


def test_v1_runs_on_verifiers_031_too():
    """0.3.1 (this process's verifiers) ships an earlier verifiers.v1 beside the classic API: the same file runs on
    it, in this process (no worker, no venv), with the same rewards."""
    env = ev.open_environment(path=REVERSE)
    for row in range(3):
        state, first = env.reset({"seed": 0, "row": row})
        word = first.removeprefix("Reverse: ")
        assert env.step(state, f"<answer>{word[:-1][::-1]}</answer>") is None
        similarity = difflib.SequenceMatcher(None, word[:-1][::-1], word[::-1]).ratio()
        assert env.rewards(state) == pytest.approx({"similarity": similarity, "formatted": 1.0})
        assert total_reward(env, env.rewards(state)) == pytest.approx(verifiers_reward(env.describe(state)))


def bisect(env, row, high=8):
    """A player that halves the range on each hint: its replies and the hints it was given."""
    state, _ = env.reset({"seed": 0, "row": row})
    low, top, replies, hints = 1, high, [], []
    while True:
        replies.append(str((low + top) // 2))
        hints.append(env.step(state, replies[-1]))
        if hints[-1] is None:
            return state, replies, hints
        low, top = (int(replies[-1]) + 1, top) if hints[-1] == "Higher." else (low, int(replies[-1]) - 1)


def test_multi_turn_plays_the_env_until_its_stop_or_the_turn_limit(guess):
    assert guess.max_turns == 5 and guess.reward_weights == {"found": 1.0, "turns_used": -0.1}
    for row in range(8):
        state, replies, hints = bisect(guess, row)
        rewards, metrics = guess.rewards(state), guess.metrics(state)
        assert "stop: guessed" in guess.describe(state) and len(replies) <= 4
        assert rewards == {"found": 1.0, "turns_used": len(replies)}
        assert metrics == {"n_guesses": len(replies), "cut_off": 0, "error": 0, "timeout": 0}
        assert total_reward(guess, rewards) == pytest.approx(verifiers_reward(guess.describe(state)))
    rewards, metrics, description, said = play(guess, 0, ["0", "zero", "9", "0", "0", "0", "0"])
    assert said[1:] == ["Higher.", "Not a number.", "Lower.", "Higher.", None]  # cut off at the 5th reply
    assert "stop: max_turns" in description and metrics["cut_off"] == 1 and metrics["error"] == 0
    assert rewards == {"found": 0.0, "turns_used": 5.0}
    assert total_reward(guess, rewards) == pytest.approx(-0.5) == verifiers_reward(description)


def call(expression, name="calculator_evaluate"):
    return f'<tool_call>{{"name": "{name}", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def calc_episodes(env):
    """Scripted episodes of v1_calc, two at a time (interleaved): [(replies, what Verifiers said, rewards, metrics,
    its description)]
    and what the file's rule gives: correct answer, the number of the tool's successful calls."""
    played, rule = [], []
    for row in range(0, 6, 2):
        states = [env.reset({"seed": 0, "row": r}) for r in (row, row + 1)]
        for r, (state, first) in zip((row, row + 1), states):
            expression, value = first.removeprefix("Compute ").removesuffix("."), v1_calc_value(first)
            replies = [[call(expression), f"<answer>{value}</answer>"],
                       [call("2**99") + " " + call("1+1", "nope"), f"<answer>{value + 1}</answer>"],
                       ['<tool_call>{"name": "calculator_evaluate", "arguments": "1+1"}</tool_call>',
                        "<answer>2</answer>"],
                       [call("1") + call(expression), "<answer>" + str(value) + "</answer>"],
                       ["<tool_call>{bad json</tool_call> <answer>3</answer>"],
                       [call("7*6"), call(expression), f"so <answer>{value}</answer>"]][r]
            said = [env.step(state, reply) for reply in replies]
            played.append((replies, [first] + said, env.rewards(state), env.metrics(state), env.describe(state)))
            calls = {0: 1, 1: 0, 2: 0, 3: 2, 4: 0, 5: 2}[r]
            rule.append(({"correct": float(r in (0, 3, 5)), "tool_calls": float(calls)}, calls))
    return played, rule


def v1_calc_value(text):
    """The value of v1_calc's "Compute A * B - C."."""
    a, b, c = map(int, re.findall(r"\d+", text))
    return a * b - c


def test_tools_run_in_the_worker_with_verifiers_own_state_and_rewards(calc):
    """A Task's Toolset (tests/vf_v1/v1_calc.py: a server per episode in Verifiers, here in the worker) is offered
    to the policy as Verifiers' chat program offers it; a reply's <tool_call> blocks call it and each result is a
    tool message; a tool that raises answers with its error, an unknown tool or bad arguments as the chat program
    answers them, a malformed block stays text; the tool's writes to the episode's State reach the Task's reward
    and metric through Verifiers' state channel. Rewards are the file's rule, and Verifiers' own total."""
    assert calc.tools == [{"type": "function", "function": {
        "name": "calculator_evaluate", "description": "Evaluate an arithmetic expression of integers with +, - and *.",
        "parameters": {"properties": {"expression": {"title": "Expression", "type": "string"}},
                       "required": ["expression"], "title": "evaluateArguments", "type": "object"}}}]
    assert calc.reward_weights == {"correct": 1.0, "tool_calls": -0.05}
    played, rule = calc_episodes(calc)
    for (replies, said, rewards, metrics, description), (want, calls) in zip(played, rule):
        assert rewards == want and metrics == {"n_calls": calls, "cut_off": 0, "error": 0, "timeout": 0}, replies
        assert total_reward(calc, rewards) == pytest.approx(verifiers_reward(description))
        assert said[-1] is None and all(isinstance(m, list) and {x["role"] for x in m} == {"tool"} for m in said[1:-1])
    (_, said0, *_), (_, said1, *_), (_, said2, *_) = played[:3]
    assert said0[1] == [{"role": "tool", "content": str(v1_calc_value(said0[0]))}]
    assert said1[1] == [{"role": "tool", "content": "Error executing tool evaluate: only integers of at most 6 digits, "
                                                    "+, - and * are allowed"},
                        {"role": "tool", "content": "error: unknown tool 'nope'"}]
    assert said2[1][0]["content"].startswith("error: invalid JSON in tool arguments")
    assert played[4][1][1:] == [None]  # the malformed block is text: the episode's answer


JUNK = ["", " ", "\x00\x01", "<answer>", "</answer><answer>", "<answer>" * 1000, "9" * 5000, "-" * 100_000,
        "🙂" * 300, '<tool_call>{"name": "x", "arguments": {}}</tool_call>', "<tool_call>{bad json</tool_call>",
        "\ud800", "null", "{}", "[]", "\n" * 500, "<|im_end|>", "{{ system }}", "%s %d", "Higher."]


def test_junk_replies_never_raise_and_score_as_replies(reverse, guess, calc):
    """Junk as replies, and on the tool environment as tool calls too (three, then an answer)."""
    junk_calls = [call(reply) for reply in JUNK[:6]] + [call("1", name="calculator_" + "x" * 5000)]
    for env in (reverse, guess, calc):
        for i, reply in enumerate(JUNK + (junk_calls if env is calc else [])):
            rewards, metrics, description, said = play(env, i % 8, [reply] * 3 + ["<answer>1</answer>"] * 3)
            assert said[-1] is None and metrics["error"] == 0, description
            assert set(rewards) == set(env.reward_weights)


def test_a_killed_worker_is_back_without_importing_verifiers_again(reverse):
    """The guard kills a worker whose call hangs where no signal reaches; the next call starts another, forked
    from the zygote that imported verifiers.v1 once: the environment's own load, not the import (10-30 s of a
    fresh interpreter on this machine)."""
    import guard
    state, _ = reverse.reset({"seed": 0, "row": 0})
    reverse._kill()  # what a hang in C ends in
    start = time.perf_counter()
    _, first = reverse.reset({"seed": 0, "row": 1})
    seconds = time.perf_counter() - start
    assert isinstance(reverse.proc, guard.Forked) and first
    assert seconds < 8, f"a restart took {seconds:.1f} s"
    assert reverse.step(state, "<answer>x</answer>") is None and reverse.metrics(state)["error"] == 0  # rebuilt


def test_what_cannot_run_is_refused_with_the_reason(python, tmp_path):
    """Each a v1 environment a user may bring: refused at load by what it would need, in one line (a ValueError
    from the guard's worker); then a Taskset's shared tool server."""
    head = "import verifiers.v1 as vf\n\nclass D(vf.TaskData):\n    pass\n\n"
    task = "class T(vf.Task[D]):\n    @vf.reward\n    async def r(self, trace) -> float:\n        return 1.0\n\n"
    tasks = "class S(vf.Taskset[T, C]):\n    def load(self):\n        return [T(D(prompt={prompt}))]\n\n"
    tools = ("class Tools(vf.Toolset[vf.ToolsetConfig]):\n    @vf.tool\n    def echo(self, text: str) -> str:\n"
             "        return text\n\nclass T2(T):\n    @classmethod\n    def toolsets(cls, config):\n"
             "        return [Tools({config})]\n\n")
    with_tools = ("class C(vf.TasksetConfig):\n    pass\n\n" +
                        tasks.replace("T,", "T2,").replace("[T(", "[T2(").format(prompt="'hi'") + "__all__ = ['S']\n")
    cases = {
        "bash": ("class C(vf.TasksetConfig):\n    pass\n\n" + tasks.format(prompt="'hi'") +
                 "class EC(vf.EnvConfig):\n    agent: vf.AgentConfig = vf.AgentConfig(harness={'id': 'bash'})\n\n"
                 "class E(vf.Env[EC]):\n    async def run(self, task, agents):\n        await agents.agent.run(task)\n\n"
                 "__all__ = ['S', 'E']\n", "pins the 'bash' harness"),
        "seats": ("class C(vf.TasksetConfig):\n    pass\n\n" + tasks.format(prompt="'hi'") +
                  "class EC(vf.EnvConfig):\n    a: vf.AgentConfig = vf.AgentConfig()\n"
                  "    b: vf.AgentConfig = vf.AgentConfig()\n\n"
                  "class E(vf.Env[EC]):\n    async def run(self, task, agents):\n        await agents.a.run(task)\n\n"
                  "__all__ = ['S', 'E']\n", "2 seats"),
        "remote_tools": (tools.format(config="vf.ToolsetConfig(url='http://tools.invalid/mcp')") + with_tools,
                         "is a remote one (http://tools.invalid/mcp)"),
        "sandboxed_tools": (tools.format(config="vf.ToolsetConfig(runtime=vf.DockerConfig())") + with_tools,
                            "runs in a sandbox or container"),
        "messages": ("class C(vf.TasksetConfig):\n    pass\n\n" +
                     tasks.format(prompt="[vf.UserMessage(content='hi')]") + "__all__ = ['S']\n", "not text"),
        "setting": ("class C(vf.TasksetConfig):\n    pass\n\n" + tasks.format(prompt="'hi'") + "__all__ = ['S']\n",
                    "do not validate"),
    }
    for name, (source, why) in cases.items():
        (tmp_path / f"refused_{name}.py").write_text(head + task + source)
        args = {"no_such_setting": 1} if name == "setting" else None
        with pytest.raises(ValueError) as refused:
            ev.load_environment(path=str(tmp_path / f"refused_{name}.py"), args=args, python=python)
        assert why in str(refused.value), (name, str(refused.value))
    # a Taskset's Toolset: one server for the run, each episode's State its own (two episodes interleaved)
    env = ev.load_environment(path=CALC, args={"task": {"shared": True}}, python=python)
    a, b = (env.reset({"seed": 0, "row": row})[0] for row in (0, 1))
    env.step(a, call("1+1") * 2)
    env.step(b, call("2"))
    assert env.step(a, "done") is None and env.step(b, "done") is None
    assert [env.metrics(a)["n_calls"], env.metrics(b)["n_calls"]] == [2.0, 1.0]
    env.close()


def test_rl_and_eval_run_on_v1_environments(python, tiny_model_dir, tmp_path, torch_single_thread, reverse):
    """rl.py 2 steps on each (single-turn, multi-turn, a tool; its last step evaluates); eval.py on each: its
    episodes are the rows our own instance deals for the same seed (the same tasks in every process)."""
    for name, path in (("reverse", REVERSE), ("guess", GUESS), ("calc", CALC)):
        env_args = json.dumps({"path": path, "python": python})
        out = run_main("rl", ["--model", tiny_model_dir, "--env", "verifiers", "--env_args", env_args, "--batch", "4",
                              "--group", "2", "--steps", "2", "--max_new_tokens", "8", "--eval_every", "0",
                              "--eval_n", "2", "--out", str(tmp_path / name / "rl")])
        assert "step 2 |" in out and "step 2 | eval_" in out
        out = run_main("eval", ["--model", tiny_model_dir, "--env", "verifiers", "--env_args", env_args, "-n", "3",
                                "--max_new_tokens", "8", "--seed", "5", "--out", str(tmp_path / name / "eval")])
        assert "error_rate" in out and "reward" in out
        assert any(f"mean_{m}" in out for m in ("reply_chars", "guesses", "calls"))
    episodes = [json.loads(line) for line in open(next((tmp_path / "reverse" / "eval").rglob("*.jsonl")))]
    firsts = sorted(e["messages"][1]["content"] for e in episodes if "messages" in e)
    ours = sorted(reverse.reset(ex)[1] for ex in reverse.examples(3, seed=5))
    assert firsts == ours and len(ours) == 3
