"""Evaluate a trained checkpoint through `transformers serve` and locally, and compare (docs/SERVERS.md).

    python docs/serve_check.py --model out/speedrun/rl_best --out out/serve_check

Serves two copies of the checkpoint in turn, each saved the way this project saves checkpoints now (the generation
config samples when asked): the model as it is (a Llama) and the same weights as a Qwen2 model, which makes the
server's reasoning parser move <think> into `reasoning_content`. For each, against the random opponent:
  - sampled games at temperature 1 (-n 10 -r 6): distinct games per example, also through a copy saved with the
    old generation config (no do_sample), which a server decodes greedily;
  - greedy games (-n 200): format and win rates through the server and locally, and how many games are equal;
    a game that differs is checked for a reply whose sampled tokens are not the tokenizer's encoding of its text
    before the first difference (the server re-tokenizes text; the local rollout keeps tokens);
  - a request with a wrong model name, and the error eval.py prints.
Writes OUT/serve_check.json. Needs `pip install "transformers[serving]"`; offline.
"""
import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

import common  # noqa: E402
import eval as eval_mod  # noqa: E402
from env_tictactoe import EVAL_SETTINGS  # noqa: E402
from policies import APIPolicy  # noqa: E402
from sample import HFPolicy  # noqa: E402


def as_qwen2(model, out):
    """The same weights in a Qwen2ForCausalLM (zero q/k/v biases): a "Qwen-family" model for the server."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    c = model.config
    q = Qwen2ForCausalLM(Qwen2Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                                     num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                                     num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
                                     rms_norm_eps=c.rms_norm_eps, rope_parameters=c.rope_parameters,
                                     tie_word_embeddings=c.tie_word_embeddings, eos_token_id=c.eos_token_id,
                                     pad_token_id=c.pad_token_id, bos_token_id=None))
    missing = q.load_state_dict(model.state_dict(), strict=False).missing_keys
    assert all(k.endswith("_proj.bias") for k in missing), missing
    with torch.no_grad():
        for k in missing:
            q.get_parameter(k).zero_()
    q.generation_config = model.generation_config
    q.save_pretrained(out)
    return q


@contextlib.contextmanager
def served(model_dir, log_path):
    """`transformers serve` pinned to model_dir on a free port of 127.0.0.1, offline, with an empty hub cache beside
    log_path; yields the base URL once /health answers (RuntimeError with the log's end if it never does)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HOME": os.path.join(os.path.dirname(log_path), "hf_home"), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", "from transformers.cli.transformers import main; main()", "serve",
                                 "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", model_dir],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            up = False
            for _ in range(240):  # 60 s, unless the server dies first
                if proc.poll() is not None:
                    break
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                    up = True
                    break
                except OSError:
                    time.sleep(0.25)
            if not up:
                raise RuntimeError(f"transformers serve did not come up: {open(log_path).read()[-2000:]}")
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def non_canonical_turns(rec, tok):
    """Indices of the assistant turns whose sampled tokens differ from the tokenizer's encoding of the reply's text."""
    runs, run = [], []
    for t, m in zip(rec["ids"], rec["mask"]):
        if m:
            run.append(t)
        elif run:
            runs.append(run)
            run = []
    runs += [run] if run else []
    replies = [m["content"] for m in rec["messages"] if m["role"] == "assistant"]
    return [i for i, (toks, text) in enumerate(zip(runs, replies))
            if [t for t in toks if t != tok.eos_token_id] != tok.encode(text, add_special_tokens=False)]


def compare(local, api, tok):
    equal = after_non_canonical = unexplained = 0
    for lr, ar in zip(local, api):
        la = [m["content"] for m in lr["messages"] if m["role"] == "assistant"]
        aa = [m["content"] for m in ar["messages"] if m["role"] == "assistant"]
        if lr["messages"] == ar["messages"]:
            equal += 1
            continue
        first = next((i for i, (x, y) in enumerate(zip(la, aa)) if x != y), min(len(la), len(aa)))
        if any(i < first for i in non_canonical_turns(lr, tok)):
            after_non_canonical += 1
        else:
            unexplained += 1
    return {"games": len(local), "equal": equal, "differ_after_non_canonical_reply": after_non_canonical,
            "differ_otherwise": unexplained}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a checkpoint this project trained (save_pretrained directory)")
    p.add_argument("--out", default="out/serve_check", help="work directory: the served copies, logs, serve_check.json")
    p.add_argument("-n", type=int, default=200, help="greedy games per copy")
    p.add_argument("--env_args", default='{"show_cells": true}', help="tictactoe options the model was trained with "
                   "(the speedrun's); the random opponent is added")
    p.add_argument("--max_new_tokens", type=int, default=48, help="max tokens per reply (the speedrun's evaluation)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model, tok = common.load_model(args.model, device="cpu")
    old = os.path.join(args.out, "old_generation_config")
    shutil.rmtree(old, ignore_errors=True)
    shutil.copytree(args.model, old)
    with open(os.path.join(old, "generation_config.json"), "w") as f:  # as checkpoints were saved before
        json.dump({"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}, f)
    common.samples_when_served(model)
    copies = {"llama": os.path.join(args.out, "llama"), "qwen2": os.path.join(args.out, "qwen2")}
    model.save_pretrained(copies["llama"])
    as_qwen2(model, copies["qwen2"])
    for path in copies.values():
        tok.save_pretrained(path)
    env = common.load_env("tictactoe", {**json.loads(args.env_args), **EVAL_SETTINGS["random"]})
    local_summary, local = eval_mod.evaluate(env, HFPolicy(model, tok, env.system_prompt, temp=0.0, max_new_tokens=args.max_new_tokens), args.n,
                                             progress=False)
    results = {"server": "transformers serve " + __import__("transformers").__version__, "local_greedy": local_summary}
    for name, path in [("old_generation_config", old), *copies.items()]:
        with served(path, os.path.join(args.out, f"{name}.log")) as base:
            sampled = eval_mod.evaluate(env, APIPolicy(path, base, temp=1.0, max_new_tokens=args.max_new_tokens), 10, rollouts=6, progress=False)[1]
            distinct = [len({json.dumps(r["messages"]) for r in sampled if r["index"] == i}) for i in range(10)]
            res = {"distinct_games_of_6_at_temp_1": sum(distinct) / len(distinct)}
            if name != "old_generation_config":
                summary, api = eval_mod.evaluate(env, APIPolicy(path, base, temp=0.0, max_new_tokens=args.max_new_tokens),
                                                 args.n, progress=False)
                res.update(greedy=summary, comparison=compare(local, api, tok))
                try:
                    APIPolicy("no-such-model", base, retries=0)([{"messages": [{"role": "user", "content": "hi"}],
                                                                  "index": 0, "rollout": 0}])
                except RuntimeError as e:
                    res["wrong_model_error"] = str(e)
        results[name] = res
        print(name, json.dumps(res)[:2000], flush=True)
    with open(os.path.join(args.out, "serve_check.json"), "w") as f:
        json.dump(results, f, indent=2)
    for name in copies:
        g, c = results[name]["greedy"], results[name]["comparison"]
        print(f"{name}: format {g['format_rate']:.1%} (local {local_summary['format_rate']:.1%}), win {g['win_rate']:.1%} "
              f"(local {local_summary['win_rate']:.1%}); equal games {c['equal']}/{c['games']}, differ after a non-canonical "
              f"reply {c['differ_after_non_canonical_reply']}, otherwise {c['differ_otherwise']}; distinct games of 6 "
              f"at temp 1: {results[name]['distinct_games_of_6_at_temp_1']:.1f} "
              f"(old config {results['old_generation_config']['distinct_games_of_6_at_temp_1']:.1f})")


if __name__ == "__main__":
    main()
