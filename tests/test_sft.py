"""sft.py: the assistant-only loss mask, bad input, a scratch smoke run, and exact resume."""
import json
import math
import os

import pytest
import torch

import env_tictactoe
from common import Scorer, load_model
from conftest import poison_loss, run_main
from sample import ChatTokens


def test_loss_mask_covers_exactly_the_assistant_turns(tiny_model_dir):
    _, tok = load_model(tiny_model_dir)
    env = env_tictactoe.load_environment()
    chat = ChatTokens(tok, env.system_prompt)
    replies = ["<think>zentre</think><move>4</move>", "<think>blok</think><move>2</move>", "no tag at all"]
    msgs = [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": "New game.\n0|1|2"}]
    for i, r in enumerate(replies):
        msgs += [{"role": "assistant", "content": r}, {"role": "user", "content": f"turn {i} board"}]
    msgs = msgs[:-1]  # the conversation ends with the model's reply
    ids, mask = chat.encode_conversation(msgs)
    assert len(ids) == len(mask)
    runs, cur = [], []  # maximal runs of trained tokens
    for t, m in zip(ids + [None], mask + [0]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    assert [tok.decode(r[:-1]) for r in runs] == replies
    assert all(r[-1] == chat.eot_id for r in runs)  # the end-of-turn token is learned too
    untrained = tok.decode([t for t, m in zip(ids, mask) if not m])
    assert env.system_prompt in untrained and "turn 0 board" in untrained and "turn 1 board" in untrained
    assert "zentre" not in untrained and "blok" not in untrained and "no tag at all" not in untrained
    # the layout is the template's own rendering where the template is prefix-stable (ChatML)
    # (the template adds a newline after the last end-of-turn; a trajectory stops at the end-of-turn token)
    assert tok.decode(ids) + "\n" == tok.apply_chat_template(msgs, tokenize=False)


def test_sft_loss_weights_assistant_and_context_tokens(tiny_model_dir):
    """sft_loss against a hand computation from the full logits: assistant tokens weight 1, the rest
    (system prompt, environment messages) --context_loss, padding nothing."""
    from sft import sft_loss
    model, tok = load_model(tiny_model_dir)
    env = env_tictactoe.load_environment()
    chat = ChatTokens(tok, env.system_prompt)
    msgs = [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": "New game.\n0|1|2"},
            {"role": "assistant", "content": "<think>centre</think><move>4</move>"}, {"role": "user", "content": "You took cell 4."},
            {"role": "assistant", "content": "<think>corner</think><move>0</move>"}]
    rows = [chat.encode_conversation(msgs), chat.encode_conversation(msgs[:3])]  # two lengths: the second is padded
    with torch.no_grad():
        for lam in (0.0, 0.5):
            loss, reply_nll, ctx_nll, n_ctx = sft_loss(Scorer(model), rows, lam, chat.eot_id)
            want_reply = want_ctx = 0.0
            for ids, mask in rows:
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)  # (T-1, V)
                nll = -logp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)  # (T-1,)
                m = torch.tensor(mask[1:], dtype=torch.bool)
                want_reply += nll[m].sum().item()
                want_ctx += nll[~m].sum().item()
            assert abs(reply_nll - want_reply) < 1e-3
            assert abs(loss.item() - (want_reply + lam * want_ctx)) < 1e-3
            assert n_ctx == (sum(len(i) - 1 - sum(m[1:]) for i, m in rows) if lam else 0)
            assert abs(ctx_nll - (want_ctx if lam else 0.0)) < 1e-3


def test_shared_prefix_forward_equals_full_forward(tiny_model_dir):
    """decoder_hidden runs the rows' common prefix once: same hidden states and same gradients as the full forward."""
    from common import decoder_hidden
    model, _ = load_model(tiny_model_dir)
    torch.manual_seed(0)
    shared = torch.randint(0, model.config.vocab_size, (1, 12)).expand(4, -1)
    ids = torch.cat([shared, torch.randint(0, model.config.vocab_size, (4, 9))], 1)  # (4, 21): 12 tokens in common
    ids[1, -3:] = 0  # right padding, as in a batch
    weight = torch.randn(4, 21, model.config.hidden_size)
    grads = []
    for forward in (lambda: model.get_decoder()(input_ids=ids).last_hidden_state, lambda: decoder_hidden(model, ids)):
        model.zero_grad()
        hidden = forward()
        (hidden * weight).sum().backward()
        grads.append((hidden.detach(), [p.grad.clone() for p in model.parameters()]))
    (h_full, g_full), (h_shared, g_shared) = grads
    # the shared prefix's keys computed once, broadcast: the same fp32 sums (<= 64 terms, |terms| summing to < 1
    # with weights of std 0.02) in other orders, each within 64 * 6e-8 = 4e-6, about ten of them deep: 1e-5 (rtol
    # 1e-4 for the gradients, sums of the same kind); a wrong position or mask moves them by ~1
    assert torch.allclose(h_full, h_shared, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(g_full, g_shared))
    calls = []
    hook = model.get_decoder().register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape), with_kwargs=True)
    decoder_hidden(model, ids)
    hook.remove()
    assert calls == [(1, 12), (4, 9)]  # the prefix once, then only the rest of every row
    other = ids.clone()
    other[2, 3] = (other[2, 3] + 1) % model.config.vocab_size  # rows now share only 3 tokens: plain forward
    assert torch.allclose(decoder_hidden(model, other), model.get_decoder()(input_ids=other).last_hidden_state, atol=1e-5)


def sft_in_process(capsys, *args):
    """sft.py's main() in this process (no interpreter to start): returns what it stopped with, the SystemExit's
    message or argparse's, on stderr."""
    with pytest.raises(SystemExit) as e:
        run_main("sft", list(args))
    assert e.value.code not in (0, None), "sft.py stopped as if it had succeeded"
    return f"{e.value.code} {capsys.readouterr().err}"


def test_bad_data_and_bad_model(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}\nnot json\n')
    assert "bad.jsonl:2" in sft_in_process(capsys, "--data", str(bad), "--out", str(tmp_path / "o"))
    assert os.listdir(tmp_path) == ["bad.jsonl"]  # read before the scratch model is built: nothing written
    said = sft_in_process(capsys, "--model", str(tmp_path / "missing_model"), "--n_games", "4", "--out", str(tmp_path / "o2"))
    assert "could not load model" in said
    assert not os.path.exists(tmp_path / "o2")  # the model is loaded before a game is played or a file written
    said = sft_in_process(capsys, "--teacher", "random", "--keep", "reward>=99", "--n_games", "2", "--out", str(tmp_path / "o3"))
    assert "no conversations left" in said
    said = sft_in_process(capsys, "--n_games", "0", "--out", str(tmp_path / "o4"))
    assert "--n_games 0: must be >= 1" in said and not os.path.exists(tmp_path / "o4")


SMALL = ["--vocab_size", "300", "--d_model", "32", "--n_layers", "2", "--n_heads", "2", "--n_games", "24",
         "--batch", "8", "--lr", "3e-3", "--warmup", "1", "--eval_n", "2", "--device", "cpu"]


def test_scratch_smoke_and_exact_resume(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    out = run_main("sft", [*SMALL, "--max_steps", "4", "--eval_every", "0", "--save_every", "2", "--schedule", "constant", "--out", a])
    assert "step 4 | loss" in out and "games played" in out
    model = AutoModelForCausalLM.from_pretrained(a)  # a plain transformers load
    assert model.config.model_type == "llama"
    results = json.load(open(os.path.join(a, "sft_results.json")))
    assert results["step"] == 4 and "optimal" in results["eval"] and results["eval"]["random"]["n"] == 2
    assert json.load(open(os.path.join(a, "sft_args.json")))["max_steps"] == 4
    assert "win_rate" in run_main("eval", ["--model", a, "--setting", "random", "-n", "2", "--max_new_tokens", "8"])
    # interrupted after 2 steps (same data: the scratch build and the teacher games are seeded), then resumed
    run_main("sft", [*SMALL, "--max_steps", "2", "--eval_every", "0", "--schedule", "constant", "--out", b])
    out = run_main("sft", [*SMALL, "--max_steps", "4", "--eval_every", "0", "--schedule", "constant", "--out", b, "--resume"])
    assert "resumed from" in out
    wa, wb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)  # the same schedule: exact
    # a finished run resumed (speedrun.sh RESUME=1 after a later stage stopped) does nothing: no second final
    # evaluation in the log
    rows = open(os.path.join(b, "metrics.jsonl")).read()
    out = run_main("sft", [*SMALL, "--max_steps", "4", "--eval_every", "0", "--schedule", "constant", "--out", b, "--resume"])
    assert "nothing to do" in out
    assert open(os.path.join(b, "metrics.jsonl")).read() == rows


def test_non_finite_updates_are_skipped_then_stop_sft(tmp_path, monkeypatch):
    """From its fifth micro-batch the loss is NaN: those updates are skipped (the saved weights stay
    finite), and the third step in a row with one stops the run, saying what to do."""
    import sft
    from safetensors.torch import load_file
    poison_loss(monkeypatch, sft, "sft_loss", clean_calls=4)
    out = str(tmp_path / "sft")
    with pytest.raises(SystemExit, match="3 non-finite updates in a row: stopping"):
        run_main("sft", [*SMALL, "--max_steps", "20", "--eval_every", "0", "--save_every", "1",
                         "--token_budget", "100000", "--out", out])
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7]  # a micro-batch a step
    assert [math.isfinite(r["grad_norm"]) for r in rows] == [True] * 4 + [False] * 3
    assert torch.load(os.path.join(out, "trainer_state.pt"), weights_only=True)["step"] == 6
    assert all(torch.isfinite(w).all() for w in load_file(os.path.join(out, "model.safetensors")).values())
