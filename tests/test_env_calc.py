"""Tests for env_calc: the calculator (exact, bounded, never runs model text), the tool-call protocol, rewards,
the scripted players, a fuzz of adversarial replies and tool calls, and token-exact tool-using trajectories under
a Qwen3-style chat template (tool results rendered in a user turn as <tool_response>)."""
import builtins
import json
import random
import re
import time
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings, strategies as st

import common
import env_calc as calc
from conftest import FP32_LOGPROB_ATOL, QWEN3_STYLE_TEMPLATE
from policies import ScriptedPolicy
from sample import ChatTokens, HFPolicy, rollout

# Qwen3's own handling of the tool role: consecutive tool results share one user turn, each in <tool_response>
QWEN3_WITH_TOOLS = QWEN3_STYLE_TEMPLATE.replace(
    "{{ '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}",
    "{%- if m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}"
    "{{ '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- else -%}{{ '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}{%- endif -%}")
NO_TOOL_ROLE = ("{%- for m in messages -%}{%- if m['role'] not in ['system', 'user', 'assistant'] -%}"
                "{{ raise_exception('unknown role ' + m['role']) }}{%- endif -%}"
                "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor -%}"
                "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")


def call(expression, name="calculator"):
    return f'<tool_call>{json.dumps({"name": name, "arguments": {"expression": expression}})}</tool_call>'


# ----------------------------------------------------------------------------- the calculator

@pytest.mark.parametrize("expression, value", [
    ("2 + 3 * 4", 14), ("(2 + 3) * 4", 20), ("-7 * -6", 42), ("10 / 4", Fraction(5, 2)), ("0.1 + 0.2", Fraction(3, 10)),
    ("4821 * 37 - 906", 4821 * 37 - 906), ("+5", 5), ("  1  ", 1)])
def test_calculator_is_exact(expression, value):
    assert calc.calculate(expression) == value


@pytest.mark.parametrize("expression, error", [
    ("2 ** 10", "only numbers"), ("9 ** 9 ** 9", "only numbers"), ("__import__('os').system('echo hi')", "only numbers"),
    ("x + 1", "only numbers"), ("(1).__class__", "only numbers"), ("[1, 2]", "only numbers"), ("1 // 2", "only numbers"),
    ("lambda: 1", "only numbers"), ("'a' * 3", "only numbers"), ("True + 1", "only numbers"), ("1 / 0", "division by zero"),
    ("1 / (2 - 2)", "division by zero"), ("9" * 30, "too large"), ("1e308 * 10", "too large"), ("1e999", "too large"),
    ("99999999999 * 99999999999 * 99999999999", "too large"), ("1 +", "not an arithmetic expression"),
    ("1" * 201, "longer than 200"), ("(" * 150 + "1" + ")" * 150, "longer than 200"),
    (" + ".join(["1"] * 40), "more than 64 parts"), ("", "not an arithmetic expression"), (None, "must be a string")])
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, error):
    with pytest.raises(calc.CalcError, match=error):
        calc.calculate(expression)


def test_tool_call_errors_are_messages():
    assert calc.run_tool_call('{"name": "calculator", "arguments": {"expression": "6 * 7"}}') == "42"
    assert calc.run_tool_call('{"name": "calculator", "arguments": {"expression": "1 / 3"}}') == "0.333333"
    assert calc.run_tool_call("not json").startswith("error: the tool call must be JSON")
    assert calc.run_tool_call('{"name": "shell", "arguments": {}}') == "error: unknown tool 'shell'; the only tool is calculator"
    assert calc.run_tool_call('{"name": "calculator", "arguments": {"expression": "2**8"}}').startswith("error: only numbers")
    assert calc.run_tool_call("[" * 5000 + "]" * 5000).startswith("error:")  # too deep for json: refused, no RecursionError


# ----------------------------------------------------------------------------- the protocol and rewards

def play(env, example, replies):
    state, _ = env.reset(example)
    said = [env.step(state, r) for r in replies]
    return state, said


def test_one_call_then_the_answer():
    env = calc.load_environment()
    ex = {"seed": 1, "expression": "123 * 45", "answer": 5535}
    state, said = play(env, ex, [call("123 * 45"), "<answer>5535</answer>"])
    assert said == [{"role": "tool", "content": "5535"}, None] and state["done"]
    assert env.rewards(state) == {"correct": 1.0, "format": 1.0, "tool_calls": 1.0}
    assert env.metrics(state) == {"correct": 1.0, "used_tool": 1.0, "n_tool_calls": 1, "format": 1.0, "cut_off": 0.0}


def test_bad_replies_waste_turns_and_run_out():
    env = calc.load_environment(max_turns=3)
    ex = {"seed": 1, "expression": "123 * 45", "answer": 5535}
    state, said = play(env, ex, ["I think 5000", call("2 ** 99"), "<answer>5000</answer>"])
    assert said[0].startswith("Give the exact answer") and said[1] == {"role": "tool", "content": "error: only numbers, "
                                                                            "+ - * / and parentheses are allowed"}
    assert said[2] is None and env.rewards(state) == {"correct": 0.0, "format": 2 / 3, "tool_calls": 1.0}
    state, said = play(env, ex, [call("1 + 1")] * 3)
    assert said[-1] is None and state["done"] and state["answer"] is None and state["tool_calls"] == 2


def test_without_tools_a_call_is_refused_and_the_prompt_has_no_tool():
    env = calc.load_environment(tools=False)
    assert "calculator" not in env.system_prompt and "calculator" in calc.load_environment().system_prompt
    state, said = play(env, {"seed": 1, "expression": "123 * 45", "answer": 5535}, [call("123 * 45"), "<answer>5535</answer>"])
    assert said[0].startswith("No tools are available") and state["tool_calls"] == 0 and env.rewards(state)["correct"] == 1.0


def test_oracle_uses_the_tool_once_and_is_always_right_and_guessing_is_not():
    env = calc.load_environment()
    oracle = rollout(env, env.examples(200, seed=3), ScriptedPolicy(env, "oracle"), progress=False)
    assert all(r["metrics"] == {"correct": 1.0, "used_tool": 1.0, "n_tool_calls": 1, "format": 1.0, "cut_off": 0.0} for r in oracle)
    assert all(r["messages"][3]["role"] == "tool" for r in oracle)
    guess = rollout(env, env.examples(200, seed=3), ScriptedPolicy(env, "guess"), progress=False)
    assert sum(r["metrics"]["correct"] for r in guess) <= 10 and all(r["metrics"]["format"] == 1.0 for r in guess)


def test_examples_are_deterministic_and_exact():
    env = calc.load_environment()
    a, b = env.examples(100, seed=5), env.examples(100, seed=5)
    assert a == b and a != env.examples(100, seed=6)
    for ex in a:
        assert ex["answer"] == eval(ex["expression"], {"__builtins__": {}})  # the test's own check: trusted text
        assert abs(ex["answer"]) >= 1000  # not something to do at a glance


def test_bad_options():
    for kw, message in [({"tools": 1}, "tools=1: must be true or false"), ({"max_turns": 0}, "max_turns=0"),
                        ({"max_turns": True}, "max_turns=True")]:
        with pytest.raises(ValueError, match=message):
            calc.load_environment(**kw)
    with pytest.raises(ValueError, match="unknown scripted player 'minimax' for calc"):
        calc.load_environment().scripted_player("minimax")


# ----------------------------------------------------------------------------- fuzz: never raises, hangs or runs code

ADVERSARIAL = [
    "<tool_call>", "</tool_call>", "<tool_call></tool_call>", "<tool_call>null</tool_call>", "<tool_call>[]</tool_call>",
    '<tool_call>{"name": "calculator"}</tool_call>', '<tool_call>{"name": "calculator", "arguments": "1+1"}</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": {"expression": 7}}</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": {"expression": ["1"]}}</tool_call>',
    '<tool_call>{"name": {"x": 1}, "arguments": {}}</tool_call>', "<tool_call>" + "[" * 100000 + "</tool_call>",
    "<tool_call>" + '{"a":' * 3000 + "1" + "}" * 3000 + "</tool_call>", "<answer>" + "9" * 5000 + "</answer>",
    "<answer>-0</answer>", "<answer>١٢٣</answer>", "<answer>1e5</answer>", call("9" * 199), call("1e308*1e308"),
    call("(" * 99 + "1" + ")" * 99), call("1" + "*1" * 99), call("__import__('pathlib').Path('PWNED').touch()"),
    call("open('PWNED', 'w')"), call("exec('1')"), call("().__class__.__bases__[0].__subclasses__()"), call("9**9**9**9"),
    call("1/0"), call("\x00"), call("\u202e1+1"), call("１+１"), call("1_000 * 2"), call("0x10 + 1"), call("1j * 1j"),
    call("1", name="calculator\x00"), call("1", name="x" * 10000), "\ud800", None, 12345, b"<answer>1</answer>",
]


def exploding(*a, **kw):
    raise AssertionError("model text reached eval/exec")


def test_adversarial_replies_and_tool_calls(monkeypatch, tmp_path):
    """Hand-made attacks plus 10,000 random mixes of tags, JSON, numbers, operators and unicode: step never raises,
    each reply is handled in well under a second, and nothing is ever run (eval and exec are booby-trapped,
    and the files the attacks would create never appear)."""
    monkeypatch.chdir(tmp_path)
    for name in ("eval", "exec"):  # (compile stays: ast.parse parses with it, and parsing runs nothing)
        monkeypatch.setattr(builtins, name, exploding)
    env = calc.load_environment(max_turns=10_000)
    rng = random.Random(0)
    pieces = ["<tool_call>", "</tool_call>", "<answer>", "</answer>", "<think>", "</think>", '{"name": "calculator", ',
              '"arguments": {"expression": "', '"}}', "{", "}", "[", "]", '"', "\\", "9" * 40, "**", "*", "/", "+", "-",
              "(", ")", "1e308", "0", "7", "٣", "\u0000", "\ud83d\ude00", "lambda", "__import__", ".", ",", ":", " "]
    replies = ADVERSARIAL + ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 30))) for _ in range(10_000)]
    state, _ = env.reset({"seed": 0, "expression": "2 * 3", "answer": 6})
    worst = 0.0
    for reply in replies:
        if state["done"]:
            state, _ = env.reset({"seed": 0, "expression": "2 * 3", "answer": 6})
        t = time.perf_counter()
        msg = env.step(state, reply)
        worst = max(worst, time.perf_counter() - t)
        assert msg is None or isinstance(msg, str) or (msg["role"] == "tool" and isinstance(msg["content"], str))
        env.rewards(state), env.metrics(state)
    assert worst < 0.5 and not (tmp_path / "PWNED").exists()


@settings(derandomize=True, max_examples=300, deadline=None, database=None)
@given(st.text(max_size=120))
def test_any_expression_is_a_value_or_a_calc_error(text):
    try:
        value = calc.calculate(text)
    except calc.CalcError:
        return
    assert isinstance(value, Fraction)


# ----------------------------------------------------------------------------- token-exact tool trajectories

@pytest.fixture(scope="module")
def qwen3_tool_model(tiny_model_dir, tmp_path_factory):
    """The tiny scratch model with a Qwen3-style template that renders tool results in a user turn."""
    model, tok = common.load_model(tiny_model_dir, device="cpu")
    tok.chat_template = QWEN3_WITH_TOOLS
    return model, tok


def oracle_from_text(text):
    """The oracle's reply, read from the conversation's text: call on the question's expression, then answer the
    last tool result."""
    results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text)
    if results:
        return f"<think>The calculator says {results[-1]}.</think><answer>{results[-1]}</answer>"
    return call(re.findall(r"What is (.*?)\?", text)[-1])


def test_tool_results_render_in_the_templates_tool_role(qwen3_tool_model):
    _, tok = qwen3_tool_model
    chat = ChatTokens(tok, "S")
    assert chat.tool_role
    assert tok.decode(chat.turn_ids({"role": "tool", "content": "42"})) == \
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    tok2 = type(tok).from_pretrained(tok.name_or_path)
    tok2.chat_template = NO_TOOL_ROLE
    chat2 = ChatTokens(tok2, "S")  # a template that refuses the tool role: the result goes in as a user message
    assert not chat2.tool_role and chat2.turn_ids({"role": "tool", "content": "42"}) == chat2.turn_ids({"role": "user", "content": "42"})


def test_tool_using_trajectory_is_token_exact(qwen3_tool_model, monkeypatch):
    """A real HFPolicy rollout on env_calc under the Qwen3-style template, its replies forced to the oracle's: ids
    are prompt + each reply + the template's tool turn, token for token, SFT's encode_conversation lays out the
    same ids and mask, and the recorded logprobs are the model's own."""
    from test_sample import check_layout, force_replies, replay_logits
    model, tok = qwen3_tool_model
    env = calc.load_environment()
    policy = HFPolicy(model, tok, env.system_prompt, temp=1.0, max_new_tokens=160)  # a call: ~100 tokens here
    force_replies(monkeypatch, policy, oracle_from_text)
    for rec in rollout(env, env.examples(2, seed=0), policy, progress=False):
        assert [m["role"] for m in rec["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
        assert rec["metrics"] == {"correct": 1.0, "used_tool": 1.0, "n_tool_calls": 1, "format": 1.0, "cut_off": 0.0}
        check_layout(rec, policy.chat, tok, 160)
        assert policy.chat.encode_conversation(rec["messages"]) == (rec["ids"], rec["mask"])
        assert f"<tool_response>\n{rec['example']['answer']}\n</tool_response>" in tok.decode(rec["ids"])
        logp = torch.log_softmax(replay_logits(model, rec["ids"]), -1)
        pos = [t for t, m in enumerate(rec["mask"]) if m]
        torch.testing.assert_close(torch.tensor([rec["logprobs"][t] for t in pos]),
                                   logp[torch.tensor(pos) - 1, torch.tensor([rec["ids"][t] for t in pos])],
                                   atol=FP32_LOGPROB_ATOL, rtol=0)
