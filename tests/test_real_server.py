"""eval.py's API path against a real OpenAI-compatible server: `transformers serve` on 127.0.0.1, serving a tiny
Qwen3 model built offline and saved the way rl.py saves its checkpoints (common.save_checkpoint).

The model is a "bigram machine": attention and MLP outputs are zero, so the next token depends only on the current
one, and its output matrix maps each token of a fixed reply to the next. Greedy, it always answers
`<think>ok</think><move>5</move>`, on any turn, locally and through the server alike; at temperature 1 it wanders
off. Being a Qwen3, the server's reasoning parser strips its <think> block into `reasoning_content`.

Checked: sampling at temperature 1 gives different games (the saved generation config samples), a seed makes them
reproducible, greedy games through the server equal local ones with their <think> block (both environments), and
a wrong model name shows the server's own reason. Skipped when `transformers[serving]` is not installed.
"""
import json
import os
import sys

import pytest
import torch

from conftest import ROOT

import common  # noqa: E402
import env_verifiers as ev  # noqa: E402
import eval as eval_mod  # noqa: E402
from conftest import QWEN3_STYLE_TEMPLATE  # noqa: E402
from sample import HFPolicy  # noqa: E402

sys.path.insert(0, str(ROOT / "docs"))
from serve_check import served  # noqa: E402

pytest.importorskip("fastapi", reason="transformers[serving] is not installed (requirements-test.txt installs it)")
pytest.importorskip("uvicorn", reason="transformers[serving] is not installed (requirements-test.txt installs it)")

REPLY = "<think>ok</think><move>5</move>"


def bigram_machine(tiny_model_dir, out):
    """A Qwen3 model whose greedy reply to any conversation is REPLY, saved with common.save_checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM
    _, tok = common.load_model(tiny_model_dir, device="cpu")
    tok.add_tokens(["<think>", "</think>", "<move>", "</move>"])  # one token each, as <think> is in Qwen3
    tok.chat_template = QWEN3_STYLE_TEMPLATE
    prompt = tok.apply_chat_template([{"role": "user", "content": "u"}], add_generation_prompt=True, tokenize=False)
    chain = tok(prompt, add_special_tokens=False)["input_ids"][-1:] + tok.encode(REPLY, add_special_tokens=False) + [tok.eos_token_id]
    assert len(set(chain)) == len(chain), "each token of the reply must have one successor"
    config = AutoConfig.for_model("qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, vocab_size=len(tok), tie_word_embeddings=False,
                                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream carries the current token's embedding, unchanged
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight  # (V, d)
        head.zero_()
        for token, following in zip(chain, chain[1:]):  # logit of `following` after `token`: 0.6 * sqrt(d), about 5
            head[following] = 0.6 * emb[token] / emb[token].norm()
    common.save_checkpoint(model, tok, str(out), {"step": 0}, {})
    return str(out)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """`transformers serve` pinned to the bigram machine (docs/serve_check.served: offline, an empty hub cache);
    yields (base URL, model name, model directory)."""
    tmp = tmp_path_factory.mktemp("served")
    model_dir = bigram_machine(tiny_model_dir, tmp / "bigram")
    with served(model_dir, str(tmp / "server.log")) as base:
        yield base, model_dir, model_dir


def run_eval(monkeypatch, argv):
    monkeypatch.setattr(sys, "argv", ["eval.py", *argv])
    eval_mod.main()


def records(out):
    return [json.loads(line) for line in open(os.path.join(out, "rollouts.jsonl"))]


def test_saved_checkpoints_sample_when_served(server):
    _, _, model_dir = server
    config = json.load(open(os.path.join(model_dir, "generation_config.json")))
    assert config["do_sample"] is True and config["top_k"] == 0


@pytest.mark.parametrize("env_name", ["tictactoe", "reverse"])
def test_greedy_games_through_the_server_equal_local_ones_with_their_think(server, env_name, monkeypatch, tmp_path):
    """The server strips <think> into reasoning_content; the API policy rebuilds the reply, so every game (messages,
    rewards, metrics) equals the local greedy game."""
    base, name, model_dir = server
    # two games of up to 8 turns: each turn is a request to the server, about a second on a CPU
    run_eval(monkeypatch, ["--model", name, "--api_base", base, "--env", env_name, "-n", "2", "--max_new_tokens", "12",
                           "--out", str(tmp_path / "api"), "--show", "0"])
    model, tok = common.load_model(model_dir, device="cpu")
    env = common.load_env(env_name)
    _, local = eval_mod.evaluate(env, HFPolicy(model, tok, env.system_prompt, temp=0.0, max_new_tokens=12), 2, progress=False)
    served = records(tmp_path / "api")
    assert [r["messages"] for r in served] == [r["messages"] for r in local]
    assert [(r["rewards"], r["metrics"]) for r in served] == [(r["rewards"], r["metrics"]) for r in local]
    replies = [m["content"] for r in served for m in r["messages"] if m["role"] == "assistant"]
    assert replies and all(reply == REPLY for reply in replies)


def test_sampling_differs_at_temperature_one_and_a_seed_reproduces_it(server, monkeypatch, tmp_path):
    base, name, _ = server
    games = {}
    for run, seed in [("a", "1"), ("b", "1"), ("c", "2")]:
        run_eval(monkeypatch, ["--model", name, "--api_base", base, "--env", "reverse", "-n", "2", "-r", "6", "--temp", "1",
                               "--top_p", "0.95", "--max_new_tokens", "8", "--seed", seed, "--concurrency", "1", "--out", str(tmp_path / run),
                               "--show", "0"])
        games[run] = [r["messages"][-1]["content"] for r in records(tmp_path / run)]
    assert len(set(games["a"][:6])) >= 4 and len(set(games["a"][6:])) >= 4  # of 6 rollouts of one example
    assert games["a"] == games["b"]  # the same seed: the same games (one request at a time: transformers serve seeds
    # the process-wide generator, so concurrent requests would share it)
    assert games["a"] != games["c"]


def test_a_wrong_model_name_shows_the_servers_reason(server, monkeypatch, tmp_path):
    base, name, _ = server
    with pytest.raises(SystemExit) as e:
        run_eval(monkeypatch, ["--model", "no-such-model", "--api_base", base, "-n", "1", "--out", str(tmp_path / "o")])
    said = str(e.value)
    assert "API error 400" in said and f"Server is pinned to '{name}'; requested 'no-such-model'" in said, said
    assert "--model must be the name the server serves" in said and "\n" not in said


V1_JUDGE = {"task": {"judges": [{"id": "reference", "answer_field": "total", "choices": ["5", "4"],
                                  "sampling": {"temperature": 0.0, "max_tokens": 16}}]}}


def test_judges_ask_the_server_named_in_env_args(server, vf04_python):
    """A classic JudgeRubric (verifiers 0.3.1, this process's) and a v1 reference judge plugged into the Task's
    config (verifiers 0.4.0, in its venv), each in the guard's worker, ask the served model, whose verdict
    `<move>5</move>` is "yes" to both. A judge that fails (a model the server does not serve) costs its episode,
    an error; the next episode is scored again."""
    base, name, _ = server
    cases = [(ROOT / "tests" / "verifiers_envs" / "vf_judge.py", None, None, "judged"),
             (ROOT / "tests" / "vf_v1" / "v1_endless.py", V1_JUDGE, vf04_python, "reference")]
    for path, args, python, reward in cases:
        judged, failing = (ev.load_environment(path=str(path), args=args, python=python, judge_api_base=base,
                                               judge_model=model, timeout=30) for model in (name, "no-such-model"))
        try:
            for env, verdict in ((judged, 1.0), (failing, 0.0), (judged, 1.0)):
                state, _ = env.reset(env.examples(1, seed=2)[0])
                assert env.step(state, "<answer>8</answer>") is None
                assert env.rewards(state)[reward] == verdict, env.describe(state)
                assert env.metrics(state)["error"] == float(verdict == 0), env.describe(state)
        finally:
            judged.close()
            failing.close()
