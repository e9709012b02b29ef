"""bench.py, the standing benchmark: its workload is exactly the one it states, and its floor and FLOP counts are
the formulas of its docstring. Runs the tiny shape on CPU in seconds (the GPU shapes need a GPU)."""
import json

import pytest

import bench
from conftest import run_main
from sample import HFPolicy, rollout

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def test_bench_cli_runs_the_stated_workload(tmp_path):
    """python bench.py --shape tiny: every episode is exactly system + turns x (reply + environment message), on both
    engines, the table is printed and the JSON line carries the flags; with a bandwidth and a peak given, floor and MFU are
    filled in on a CPU too; --profile prints the costliest operators of a generation and an update."""
    out = tmp_path / "bench.jsonl"
    printed = run_main("bench", ["--shape", "tiny", "--examples", "3", "--group", "2", "--turns", "3", "--reply_tokens", "8",
                                 "--env_tokens", "5", "--system_tokens", "20", "--steps", "1", "--warmup_steps", "0",
                                 "--bandwidth", "1e11", "--peak_tflops", "1", "--profile", "3", "--out", str(out)])
    assert "| tiny |" in printed and "Device: CPU" in printed
    assert "tiny: generation, by cpu_time_total" in printed and "tiny: update, by cpu_time_total" in printed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["engine"] for r in rows] == ["fast", "hf"] and "| tiny | fast |" in printed and "| tiny | hf |" in printed
    assert rows[0]["gen_tokens"] == rows[1]["gen_tokens"] and rows[0]["train_tokens"] == rows[1]["train_tokens"]
    row = rows[-1]
    assert row["episodes"] == 6 and row["gen_tokens"] == 6 * 3 * 8 and row["decode_steps"] == 3 * 8
    assert row["args"]["reply_tokens"] == 8 and row["floor_frac"] > 0 and row["mfu"] > 0
    env = bench.FixedEnv(20, 5, 3)
    tok = bench.word_tokenizer(64)
    text = tok.apply_chat_template([{"role": "system", "content": env.system_prompt},
                                    {"role": "user", "content": env.message(0)}], add_generation_prompt=True, tokenize=False)
    prompt = len(tok(text, add_special_tokens=False).input_ids)
    assert prompt == 20 + 5 + 8  # the words and the template's tokens
    # prompt, then 3 x (8 sampled + end-of-turn), and before turns 2 and 3 a user turn: 5 words + 5 template tokens
    assert row["train_tokens"] == 6 * (prompt + 3 * 9 + 2 * (5 + 5))


def test_floor_and_flops_are_the_formulas():
    """decode_floor and update_flops on hand-made records: two episodes, two turns of 2 and 1 sampled tokens."""
    from transformers import LlamaConfig
    config = LlamaConfig(hidden_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    # episode: 4 prompt tokens, 2 sampled, 1 eot + 2 env tokens, 1 sampled
    mask = [0, 0, 0, 0, 1, 1, 0, 0, 0, 1]
    records = [{"ids": list(range(10)), "mask": mask}, {"ids": list(range(10)), "mask": mask}]
    seconds, steps = bench.decode_floor(records, n_read=1000, config=config, bandwidth=1e6)
    kv_per_token = 2 * 3 * (2 * 4) * 2  # keys and values, 3 layers, 2 KV heads x head_dim 4, bf16
    # steps: turn 0 token 0 reads 4 cached positions, token 1 reads 5; turn 1 token 0 reads 9; two episodes each
    want = sum(2 * 1000 + kv_per_token * 2 * c for c in (4, 5, 9)) / 1e6
    assert steps == 3 and seconds == pytest.approx(want)
    # the 300 parameters of the output layer on the 3 positions per episode that predict a sampled token only
    assert bench.update_flops(records, 1000, 300, config) == 6 * 700 * 20 + 6 * 300 * 2 * 3 + 6 * 3 * 16 * (100 + 100)


def test_fixed_replies_and_one_forward_per_token(sharp_model, short_env):
    """min_new_tokens = max_new_tokens: every reply is exactly that long (the end-of-turn token suppressed), cut
    there; and a turn costs exactly one model forward per sampled token (the prefill gives the first)."""
    model, tok = sharp_model
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        policy = HFPolicy(model, tok, short_env.system_prompt, temp=1.0, max_new_tokens=6, min_new_tokens=6, engine="fast")
        recs = rollout(short_env, short_env.examples(3, seed=0), policy, progress=False)
    finally:
        handle.remove()
    turns = [sum(1 for i, m in enumerate(r["mask"]) if m and not r["mask"][i - 1]) for r in recs]
    assert all(sum(r["mask"]) == 6 * t for r, t in zip(recs, turns))
    assert all(r["truncated"] == t for r, t in zip(recs, turns))
    assert len(calls) == max(turns) * 6
