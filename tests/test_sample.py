"""Tests for sample.py, the rollout engine: exact token trajectories, logprobs, chat-template handling,
batching, the rollout loop, loaders and the CLI.

CPU only, offline: the model is the tiny scratch model of conftest.py (a few tens of thousands of parameters).
The `sharp_model` fixture is the same model with its weight matrices scaled up so that greedy decoding depends
on the context (see conftest.SHARPEN); tests of "same tokens" properties use it.
"""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from conftest import FP32_LOGPROB_ATOL, ROOT

import common
import engine
import sample
from conftest import run_main
from rounding import bf16_excess, bf16_spread, fp32_logprobs
import policies
from policies import ScriptedPolicy
from sample import ChatTokens, HFPolicy, advance, new_episode, rollout

pytestmark = pytest.mark.usefixtures("torch_single_thread")

TIE = 1e-3  # logit gap under which two tokens count as tied (float noise may pick either)

# ----------------------------------------------------------------------------- helpers


@torch.no_grad()
def replay_logits(model, ids):
    """Logits (T, V) of one unpadded forward pass over a whole trajectory."""
    return model(input_ids=torch.tensor([ids])).logits[0].float()


def mask_runs(mask, value=1):
    """[(start, end)] of the maximal runs of `value` in mask."""
    runs, start = [], None
    for i, m in enumerate(list(mask) + [None]):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            runs.append((start, i))
            start = None
    return runs


def check_layout(rec, chat, tok, max_new_tokens):
    """Rebuild the trajectory from the messages and the sampled segments and compare token for token:
    ids = prompt + for each turn (sampled reply [+ eot, mask 0, when cut off] + the next user or tool turn's tokens)."""
    ids, mask, lps = rec["ids"], rec["mask"], rec["logprobs"]
    assert len(ids) == len(mask) == len(lps)
    assert set(mask) <= {0, 1}
    msgs = rec["messages"]
    assert [m["role"] for m in msgs[:2]] == ["system", "user"]
    assistant_idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    runs = mask_runs(mask)
    assert len(runs) == len(assistant_idx), "one sampled segment per assistant turn"
    prompt = chat.prompt_ids(msgs[:2])
    assert ids[:len(prompt)] == prompt and not any(mask[:len(prompt)]), "the prompt is the template's rendering, mask 0"
    expected, cut = list(prompt), 0
    for (s, e), mi in zip(runs, assistant_idx):
        seg = ids[s:e]
        assert len(seg) <= max_new_tokens
        assert all(t not in chat.stop_ids for t in seg[:-1]), "a segment stops at its first stop token"
        if seg[-1] == chat.eot_id:
            reply_toks = seg[:-1]
            expected += seg
        else:  # cut by max_new_tokens: the turn is closed by an eot the model did not sample (mask 0)
            assert len(seg) == max_new_tokens
            assert ids[e] == chat.eot_id and mask[e] == 0
            reply_toks = seg
            expected += seg + [chat.eot_id]
            cut += 1
        assert tok.decode(reply_toks, skip_special_tokens=True) == msgs[mi]["content"], "reply text = decoded segment"
        if mi + 1 < len(msgs):
            assert msgs[mi + 1]["role"] in ("user", "tool")
            expected += chat.turn_ids(msgs[mi + 1])
    assert ids == expected, "trajectory differs from prompt + segments + user turns"
    assert rec["truncated"] == cut
    assert all(lp == 0.0 for lp, m in zip(lps, mask) if m == 0), "logprobs are 0 off the sampled tokens"
    return runs, cut


def legal_reply_from_text(text, tag="secret reasoning"):
    """A well-formed reply taking the lowest free cell named in the last 'Free cells:' line of `text`."""
    free = re.findall(r"Free cells: ([0-9 ]+)\.", text)[-1].split()
    turn = text.count("<|im_start|>assistant")
    return f"<think>{tag} {turn}</think><move>{free[0]}</move>"


def force_replies(monkeypatch, policy, reply_fn):
    """Make every row of a turn emit tokenizer(reply_fn(context)) + eot, where context is the row's text so far. The
    policy's own sampling still runs on the model's real logits (so the logprobs are the model's); only the choice
    of token is replaced."""
    tok, eot = policy.tokenizer, policy.chat.eot_id
    uniforms, sample = policy._uniforms, policy._sample
    state = {}

    def forced_turn(episodes, device):  # once per rollout batch and turn, on either engine
        state["targets"] = [tok(reply_fn(tok.decode(ep["ids"])), add_special_tokens=False).input_ids + [eot] for ep in episodes]
        state["t"] = 0
        return uniforms(episodes, device)

    def forced_sample(logits, uniform, suppress_stop, stop_ids, forced):
        _, _ = sample(logits, uniform, suppress_stop, stop_ids, forced)
        logp = torch.log_softmax(logits.float() / (policy.temp or 1.0), dim=-1)
        t = state["t"]
        token = torch.tensor([tg[min(t, len(tg) - 1)] for tg in state["targets"]], device=logits.device)
        state["t"] += 1
        return token, logp.gather(1, token[:, None]).squeeze(1)
    monkeypatch.setattr(policy, "_uniforms", forced_turn)
    monkeypatch.setattr(policy, "_sample", forced_sample)


# ----------------------------------------------------------------------------- token exactness and logprobs


def test_greedy_trajectory_is_token_exact(sharp_model, short_env):
    model, tok = sharp_model
    # 8 games, 32 tokens a turn: enough that the random model both stops and is cut off (6 / 18 of 24 turns)
    policy = HFPolicy(model, tok, short_env.system_prompt, temp=0.0, max_new_tokens=32)
    recs = rollout(short_env, short_env.examples(8, seed=3), policy, progress=False)
    assert len(recs) == 8
    stopped = cut_total = sampled = 0
    for rec in recs:
        runs, cut = check_layout(rec, policy.chat, tok, 32)
        stopped += len(runs) - cut
        cut_total += cut
        ids, mask = rec["ids"], rec["mask"]
        logits = replay_logits(model, ids)
        logp = torch.log_softmax(logits, -1)
        for t in range(1, len(ids)):
            if mask[t]:
                sampled += 1
                pred = int(logits[t - 1].argmax())
                gap = float(logits[t - 1, pred] - logits[t - 1, ids[t]])
                assert pred == ids[t] or gap < TIE, f"position {t}: greedy token {ids[t]} but replay argmax {pred} (gap {gap:.3g})"
                # greedy records logprobs under temperature 1
                assert abs(rec["logprobs"][t] - float(logp[t - 1, ids[t]])) < 1e-4
    assert sampled > 0 and policy.gen_tokens == sampled
    # both endings occur, so both branches of check_layout were exercised
    assert stopped > 0 and cut_total > 0, (stopped, cut_total)


def test_sampled_logprobs_match_replay_at_temperature(sharp_model, short_env):
    model, tok = sharp_model
    torch.manual_seed(0)
    temp = 1.3
    policy = HFPolicy(model, tok, short_env.system_prompt, temp=temp, max_new_tokens=16)
    recs = rollout(short_env, short_env.examples(3, seed=5), policy, progress=False)
    n = 0
    for rec in recs:
        check_layout(rec, policy.chat, tok, 16)
        logits = replay_logits(model, rec["ids"])
        want = torch.log_softmax(logits / temp, -1)
        untempered = torch.log_softmax(logits, -1)
        pos = [t for t, m in enumerate(rec["mask"]) if m]
        got = torch.tensor([rec["logprobs"][t] for t in pos])
        ref = want[torch.tensor(pos) - 1, torch.tensor([rec["ids"][t] for t in pos])]
        torch.testing.assert_close(got, ref, atol=FP32_LOGPROB_ATOL, rtol=0)
        # and the temperature matters here: the untempered logprobs are clearly different
        ref1 = untempered[torch.tensor(pos) - 1, torch.tensor([rec["ids"][t] for t in pos])]
        assert (got - ref1).abs().max() > 1e-2
        n += len(pos)
    assert n > 20


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_a_forced_reply_is_recorded_as_the_models_tokens(sharp_model, engine):
    """An environment's forced_reply hook: the forced rollouts' reply is exactly ChatTokens.reply_ids of the text,
    mask 1, with the model's logprobs of those tokens at the temperature; every other rollout samples the tokens
    it samples without the hook (the same draws), and the game goes on from the forced move."""
    import env_tictactoe as ttt
    model, tok = sharp_model
    temp, text = 1.3, "<think>Free cells: 0 1 2 3 4 5 6 7 8. I take cell 4.</think><move>4</move>"

    class Forcing(ttt.TicTacToe):
        def forced_reply(self, state, rollout):
            return text if rollout == 1 and state["turns"] == 0 else None
    plain, forcing = ttt.TicTacToe(max_turns=3), Forcing(max_turns=3)
    examples = [{"seed": 3, "random_move_prob": 1.0, "model_first": True}]
    policy = lambda: HFPolicy(model, tok, plain.system_prompt, temp=temp, max_new_tokens=64, engine=engine)
    want = rollout(plain, examples, policy(), group=3, progress=False)
    got = rollout(forcing, examples, policy(), group=3, progress=False)
    assert [r["ids"] for r in got[::2]] == [r["ids"] for r in want[::2]]
    forced = got[1]
    check_layout(forced, policy().chat, tok, 64)
    first = mask_runs(forced["mask"])[0]
    assert forced["ids"][first[0]:first[1]] == policy().chat.reply_ids(text)
    assert forced["messages"][2]["content"] == text and "You took cell 4." in forced["messages"][3]["content"]
    logp = torch.log_softmax(replay_logits(model, forced["ids"]) / temp, -1)
    pos = [t for t, m in enumerate(forced["mask"]) if m]
    ref = logp[torch.tensor(pos) - 1, torch.tensor([forced["ids"][t] for t in pos])]
    torch.testing.assert_close(torch.tensor([forced["logprobs"][t] for t in pos]), ref,
                               atol=FP32_LOGPROB_ATOL, rtol=0)
    assert min(forced["logprobs"][t] for t in range(*first)) < -1  # tokens the model would seldom sample


# ----------------------------------------------------------------------------- chat templates that rewrite past turns


def _think_game(env, seed=0):
    """A finished tic-tac-toe conversation whose every reply carries a <think> block."""
    ep = new_episode(env, env.examples(1, seed)[0])
    k = 0
    while True:
        k += 1
        free = [i for i, c in enumerate(ep["state"]["board"]) if c == "."]
        if advance(env, ep, f"<think>secret reasoning {k}</think><move>{free[0]}</move>"):
            return ep["messages"], k


def test_qwen3_style_fixture_is_chatml_but_drops_old_think(qwen3_model, tiny_model):
    _, qtok = qwen3_model
    _, tok = tiny_model
    plain = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
             {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]
    for gen in (False, True):
        assert qtok.apply_chat_template(plain, tokenize=False, add_generation_prompt=gen) == \
            tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=gen)
    thinking = plain[:2] + [{"role": "assistant", "content": "<think>old</think>A1"}] + plain[3:] + \
        [{"role": "assistant", "content": "<think>new</think>A2"}]
    text = qtok.apply_chat_template(thinking, tokenize=False)
    assert "old" not in text and "A1" in text and "<think>new</think>A2" in text


def test_encode_conversation_keeps_think_that_template_drops(qwen3_model, ttt_env):
    _, tok = qwen3_model
    chat = ChatTokens(tok, ttt_env.system_prompt)
    assert chat.eot_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.decode(chat.turn_ids({"role": "user", "content": "hello"})) == "\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    messages, turns = _think_game(ttt_env, seed=1)
    assert turns >= 3
    ids, mask = chat.encode_conversation(messages)
    assert len(ids) == len(mask)
    text = tok.decode(ids)
    for k in range(1, turns + 1):
        assert f"<think>secret reasoning {k}</think>" in text
    # the trained-on tokens are exactly each reply + its end-of-turn token
    for (s, e), m in zip(mask_runs(mask), [m for m in messages if m["role"] == "assistant"]):
        assert ids[e - 1] == chat.eot_id and tok.decode(ids[s:e - 1]) == m["content"]
    # the template's own rendering drops every earlier <think> block (only the last reply keeps it) ...
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert rendered.count("secret reasoning") == 1 and f"secret reasoning {turns}" in rendered
    rendered_ids = tok(rendered, add_special_tokens=False).input_ids
    assert rendered_ids != ids and len(rendered_ids) < len(ids)
    # ... so re-rendering the conversation at turn 2 would NOT extend the tokens the model produced at turn 1
    # (the drift the rollout engine avoids by appending user turns instead of re-rendering)
    turn2 = tok(tok.apply_chat_template(messages[:4], tokenize=False, add_generation_prompt=True),
                add_special_tokens=False).input_ids
    assert ids[:len(turn2)] != turn2
    assert "secret reasoning 1" not in tok.decode(turn2)


def test_hf_rollout_with_think_replies_keeps_trajectory(qwen3_model, ttt_env, monkeypatch):
    """A real HFPolicy rollout (Qwen3-style template) whose replies are forced to carry <think> blocks."""
    model, tok = qwen3_model
    torch.manual_seed(0)
    policy = HFPolicy(model, tok, ttt_env.system_prompt, temp=1.0, max_new_tokens=64)
    force_replies(monkeypatch, policy, legal_reply_from_text)
    recs = rollout(ttt_env, ttt_env.examples(4, seed=2), policy, progress=False)
    for rec in recs:
        replies = [m["content"] for m in rec["messages"] if m["role"] == "assistant"]
        assert len(replies) >= 2
        assert rec["metrics"]["format"] == 1.0 and rec["metrics"]["invalid"] == 0.0
        check_layout(rec, policy.chat, tok, 64)
        assert rec["truncated"] == 0
        # the trajectory is the no-re-render encoding of the conversation, and keeps every think block
        ids, mask = policy.chat.encode_conversation(rec["messages"])
        assert rec["ids"] == ids and rec["mask"] == mask
        text = tok.decode(rec["ids"])
        for k, r in enumerate(replies, 1):
            assert r.startswith(f"<think>secret reasoning {k}</think><move>")
            assert r in text
        rendered = tok.apply_chat_template(rec["messages"], tokenize=False)
        assert rendered.count("secret reasoning") == 1
        # recorded logprobs are the model's own (temp 1) logprobs of the forced tokens, not the forced 0
        logp = torch.log_softmax(replay_logits(model, rec["ids"]), -1)
        pos = [t for t, m in enumerate(rec["mask"]) if m]
        got = torch.tensor([rec["logprobs"][t] for t in pos])
        torch.testing.assert_close(got, logp[torch.tensor(pos) - 1, torch.tensor([rec["ids"][t] for t in pos])],
                                   atol=FP32_LOGPROB_ATOL, rtol=0)
        assert got.max() < -0.01


def test_hf_rollout_qwen3_template_sampled(qwen3_model, short_env):
    """Unforced sampling with the Qwen3-style template: decoded segments are the replies, in order, and the
    tokens between turns are exactly ChatTokens.turn_ids(next user message)."""
    model, tok = qwen3_model
    torch.manual_seed(1)
    policy = HFPolicy(model, tok, short_env.system_prompt, temp=1.0, max_new_tokens=16)
    recs = rollout(short_env, short_env.examples(4, seed=4), policy, progress=False)
    for rec in recs:
        check_layout(rec, policy.chat, tok, 16)
        text = tok.decode(rec["ids"], skip_special_tokens=True)
        pos = 0
        for m in rec["messages"][1:]:
            if m["role"] == "assistant":
                found = text.find(m["content"], pos)
                assert found >= 0, "every reply appears in the decoded trajectory, in order"
                pos = found + len(m["content"])


# ----------------------------------------------------------------------------- KV-cache reuse across turns


def _spy_prefill(policy, monkeypatch):
    """Record, for every turn's prefill, (tokens already cached per row, tokens encoded per row): the fast engine's
    _continue, or the whole trajectories generate() encodes."""
    seen = []
    name = "_continue" if policy.engine.name == "fast" else "_batch"
    original = getattr(policy.engine, name)

    def spy(policy, episodes, *cache):
        cached = [ep["kv_len"] if cache else 0 for ep in episodes]
        seen.append((cached, [len(ep["ids"]) - c for ep, c in zip(episodes, cached)]))
        return original(policy, episodes, *cache)
    monkeypatch.setattr(policy.engine, name, spy)
    return seen


class _EndsEarly:
    """An environment's games cut after 1 + k % 3 model turns for example k: episodes leave at different turns."""

    def __init__(self, env):
        self.env, self.system_prompt, self.max_turns, self.reward_weights = env, env.system_prompt, env.max_turns, env.reward_weights

    def examples(self, n, seed=0):
        return [{**ex, "turns": 1 + k % 3} for k, ex in enumerate(self.env.examples(n, seed))]

    def reset(self, example):
        state, first = self.env.reset(example)
        return {"inner": state, "left": example["turns"]}, first

    def step(self, state, reply):
        state["left"] -= 1
        message = self.env.step(state["inner"], reply)
        return None if state["left"] == 0 else message

    def rewards(self, state):
        return self.env.rewards(state["inner"])


@pytest.mark.parametrize("temp", [0.0, 1.3])
def test_kv_cache_reuse_equals_reencoding(sharp_model, short_env, monkeypatch, temp):
    """Rows of a RowCache continued turn after turn (each turn encodes only the new tokens, right-aligned, padding
    written to the spare slot; finished episodes compacted away) give the same tokens and logprobs as re-encoding
    the whole conversation every turn (the generate() engine), in two waves of episodes, greedy and sampled (an episode's random numbers are
    its own, whichever episodes share its batch)."""
    model, tok = sharp_model
    env = _EndsEarly(short_env)
    examples = env.examples(6, seed=11)
    runs = {}
    for reuse, engine in ((True, "fast"), (False, "hf")):
        torch.manual_seed(0)
        policy = HFPolicy(model, tok, env.system_prompt, temp=temp, max_new_tokens=12, batch_size=4, engine=engine)
        seen = _spy_prefill(policy, monkeypatch)
        runs[reuse] = rollout(env, examples, policy, progress=False)
        monkeypatch.undo()
        # later turns start from a cache exactly when reuse is on, and then encode a few tokens, not the conversation
        assert not any(seen[0][0]) and any(any(cached) for cached, _ in seen) == reuse
        if reuse:
            fresh, continued = [new for cached, new in seen if not any(cached)], [new for cached, new in seen if any(cached)]
            assert len(fresh) == 2 and max(map(max, continued)) < min(map(min, fresh))  # two waves, 4 and 2 episodes
    assert max(len(r["messages"]) for r in runs[True]) >= 6, "several turns, so the cache was continued"
    assert len({len(r["messages"]) for r in runs[True]}) > 1, "episodes finished at different turns: rows were compacted"
    for a, b in zip(runs[True], runs[False]):
        assert a["ids"] == b["ids"] and a["mask"] == b["mask"]
        torch.testing.assert_close(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]),
                                   atol=FP32_LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("by_matmul", [False, True])
def test_kv_cache_under_autocast_is_bf16(sharp_model, short_env, by_matmul):
    """On a GPU a policy samples under bf16 autocast (the engines' autocast; CPU autocast runs the same code here): the
    RowCache is bf16, not the fp32 that the keys of fp32 weights come out in, and continuing it gives the replies
    that re-encoding gives: exactly with SDPA as the decoding step's attention, up to bf16 near-ties with the
    matrix products a GPU decodes with; the logprobs within bf16's rounding (rounding.bf16_spread)."""
    model, tok = sharp_model
    runs, dtypes = {}, set()
    for reuse in (True, False):
        options = {"engine": "fast", "decode_by_matmul": by_matmul} if reuse else {"engine": "hf"}
        policy = HFPolicy(model, tok, short_env.system_prompt, temp=0.0, max_new_tokens=12, batch_size=4, **options)
        policy.engine.autocast = True
        if reuse:
            prefill = policy.engine._continue

            def spy(policy, episodes, cache):
                out = prefill(policy, episodes, cache)
                dtypes.update(t.dtype for t in (cache.keys | cache.values).values())
                return out
            policy.engine._continue = spy
        runs[reuse] = rollout(short_env, short_env.examples(6, seed=11), policy, progress=False)
    assert dtypes == {torch.bfloat16} and next(model.parameters()).dtype == torch.float32
    if not by_matmul:
        assert [r["ids"] for r in runs[True]] == [r["ids"] for r in runs[False]]
    # Each recorded logprob, of either engine, is within its bf16 spread (rounding.bf16_spread, derived from the
    # model's sensitivities) of the same token's logprob in one fp32 forward. Where the two first differ, at n,
    # each chose a greedy token, x (cache) and y (re-encoding): only a near tie can go both ways, so the fp32 gap
    # log p(x) - log p(y) is within the spread of that gap. What moves a logprob by less than bf16's rounding is
    # for the fp32 tests (test_engine) to catch.
    for a, b in zip(runs[True], runs[False]):
        assert bf16_excess(model, a) <= 0 and bf16_excess(model, b) <= 0
        n = next((i for i, (x, y) in enumerate(zip(a["ids"], b["ids"])) if x != y), len(a["ids"]))
        assert a["mask"][:n] == b["mask"][:n]
        if n < len(a["ids"]):
            assert a["mask"][n] and b["mask"][n], "diverged on a token neither sampled"
            tie = [(n, a["ids"][n], b["ids"][n])]
            gap, spread = fp32_logprobs(model, a["ids"], tie)[0], bf16_spread(model, a["ids"], tie)[0]
            assert abs(gap) <= spread, ("diverged away from a near tie", float(gap), spread)


def test_row_cache_writes_rows_gathers_and_grows():
    """RowCache by hand: each row's tokens land at its own positions, padding only in the spare last slot; gather()
    drops and repeats rows; reserve() grows the cache keeping every row's content."""
    cache = engine.RowCache(torch.float32)
    cache.reserve(3, 6, room=0)  # 6 positions + the spare slot
    spare = cache.capacity - 1
    cache.write, cache.span = torch.tensor([[0, 1], [spare, 0], [4, 5]]), 6  # row 1: one padding column, one token
    keys = torch.arange(3 * 2, dtype=torch.float).view(3, 1, 2, 1).expand(3, 2, 2, 1)  # (B, H, W, D): value = b*2 + w
    K, V = cache.update(keys, -keys, layer=0)
    assert K.shape == (3, 2, 6, 1)
    assert K[0, 0, :2, 0].tolist() == [0, 1] and K[1, 0, 0, 0] == 3 and K[2, 0, 4:6, 0].tolist() == [4, 5]
    assert cache.keys[0][1, 0, spare, 0] == 2 and torch.equal(V, -K)
    cache.gather([2, 0])  # row 1's episode finished
    assert cache.keys[0][0, 0, 4:6, 0].tolist() == [4, 5] and cache.keys[0][1, 0, :2, 0].tolist() == [0, 1]
    cache.gather([0, 1, 1, 0])  # each episode copied once: more rows than the buffer had
    assert cache.keys[0].shape[0] == 4 and cache.keys[0][2, 0, :2, 0].tolist() == [0, 1]
    assert cache.keys[0][3, 0, 4:6, 0].tolist() == [4, 5]
    cache.reserve(4, 20, room=5)
    assert cache.capacity == 26 and cache.keys[0].shape == (4, 2, 26, 1)
    assert cache.keys[0][1, 0, :2, 0].tolist() == [0, 1] and cache.keys[0][3, 0, 4:6, 0].tolist() == [4, 5]
    assert torch.equal(cache.values[0], -cache.keys[0])


def test_sliding_window_model_keeps_its_window(tiny_model_dir, short_env, tmp_path):
    """A sliding-window model (Mistral, window 8: far shorter than a game) runs on the RowCache with its window in
    the mask: the same tokens as generate() re-encoding every turn with the model's own cache, and different ones from the
    same weights without a window."""
    from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM
    llama, tok = common.load_model(tiny_model_dir, device="cpu")
    cfg = {k: v for k, v in llama.config.to_dict().items() if k not in ("architectures", "model_type")}
    MistralForCausalLM(MistralConfig(**cfg, sliding_window=8)).save_pretrained(tmp_path / "sw")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "sw")
    model.load_state_dict(llama.state_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(20.0) if p.dim() >= 2 else None
    examples = short_env.examples(3, seed=2)
    policy = HFPolicy(model.eval(), tok, short_env.system_prompt, temp=0.0, max_new_tokens=10)
    got = rollout(short_env, examples, policy, progress=False)
    assert policy.engine.name == "fast" and policy.engine.window == 8
    want = rollout(short_env, examples, HFPolicy(model, tok, short_env.system_prompt, temp=0.0, max_new_tokens=10,
                                                 engine="hf"), progress=False)
    assert [r["ids"] for r in got] == [r["ids"] for r in want]
    policy.engine.window = None
    assert [r["ids"] for r in rollout(short_env, examples, policy, progress=False)] != [r["ids"] for r in want]


# ----------------------------------------------------------------------------- batching


def test_batched_generation_equals_one_at_a_time(sharp_model, short_env):
    env = short_env
    model, tok = sharp_model
    examples = env.examples(8, seed=7)
    policy = HFPolicy(model, tok, env.system_prompt, temp=0.0, max_new_tokens=12)
    batched = rollout(env, examples, policy, progress=False)
    chunked = rollout(env, examples, HFPolicy(model, tok, env.system_prompt, temp=0.0, max_new_tokens=12,
                                              batch_size=3), progress=False)
    # the prompts have different lengths, so the batch really was left-padded
    assert len({len(policy.chat.prompt_ids(new_episode(env, ex)["messages"])) for ex in examples}) > 1
    distinct = set()
    for i, ex in enumerate(examples):
        alone = rollout(env, [ex], policy, start_index=i, progress=False)[0]
        for other in (batched[i], chunked[i]):
            assert other["index"] == alone["index"] == i
            if other["ids"] != alone["ids"]:
                t = next(j for j, (a, b) in enumerate(zip(alone["ids"], other["ids"])) if a != b)
                logits = replay_logits(model, alone["ids"][:t])[-1]
                gap = abs(float(logits[alone["ids"][t]] - logits[other["ids"][t]]))
                assert gap < TIE, f"example {i}: batched run diverges at token {t} (logit gap {gap:.3g}, not a tie)"
            else:
                assert other["mask"] == alone["mask"]
                torch.testing.assert_close(torch.tensor(other["logprobs"]), torch.tensor(alone["logprobs"]),
                                           atol=FP32_LOGPROB_ATOL, rtol=0)
        distinct.add(tuple(m["content"] for m in alone["messages"] if m["role"] == "assistant"))
    # the replies depend on the context, so a padding or position bug shows up as different tokens (with the
    # unscaled random model every reply is the same run of newlines whatever the game)
    assert len(distinct) > 2


# ----------------------------------------------------------------------------- the rollout loop


def test_rollout_groups_order_and_scripted_records(ttt_env):
    examples = ttt_env.examples(4, seed=11)
    done = []
    policy = ScriptedPolicy(ttt_env, "minimax")
    recs = rollout(ttt_env, examples, policy, group=3, start_index=5, on_done=done.append, progress=False)
    assert [(r["index"], r["rollout"]) for r in recs] == [(5 + i, r) for i in range(4) for r in range(3)]
    assert sorted(id(r) for r in done) == sorted(id(r) for r in recs), "on_done sees every record once"
    for r in recs:
        ex = examples[r["index"] - 5]
        assert r["example"] == ex and r["example"]["seed"] == ex["seed"]
        assert "ids" not in r and "mask" not in r and "logprobs" not in r
        assert r["metrics"]["loss"] == 0.0 and r["metrics"]["format"] == 1.0
        assert r["reward"] == pytest.approx(sample.total_reward(ttt_env, r["rewards"]))
    # scripted players and the opponent are seeded by (example seed, board): a group replays one game
    for i in range(4):
        group = [r["messages"] for r in recs if r["index"] == 5 + i]
        assert group[0] == group[1] == group[2]
    assert len({json.dumps(r["messages"]) for r in recs}) > 1
    # skip leaves out exactly the pairs named
    recs2 = rollout(ttt_env, examples, policy, group=3, start_index=5, skip={(6, 1), (8, 0)}, progress=False)
    assert [(r["index"], r["rollout"]) for r in recs2] == [k for k in ((5 + i, r) for i in range(4) for r in range(3))
                                                           if k not in {(6, 1), (8, 0)}]


def test_rollout_group_sampled_share_example(tiny_model, short_env):
    model, tok = tiny_model
    torch.manual_seed(3)
    examples = short_env.examples(2, seed=13)
    policy = HFPolicy(model, tok, short_env.system_prompt, temp=1.0, max_new_tokens=8)
    recs = rollout(short_env, examples, policy, group=3, progress=False)
    assert [(r["index"], r["rollout"]) for r in recs] == [(i, r) for i in range(2) for r in range(3)]
    for i in range(2):
        group = [r for r in recs if r["index"] == i]
        assert all(r["example"] == examples[i] for r in group)
        assert len({r["messages"][1]["content"] for r in group}) == 1, "same example, same first position"
        assert len({tuple(r["ids"]) for r in group}) == 3, "independent samples"
        for r in group:
            check_layout(r, policy.chat, tok, 8)


# ----------------------------------------------------------------------------- loaders


def test_load_env_errors():
    env = common.load_env("tictactoe", '{"max_random_move_prob": 0.5}')
    assert env.hi == 0.5
    assert common.load_env("tictactoe", "").hi == 1.0
    with pytest.raises(SystemExit, match=r"no environment 'nope'.*found: .*tictactoe"):
        common.load_env("nope")
    with pytest.raises(SystemExit, match="not valid JSON"):
        common.load_env("tictactoe", "{max_random_move_prob: 0.5")
    with pytest.raises(SystemExit) as e:
        common.load_env("tictactoe", {"bogus_key": 1})
    msg = str(e.value)
    assert "bogus_key" in msg and "min_random_move_prob" in msg and "max_turns" in msg
    with pytest.raises(SystemExit, match="max_random_move_prob"):
        common.load_env("tictactoe", {"max_random_move_prob": 2.0})


def test_load_model_errors(tmp_path, no_template_model_dir):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(SystemExit) as e:
        common.load_model(missing, device="cpu")
    assert missing in str(e.value) and "could not load model" in str(e.value)
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(SystemExit) as e:
        common.load_model(str(empty), device="cpu")
    assert str(empty) in str(e.value) and "not a complete, readable save_pretrained model" in str(e.value)
    with pytest.raises(SystemExit, match="no chat template"):
        common.load_model(no_template_model_dir, device="cpu")


def test_a_float64_checkpoint_loads_in_float64(f64_model_dir, tiny_model_dir):
    """What test_distributed's float64 comparisons rest on: the checkpoint's own dtype, not fp32."""
    assert next(common.load_model(f64_model_dir, device="cpu", train=True)[0].parameters()).dtype == torch.float64
    assert next(common.load_model(tiny_model_dir, device="cpu")[0].parameters()).dtype == torch.float32


def test_weights_dtype_keeps_trained_weights_fp32():
    assert common.weights_dtype("cuda") == torch.bfloat16  # sampling and evaluation on a GPU
    assert common.weights_dtype("cuda:0", train=True) == common.weights_dtype("cpu") == torch.float32
    # why: one AdamW step at RL's learning rate moves each weight by ~lr, below bf16's rounding step for most weights
    w = torch.randn(4096) * 0.05
    moved = {}
    for dtype in (torch.bfloat16, torch.float32):
        p = torch.nn.Parameter(w.clone().to(dtype))
        opt = torch.optim.AdamW([p], lr=5e-5, weight_decay=0.0)
        p.grad = torch.randn(4096).to(dtype)
        opt.step()
        moved[dtype] = (p.detach() != w.to(dtype)).float().mean().item()
    assert moved[torch.float32] == 1.0 and moved[torch.bfloat16] < 0.5, moved


def test_make_policy_kinds(tiny_model_dir, ttt_env):
    assert isinstance(policies.make_policy("minimax", ttt_env), ScriptedPolicy)
    assert isinstance(policies.make_policy("random", ttt_env), ScriptedPolicy)
    p = policies.make_policy(tiny_model_dir, ttt_env, device="cpu", temp=0.5, max_new_tokens=7)
    assert isinstance(p, HFPolicy) and p.temp == 0.5 and p.max_new_tokens == 7
    api = policies.make_policy("some-model", ttt_env, api_base="http://127.0.0.1:9/v1")
    assert isinstance(api, policies.APIPolicy) and api.model == "some-model"


# ----------------------------------------------------------------------------- CLI


def _run(args, timeout=120):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


BOARD_ROW = re.compile(r"^\s*[0-9XO]\|[0-9XO]\|[0-9XO]$", re.M)


def test_watch_an_hf_model_play(tiny_model_dir, tmp_path):
    """Watching a model play is eval.py with its games shown (--show), their records in --out."""
    printed = run_main("eval", ["--model", tiny_model_dir, "--env", "tictactoe", "-n", "2", "--show", "2", "--max_new_tokens", "8",
                                "--temp", "1", "--device", "cpu", "--out", str(tmp_path / "e")])
    assert "=== example 0 rollout 0" in printed and "=== example 1 rollout 0" in printed
    assert len(BOARD_ROW.findall(printed)) >= 6
    lines = (tmp_path / "e" / "rollouts.jsonl").read_text().splitlines()
    assert len(lines) == 2 and all(len(json.loads(l)["ids"]) > 0 for l in lines)


def test_watch_a_scripted_player():
    p = _run(["eval.py", "--model", "minimax", "-n", "1", "--show", "1"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "=== example 0 rollout 0" in p.stdout and "[model] <think>" in p.stdout
    assert len(BOARD_ROW.findall(p.stdout)) >= 3


# ----------------------------------------------------------------------------- throughput (measurement only)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [64, 256])
def test_throughput(tiny_model, ttt_env, batch, capsys):
    model, tok = tiny_model
    torch.manual_seed(0)
    policy = HFPolicy(model, tok, ttt_env.system_prompt, temp=1.0, max_new_tokens=32, batch_size=batch)
    examples = ttt_env.examples(batch, seed=0)
    policy([new_episode(ttt_env, ex) for ex in examples[:4]])  # warm-up
    policy.gen_tokens = 0
    episodes = [new_episode(ttt_env, ex) for ex in examples]
    t0 = time.perf_counter()
    replies = policy(episodes)
    dt = time.perf_counter() - t0
    assert len(replies) == batch and policy.gen_tokens > 0
    with capsys.disabled():
        print(f"\n[throughput] tiny model, batch {batch}: {policy.gen_tokens} tokens in {dt:.2f}s = "
              f"{policy.gen_tokens / dt:.0f} generated tokens/s (threads {torch.get_num_threads()})")


@pytest.mark.parametrize("source, message", [
    ("def load_environment(:\n", "failed to import: SyntaxError"),
    ("raise RuntimeError('boom')\n", "failed to import: RuntimeError: boom"),
    ("import not_a_package_here\n", "imports 'not_a_package_here', which is not installed"),
    ("X = 1\n", "has no load_environment() function"),
])
def test_broken_environment_files_stop_with_one_line(source, message, tmp_path, monkeypatch):
    """An env_NAME.py that does not import, or has no load_environment, stops with a line that says so."""
    (tmp_path / "env_broken_here.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("env_broken_here", None)
    with pytest.raises(SystemExit, match=re.escape(message)):
        common.load_env("broken_here")


def test_corrupt_weights_file_stops_with_one_line(tiny_model_dir, tmp_path):
    import shutil
    bad = tmp_path / "corrupt"
    shutil.copytree(tiny_model_dir, bad)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(SystemExit, match="could not load model"):
        common.load_model(str(bad), device="cpu")


def test_sampled_rollouts_do_not_depend_on_their_batch(sharp_model, short_env):
    """Sampling is keyed by (seed, episode number, rollout, turn): one batch of 12, batches of 5, or the examples
    split over two calls numbered from their place (two torchrun ranks) give the same episodes; another seed not.
    Batches of 5 are played in waves of 5 (their KV caches live across turns): the policy never holds more."""
    import copy
    model, tok = sharp_model
    model = copy.deepcopy(model).double()  # float64: the bound below
    examples = short_env.examples(6, seed=4)
    held = []  # episodes given to the policy in each call

    class Counting(HFPolicy):
        def __call__(self, episodes):
            held.append(len(episodes))
            return super().__call__(episodes)

    def play(batch_size, seed=0, split=False):
        policy = Counting(model, tok, short_env.system_prompt, temp=1.0, max_new_tokens=10, batch_size=batch_size, seed=seed)
        if not split:
            return rollout(short_env, examples, policy, group=2, progress=False)
        return (rollout(short_env, examples[:3], policy, group=2, progress=False)
                + rollout(short_env, examples[3:], policy, group=2, start_index=3, progress=False))
    whole = play(12)
    assert len({tuple(r["ids"]) for r in whole}) > 6, "sampling should vary between episodes"
    held.clear()
    in_waves = play(5)
    assert max(held) == 5 and len(held) > short_env.max_turns, held
    for other in (in_waves, play(12, split=True)):
        assert [r["ids"] for r in other] == [r["ids"] for r in whole]
        # the same tokens; logprobs of other batch shapes sum in another order. In float64 (unit
        # roundoff u = 1.1e-16) a sum of n <= 300 terms moves by at most n * u * sum|terms|; this
        # model's terms stay under 1e3 (hidden states normalised, weights x SHARPEN), so a sum moves
        # by < 3.3e-11, and the dozen sums from embedding to logit, each at most doubling what
        # reaches it, keep a logprob (twice its logits' move) within 1e-8
        got = torch.tensor([lp for r in other for lp in r["logprobs"]], dtype=torch.float64)
        want = torch.tensor([lp for r in whole for lp in r["logprobs"]], dtype=torch.float64)
        torch.testing.assert_close(got, want, atol=1e-8, rtol=0)
    assert [r["ids"] for r in play(12, seed=1)] != [r["ids"] for r in whole]


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_inverse_cdf_sampling_draws_the_distribution(tiny_model, top_p):
    """HFPolicy._sample on fixed logits and 40,000 uniform numbers: each token's frequency is its probability (after
    the nucleus cut), a suppressed stop token is never drawn, and the logprob is the model's at the temperature."""
    # a policy built as its callers build it, so _sample sees whatever __init__ sets; the model and
    # tokenizer play no part (the logits and stop ids are given below), hence the reference engine,
    # the one that builds nothing
    model, tok = tiny_model
    policy = HFPolicy(model, tok, "Play.", temp=2.0, top_p=top_p, engine="hf")
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, 3.0, float("-inf")]]).repeat(40_000, 1)  # (B, V)
    probs = torch.softmax(logits[0] / 2.0, -1)
    token, logp = policy._sample(logits, torch.rand(40_000, generator=torch.Generator().manual_seed(0)),
                                 suppress_stop=True, stop_ids=torch.tensor([1]), forced=None)
    want = probs.clone()
    want[1] = 0  # suppressed
    want /= want.sum()
    if top_p < 1:  # the smallest set of most likely tokens reaching top_p: tokens 4 and 2 (0.51 + 0.31 of the rest)
        want[[0, 3]] = 0
        want /= want.sum()
    freq = torch.bincount(token, minlength=6).float() / len(token)
    # a frequency of 40,000 draws has a standard deviation of at most sqrt(0.25 / 40,000) = 0.0025: 0.01 is 4 of
    # them (and the seeded draws are the same every run); a wrong cut or a stale CDF moves a token by >= 0.05
    torch.testing.assert_close(freq, want, atol=0.01, rtol=0)
    assert freq[1] == 0 and freq[5] == 0
    torch.testing.assert_close(logp, torch.log(probs)[token])


def test_the_reference_engine_warns_of_no_ignored_generation_flag(sharp_model_dir, ttt_env, caplog):
    """A model saved by sft.py keeps top_k 0 in its generation config; generate() must not call it ignored (a user
    would read it as a flag of theirs)."""
    import logging

    from policies import make_policy
    from sample import rollout
    policy = make_policy(sharp_model_dir, ttt_env, device="cpu", max_new_tokens=4, engine="hf")
    from transformers.utils import logging as hf_logging
    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            rollout(ttt_env, ttt_env.examples(2, seed=0), policy, progress=False)
    finally:
        hf_logging.disable_propagation()
    assert not [r for r in caplog.records if "generation flags" in r.getMessage()]
