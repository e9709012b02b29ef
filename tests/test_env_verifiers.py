"""Verifiers environments as they are (env_verifiers.py, verifiers==0.3.1 from requirements-test.txt): rewards
equal to Verifiers' own scoring on the same episodes (tests/verifiers_envs/reference.py runs Verifiers' own
run_rollout with a scripted client), text tool calls, junk replies, examples the same in two processes, num_groups,
what is refused, our signal handlers, and rl.py / eval.py on each kind of environment."""
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

import env_verifiers as ev
from conftest import ROOT, run_main
from sample import total_reward

ENVS = ROOT / "tests" / "verifiers_envs"
sys.path.insert(0, str(ENVS))


def inner(name, **args):
    """The adapter in this process (no guard): rewards and Verifiers' state can be compared directly."""
    return ev.open_environment(path=str(ENVS / f"{name}.py"), args=args)


def play(env, row, replies):
    """(rewards, metrics, messages) of one episode through the adapter, given its replies."""
    state, first = env.reset({"seed": 0, "row": row})
    messages = [first]
    for reply in replies:
        msg = env.step(state, reply)
        if msg is None:
            break
        messages.append(msg)
    return env.rewards(state), env.metrics(state), messages


def tool_text(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def tool_struct(*calls, content=""):
    """The same calls as Verifiers receives them from a server's tool parser."""
    return {"content": content, "tool_calls": [{"id": f"call_{i}", "name": n, "arguments": json.dumps(a)}
                                               for i, (n, a) in enumerate(calls)]}


def reference_score_sync(*args):
    """reference.py's (imported here, not at collection: verifiers takes seconds to import)."""
    from reference import reference_score_sync
    return reference_score_sync(*args)


def assert_same_as_verifiers(env, row, replies, reference_replies=None):
    rewards, metrics, _ = play(env, row, replies)
    ref = reference_score_sync(env.env, env.rows[row], reference_replies or replies)
    assert set(rewards) == set(env.reward_weights)
    assert rewards == {k: ref["metrics"][k] for k in rewards}
    assert {k: metrics[f"n_{k}"] for k in env.metric_names} == {k: ref["metrics"][k] for k in env.metric_names}
    assert math.isclose(total_reward(env, rewards), ref["reward"], abs_tol=1e-9)
    assert metrics["error"] == 0
    return rewards, ref


SINGLE = ["<think>\nadd them\n</think>\n<answer>\n{}\n</answer>", "the answer is 5", "<answer>{}</answer>",
          "<answer>0</answer><answer>", "<think>unclosed"]


def test_single_turn_rewards_equal_verifiers_own_scoring():
    env = inner("vf_single")
    assert env.max_turns == 1 and env.reward_weights == {"correct_answer": 1.0, "format_reward_func": 0.2}
    assert "reply_length" in env.metric_names
    totals = set()
    for row in range(4):
        answer = env.rows[row]["answer"]
        for reply in SINGLE:
            rewards, ref = assert_same_as_verifiers(env, row, [reply.format(answer)])
            totals.add(round(ref["reward"], 6))
    assert len(totals) >= 3  # the replies score differently: the comparison can tell a dropped function


def test_multi_turn_game_rewards_equal_verifiers_own_scoring():
    env = inner("vf_game", max_turns=6)
    assert env.reward_weights == {"win": 1.0, "format_reward_func": 0.2, "invalid_guesses": 1.0}
    episodes = [[f"<guess>{g}</guess>" for g in range(1, 8)], ["junk", "more junk", "<guess>99</guess>", "x"],
                ["<guess>10</guess>", "<guess>5</guess>", "<guess>3</guess>", "<guess>7</guess>", "<guess>6</guess>",
                 "<guess>8</guess>"]]
    for row in range(3):
        for replies in episodes:
            assert_same_as_verifiers(env, row, replies)
    # a bisecting player wins: the final message ends the episode before max_turns
    rewards, metrics, messages = play(env, 0, [f"<guess>{g}</guess>" for g in bisect_guesses(env, 0)])
    assert rewards["win"] == 1 and len(messages) < env.max_turns


def bisect_guesses(env, row):
    secret_seed = env.rows[row]["info"]
    state, _ = env.reset({"seed": 0, "row": row})
    lo, hi, guesses = 1, secret_seed["high"], []
    while True:
        guess = (lo + hi) // 2
        guesses.append(guess)
        msg = env.step(state, f"<guess>{guess}</guess>")
        if msg is None or "Higher" not in msg and "Lower" not in msg:
            return guesses
        lo, hi = (guess + 1, hi) if "Higher" in msg else (lo, guess - 1)


def test_tool_calls_written_as_text_run_verifiers_tools():
    env = inner("vf_tools")
    assert [t["function"]["name"] for t in env.tools] == ["add", "multiply"]
    row = env.rows[0]["info"]
    a, b, c = row["a"], row["b"], row["c"]
    answer = f"<answer>{(a + b) * c}</answer>"
    # one call a turn, two calls in one turn (one tool message each), a malformed call, an unknown tool
    text = [[tool_text("add", a=a, b=b), tool_text("multiply", a=a + b, b=c), answer],
            [tool_text("add", a=a, b=b) + tool_text("multiply", a=3, b=4), answer],
            ['<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', answer],
            [tool_text("divide", a=1, b=2), "<answer>0</answer>"]]
    struct = [[tool_struct(("add", {"a": a, "b": b})), tool_struct(("multiply", {"a": a + b, "b": c})), answer],
              [tool_struct(("add", {"a": a, "b": b}), ("multiply", {"a": 3, "b": 4})), answer],
              ['<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', answer],
              [tool_struct(("divide", {"a": 1, "b": 2})), "<answer>0</answer>"]]
    for replies, ref_replies in zip(text, struct):
        assert_same_as_verifiers(env, 0, replies, ref_replies)
    rewards, metrics, messages = play(env, 0, text[1])
    assert rewards["correct_answer"] == 1 and metrics["n_total_tool_calls"] == 2
    assert [m["role"] for m in messages[1]] == ["tool", "tool"] and messages[1][1]["content"] == "12"
    _, _, messages = play(env, 0, text[0])
    assert messages[1] == {"role": "tool", "content": str(a + b)}


def test_stateful_tool_environment():
    env = inner("vf_stateful_tools")
    row = env.rows[0]
    calls = [tool_text("hidden_number", index=i) for i in range(len(row["info"]["numbers"]))]
    replies = calls + [f"<answer>{row['answer']}</answer>"]
    ref_replies = [tool_struct(("hidden_number", {"index": i})) for i in range(len(calls))] + replies[-1:]
    rewards, ref = assert_same_as_verifiers(env, 0, replies, ref_replies)
    assert rewards["correct_sum"] == 1


def test_reward_weights_come_from_the_rubric():
    """Planted faults the comparison must catch: a dropped function, a wrong weight."""
    env = inner("vf_game", max_turns=3)
    rewards, _, _ = play(env, 0, ["junk", "<guess>3</guess>", "<guess>4</guess>"])
    ref = reference_score_sync(env.env, env.rows[0], ["junk", "<guess>3</guess>", "<guess>4</guess>"])
    dropped = {k: v for k, v in rewards.items() if k != "invalid_guesses"}
    assert not math.isclose(total_reward(env, dropped), ref["reward"])
    env.reward_weights["format_reward_func"] = 1.0
    assert not math.isclose(total_reward(env, rewards), ref["reward"])


def test_junk_replies_never_raise_through_the_guard():
    import random
    env = ev.load_environment(path=str(ENVS / "vf_tools.py"), timeout=20)
    rng = random.Random(0)
    pieces = ["<tool_call>", "</tool_call>", '{"name": "add", "arguments": {"a": 1e999, "b": []}}', "<answer>",
              "</answer>", "\x00", "🙂" * 50, '{"name": ' * 200, "9" * 5000, '"arguments": null', ""]
    for episode in range(30):
        state, _ = env.reset(env.examples(1, seed=episode)[0])
        for _ in range(env.max_turns):
            reply = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 6)))
            if env.step(state, reply) is None:
                break
        assert set(env.rewards(state)) == set(env.reward_names)
        assert all(math.isfinite(v) for v in env.rewards(state).values())
    env.close()


COURSE_STYLE = textwrap.dedent('''
    import random
    import verifiers as vf
    from datasets import Dataset

    def load_environment(num_examples=50):
        rows = [{"question": f"Say {random.randint(0, 10**6)}", "answer": "x"} for _ in range(num_examples)]

        def echo(completion, answer, **kwargs):
            return 1.0
        return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), system_prompt="Echo.", rubric=vf.Rubric(funcs=[echo]))
''')


def test_examples_are_the_same_in_two_processes(tmp_path):
    """A dataset built from the unseeded global `random` (as the course's tic-tac-toe builds it)."""
    path = tmp_path / "course_style.py"
    path.write_text(COURSE_STYLE)
    script = ("import sys, json; sys.path.insert(0, sys.argv[1]); import env_verifiers as ev\n"
              f"env = ev.load_environment(path={str(path)!r})\n"
              "print(json.dumps([env.reset(x)[1] for x in env.examples(5, seed=3)]))")
    # one fresh interpreter against this test process (their hash seeds differ: PYTHONHASHSEED=0 there)
    out = subprocess.run([sys.executable, "-c", script, str(ROOT)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONHASHSEED": "0"})
    assert out.returncode == 0, out.stderr[-2000:]
    env = ev.load_environment(path=str(path))
    firsts = [env.reset(x)[1] for x in env.examples(5, seed=3)]
    env.close()
    assert firsts == json.loads(out.stdout.strip().splitlines()[-1]) and len(set(firsts)) == 5


def test_num_groups_buckets_every_step():
    env = ev.open_environment(path=str(ENVS / "vf_game.py"), num_groups=4)
    assert env.env.rubric is not None
    for seed in range(5):
        rows = env.examples(8, seed)
        assert [env.rows[r["row"]]["info"]["bucket"] for r in rows] == [0, 1, 2, 3] * 2
    assert len({json.dumps(env.examples(8, s)) for s in range(5)}) == 5


REFUSED = {
    "group reward": ("def g(completions, **kw):\n    return [1.0 for _ in completions]\n",
                     "rubric=vf.Rubric(funcs=[g])",
                     "group reward functions"),
    "few-shot": ("def g(completion, **kw):\n    return 1.0\n", "rubric=vf.Rubric(funcs=[g]), few_shot=[{'role': "
                 "'user', 'content': 'a'}, {'role': 'assistant', 'content': 'b'}]", "few-shot"),
    "judge": ("", "rubric=vf.JudgeRubric()", "its rubric asks a judge model: name one in env_args: judge_api_base"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_cannot_run_is_refused_at_load(tmp_path, monkeypatch, case):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)  # a JudgeRubric builds its client when it is made
    head, build, why = REFUSED[case]
    path = tmp_path / "refused.py"
    path.write_text("import verifiers as vf\nfrom datasets import Dataset\n" + head +
                    "def load_environment():\n    return vf.SingleTurnEnv(dataset=Dataset.from_list([{'question': "
                    f"'q', 'answer': 'a'}}]), {build})\n")
    with pytest.raises(ValueError, match=why):
        ev.open_environment(path=str(path))


@pytest.mark.parametrize("variant, what", [("is_completed", r"is_completed\(messages, state\)"),
                                           ("tuple", r"env_response returning \(messages, state\)")])
def test_an_environment_on_the_api_before_0_1_8_is_refused_in_one_line(variant, what):
    """Through load_env, as eval.py and rl.py load it: a SystemExit whose one line names the API and what
    to change (the ported environment loads)."""
    from common import load_env
    with pytest.raises(SystemExit) as e:
        load_env("verifiers", {"path": str(ENVS / "vf_old_api.py"), "args": {"variant": variant}})
    message = str(e.value)
    assert "\n" not in message and re.search(f"verifiers 0.1.7 and older \\({what}\\).*port it", message)
    assert ev.open_environment(path=str(ENVS / "vf_old_api.py"), args={"variant": "ported"}).rows


def test_a_judge_is_named_by_its_server_and_model_and_its_key_must_be_set(monkeypatch):
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    for api_base, model, key_var, why in (("localhost:8000/v1", "m", None, "a judge is an OpenAI-compatible"),
                                          ("http://localhost:8000/v1", None, None, "a judge is an OpenAI-compatible"),
                                          ("http://localhost:8000/v1", "m", "NO_SUCH_KEY_VAR", "no such environment")):
        with pytest.raises(ValueError, match=why):
            ev.named_judge(api_base, model, key_var, 30.0)
    monkeypatch.setenv("JUDGE_KEY", "k")
    judge = ev.named_judge("http://localhost:8000/v1", "m", "JUDGE_KEY", 30.0)
    assert judge == {"base_url": "http://localhost:8000/v1", "model": "m", "api_key_var": "JUDGE_KEY", "timeout": 30.0}
    assert ev.judge_client(judge).api_key == "k" and ev.named_judge(None, None, None, 30.0) is None


def test_verifiers_without_the_classic_api_says_which_version(monkeypatch):
    import types
    v1_only = types.ModuleType("verifiers")
    v1_only.__version__ = "0.4.0"
    monkeypatch.setitem(sys.modules, "verifiers", v1_only)
    monkeypatch.setitem(sys.modules, "verifiers.legacy", None)
    with pytest.raises(ValueError, match=r"0\.4\.0 keeps only its new v1 API.*verifiers>=0\.1\.14,<0\.4"):
        ev.import_verifiers()


def test_loading_keeps_our_signal_handlers():
    def ours(*_):
        return None
    before = signal.signal(signal.SIGTERM, ours)
    try:
        inner("vf_single")
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, before)


def test_rl_and_eval_run_on_each_kind_of_environment(tiny_model_dir, tmp_path, torch_single_thread):
    """rl.py on each kind (its last step evaluates, as eval.py does); eval.py's own command line on the tools
    environment, the kind with the most moving parts."""
    for name in ("vf_single", "vf_game", "vf_tools"):
        env_args = json.dumps({"path": str(ENVS / f"{name}.py")})
        out = run_main("rl", ["--model", tiny_model_dir, "--env", "verifiers", "--env_args", env_args, "--batch", "4",
                                 "--group", "2", "--steps", "2", "--max_new_tokens", "8", "--eval_every", "0",
                                 "--eval_n", "2", "--out", str(tmp_path / name / "rl")])
        assert "step 2 |" in out and "step 2 | eval_" in out
    out = run_main("eval", ["--model", str(tmp_path / name / "rl"), "--env", "verifiers", "--env_args", env_args,
                            "-n", "2", "--max_new_tokens", "8", "--out", str(tmp_path / name / "eval")])
    assert "error_rate" in out and "reward" in out


def test_a_reward_function_that_raises_is_an_error_not_a_silent_zero(tmp_path):
    path = tmp_path / "raising.py"
    path.write_text(textwrap.dedent('''
        import verifiers as vf
        from datasets import Dataset

        def fine(completion, **kw):
            return 0.5

        def broken(completion, **kw):
            raise RuntimeError("the judge is unreachable")

        def load_environment():
            rows = [{"question": "q", "answer": "a"}]
            return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[fine, broken]))
    '''))
    env = ev.open_environment(path=str(path))
    rewards, metrics, _ = play(env, 0, ["anything"])
    assert rewards == {"fine": 0.5, "broken": 0.0} and metrics["error"] == 1


TOOLS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                  "{% if m['role'] == 'system' and tools %}\nTools: {{ tools | tojson }}{% endif %}<|im_end|>\n"
                  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tools_go_through_the_chat_template_and_tool_results_are_one_message_each(tiny_model):
    """The trajectory built turn by turn (sample.ChatTokens) is the template's own rendering of the whole
    conversation, with the tools offered and two tool results in one turn."""
    import copy

    from sample import ChatTokens
    tok = copy.deepcopy(tiny_model[1])
    tok.chat_template = TOOLS_TEMPLATE
    env = inner("vf_tools")
    chat = ChatTokens(tok, env.system_prompt, env.tools)
    a, b = env.rows[0]["info"]["a"], env.rows[0]["info"]["b"]
    state, first = env.reset({"seed": 0, "row": 0})
    reply = tool_text("add", a=a, b=b) + tool_text("multiply", a=2, b=3)
    results = env.step(state, reply)
    assert results == [{"role": "tool", "content": str(a + b)}, {"role": "tool", "content": "6"}]
    messages = [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": first},
                {"role": "assistant", "content": reply}, *results]
    ids = chat.prompt_ids(messages[:2]) + chat.reply_ids(reply) + chat.turn_ids(results)
    whole = tok(chat.render(messages, add_generation_prompt=True), add_special_tokens=False).input_ids
    assert ids == whole and "Multiply two integers" in tok.decode(chat.prompt_ids(messages[:2]))
    assert chat.encode_conversation(messages)[0] == ids
