"""rl.py: the loss against hand computations, chunked logprobs, and a CPU smoke run with exact resume."""
import argparse
import contextlib
import json
import math
import os

import pytest
import torch

from common import token_logprobs
from conftest import poison_loss, run_main
from rl import policy_loss

T = torch.tensor


def close(a, b):
    return abs(float(torch.as_tensor(a).detach()) - float(b)) < 1e-6


def test_a_replay_replaces_its_example_but_its_seed():
    """--exploit: a replayed line takes the place of one of the step's examples, keeping only its seed, so nothing of a
    puzzle's start (its position, its turn limit) is left in the replay."""
    import env_tictactoe_lab as lab
    from rl import Exploiter
    env = lab.load_environment(puzzles=1.0)
    replay = {"model_first": True, "replies": {}, "random_move_prob": 0.0}
    plain = env.examples(4, seed=0)
    exploiter = Exploiter(env, 1, "/tmp/unused", 0, None, resume=False)
    exploiter.replays = [replay]
    examples = exploiter.replay(env.examples(4, seed=0), step=0)
    assert examples[0] == {"seed": plain[0]["seed"], **replay}
    assert examples[1:] == plain[1:] and all("position" in ex for ex in examples[1:])


# ----------------------------------------------------------------------------- the loss by hand

def test_cispo_on_policy_is_reinforce():
    logp = T([-1.0, -2.0, -0.5])
    adv, w = T([1.0, 1.0, -2.0]), T([1 / 3] * 3)
    loss, clipped = policy_loss(logp, logp.clone(), adv, w, "cispo")
    # r = 1 everywhere: l = -A * logp, averaged: -(1*-1 + 1*-2 + -2*-0.5) / 3 = 2/3
    assert close(loss, 2 / 3) and not clipped.any()


def test_cispo_clips_weight_but_keeps_gradient():
    logp = T([-1.0, -1.0, -1.0], requires_grad=True)
    old = T([-1.0 - math.log(1.5), -1.0 - math.log(1.1), -1.0 + math.log(2.0)])  # r = 1.5, 1.1, 0.5
    adv, w = T([2.0, 2.0, 2.0]), T([1.0, 1.0, 1.0])
    loss, clipped = policy_loss(logp, old, adv, w, "cispo", eps_high=0.2)
    # weights sg(min(r, 1.2)) = 1.2, 1.1, 0.5 (no lower clip): l = -w * A * logp = w * 2
    assert close(loss, (1.2 + 1.1 + 0.5) * 2.0)
    assert clipped.tolist() == [True, False, False]
    loss.backward()
    assert torch.allclose(logp.grad, T([-2.4, -2.2, -1.0]))  # every token keeps a gradient, -w * A
    loss_low, clipped_low = policy_loss(logp.detach(), old, adv, w, "cispo", eps_low=0.2, eps_high=0.2)
    assert close(loss_low, (1.2 + 1.1 + 0.8) * 2.0) and clipped_low.tolist() == [True, False, True]


def test_cispo_boundary_is_not_clipped():
    logp = T([0.0])
    loss, clipped = policy_loss(logp - 1, logp - 1 - math.log(1.2), T([1.0]), T([1.0]), "cispo", eps_high=0.2)
    assert close(loss, 1.2 * 1.0) and not clipped.any()  # r == 1 + eps_high exactly: weight 1.2, not counted as clipped


def test_grpo_clipped_objective():
    logp = T([0.0, 0.0, 0.0, 0.0], requires_grad=True)
    old = -torch.log(T([1.5, 0.5, 1.5, 0.5]))  # r = 1.5, 0.5, 1.5, 0.5
    adv = T([1.0, 1.0, -1.0, -1.0])
    loss, clipped = policy_loss(logp, old, adv, T([0.25] * 4), "grpo", eps_high=0.2)
    # per token -min(rA, clip(r, .8, 1.2)A): A>0,r=1.5 -> -1.2 ; A>0,r=.5 -> -.5 ; A<0,r=1.5 -> 1.5 ; A<0,r=.5 -> .8
    assert close(loss, (-1.2 - 0.5 + 1.5 + 0.8) / 4)
    assert clipped.tolist() == [True, False, False, True]
    loss.backward()  # clipped tokens have no gradient; the others d(-rA)/dlogp = -rA
    assert torch.allclose(logp.grad, T([0.0, -0.5, 1.5, 0.0]) / 4)


def test_grpo_clip_higher_and_boundary():
    logp = T([0.0, 0.0])
    old = -torch.log(T([1.28, 1.25]))
    loss, clipped = policy_loss(logp, old, T([1.0, 1.0]), T([1.0, 1.0]), "grpo", eps_low=0.2, eps_high=0.28)
    assert close(loss, -1.28 - 1.25) and not clipped.any()


def test_zero_advantage_group_gives_zero_loss_and_gradient():
    rewards = T([[0.5, 0.5, 0.5, 0.5]])
    adv = (rewards - rewards.mean(1, keepdim=True)).flatten()
    assert torch.equal(adv, torch.zeros(4))
    for kind in ("cispo", "grpo"):
        logp = T([-1.0, -2.0, -3.0, -4.0], requires_grad=True)
        loss, _ = policy_loss(logp, logp.detach() - 0.3, adv, T([0.25] * 4), kind)
        loss.backward()
        assert close(loss, 0.0) and torch.equal(logp.grad, torch.zeros(4))


def test_kl_penalty_k3():
    logp, ref = T([-1.0]), T([-1.5])
    loss, _ = policy_loss(logp, logp, T([0.0]), T([1.0]), "cispo", ref_logp=ref, beta=0.1)
    d = -0.5
    assert close(loss, 0.1 * (math.exp(d) - d - 1))


def test_sequence_vs_token_weights():
    # two episodes: 1 token with A=1, 3 tokens with A=-1, logp = -1 everywhere, on-policy
    logp, adv = T([-1.0] * 4), T([1.0, -1.0, -1.0, -1.0])
    token, _ = policy_loss(logp, logp, adv, T([0.25] * 4), "cispo")
    seq, _ = policy_loss(logp, logp, adv, T([1 / 2, 1 / 6, 1 / 6, 1 / 6]), "cispo")
    assert close(token, (1 - 3) / 4) and close(seq, (1 - 1) / 2)


# ----------------------------------------------------------------------------- chunked logprobs

def test_token_logprobs_match_full_softmax(tiny_model_dir):
    from common import load_model
    model, _ = load_model(tiny_model_dir)
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (3, 20))
    mask = (torch.rand(3, 20) > 0.5).long()
    mask[:, 0] = 0
    with torch.no_grad():
        full = torch.log_softmax(model(ids).logits.float() / 0.7, -1)[:, :-1].gather(2, ids[:, 1:, None]).squeeze(2)  # (B, T-1)
        lp, ent = token_logprobs(model, ids, mask, 0.7, chunk=7)
    # chunks of 7 positions against one pass: each logit a sum of d = 32 fp32 products (normalised hidden states
    # times weights of std 0.02: |terms| summing to < 1), blocked otherwise: within 32 * 6e-8 = 2e-6, a logprob
    # twice that, so 1e-5; an off-by-one position moves a logprob by ~1
    assert torch.allclose(lp, full[mask[:, 1:].bool()], atol=1e-5)
    assert (ent > 0).all()


def test_compiled_layers_give_the_eager_gradients_under_checkpointing(f64_model_dir):
    """--compile: inside compiled_layers the decoder layers run compiled (here with the aot_eager backend: the same
    autograd plumbing as inductor, without its code generation), forward, checkpoint recomputation and backward;
    the logprobs and every gradient are those of the eager layers; outside, the layers are eager again."""
    from common import load_model
    from engine import compile_layers, compiled_layers, enable_grad_ckpt
    compiles = []

    def counting_backend(gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager
        compiles.append(gm)
        return aot_eager(gm, example_inputs)
    model, _ = load_model(f64_model_dir, train=True)
    assert next(model.parameters()).dtype == torch.float64
    enable_grad_ckpt(model, "on", "cpu")
    model.train()
    torch.manual_seed(0)
    batches = [torch.randint(0, model.config.vocab_size, (B, T)) for B, T in ((3, 20), (2, 31))]

    def grads(compiled):
        out = []
        for ids in batches:
            model.zero_grad()
            mask = torch.ones_like(ids)
            mask[:, :4] = 0
            with compiled_layers(model) if compiled else contextlib.nullcontext():
                lp, _ = token_logprobs(model, ids, mask, 0.7)
                lp.sum().backward()
            out += [lp.detach()] + [p.grad.clone() for p in model.parameters()]
        return out
    eager = grads(False)
    assert compile_layers(model, "on", "cpu", backend=counting_backend)
    assert compile_layers(model, "off", "cpu") is False and compile_layers(model, "auto", "cpu") is False
    assert compile_layers(model, "auto", "cuda") is False  # a small model: not worth its compilation
    compiled = grads(True)
    assert compiles, "the layers went through the compiler"
    # The same aten ops, some decomposed or fused in another order: float64's rounding (1.1e-16) of sums of fewer
    # than 1e3 terms, each term and each gradient here below 1e2 in size, differs by < 1e3 * 1.1e-16 * 1e2 = 1.1e-11
    # per op, a few dozen ops deep: 1e-9 holds it with room. A wrong checkpoint recompute (another mask, position
    # or dropout) moves a gradient by orders more.
    for a, b in zip(eager, compiled):
        assert a.abs().max() < 1e2
        torch.testing.assert_close(a, b, atol=1e-9, rtol=0)
    assert all(layer._compiled_call_impl is None for layer in model.get_decoder().layers)
    n = len(compiles)
    grads(False)
    assert len(compiles) == n


# ----------------------------------------------------------------------------- CPU smoke run and exact resume

DIGITS_ENV = '''
"""A test environment: reward = share of digits in the reply (a random model gets varied rewards)."""
class Digits:
    system_prompt = "Answer with digits."
    reward_weights = {"digits": 1.0}
    max_turns = 1
    def examples(self, n, seed=0):
        return [{"seed": seed * 1000 + i} for i in range(n)]
    def reset(self, example):
        return {"reply": "", "seed": example["seed"]}, f"Example {example['seed']}: some digits please."
    def step(self, state, reply):
        state["reply"] = reply
        return None
    def rewards(self, state):
        r = state["reply"]
        return {"digits": sum(c.isdigit() for c in r) / max(len(r), 1)}
def load_environment():
    return Digits()
'''


def run_rl(model, out, steps, extra=(), env_dir=None):
    return run_main("rl", ["--model", model, "--env", "digits", "--batch", "8", "--group", "4", "--steps", str(steps),
                           "--max_new_tokens", "6", "--lr", "1e-2", "--warmup", "1", "--eval_every", "0", "--eval_n", "2",
                           "--save_every", "2", "--temp", "1.5", "--out", out, "--device", "cpu", *extra], env_dir)


def train_lines(out):
    skip = ("step_time", "gen_tokens_per_s", "train_tokens_per_s")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [{k: v for k, v in r.items() if k not in skip} for r in rows if "reward" in r]


def test_rl_smoke_and_exact_resume(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file
    (tmp_path / "env_digits.py").write_text(DIGITS_ENV)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    out = run_rl(tiny_model_dir, a, 4, env_dir=str(tmp_path))
    assert "step 4 | reward" in out
    rows = train_lines(a)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert any(r["grad_norm"] > 0 for r in rows), "the smoke run never produced a gradient"
    for key in ("reward", "step", "entropy", "clip_frac", "grad_norm", "lr", "reply_len", "reply_len_max"):
        assert key in rows[0]
    assert "kl" not in rows[0]  # no --beta, no KL (test_rl_with_a_kl_penalty_logs_the_kl)
    assert os.path.exists(os.path.join(a, "model.safetensors")) and os.path.exists(os.path.join(a, "trainer_state.pt"))
    run_rl(tiny_model_dir, b, 2, env_dir=str(tmp_path))  # "interrupted" after 2 steps ...
    run_rl(tiny_model_dir, b, 4, ["--resume"], env_dir=str(tmp_path))  # ... and resumed
    assert train_lines(b) == rows
    log = open(os.path.join(b, "metrics.jsonl")).read()
    assert "nothing to do" in run_rl(tiny_model_dir, b, 4, ["--resume"], env_dir=str(tmp_path))  # a finished run
    assert open(os.path.join(b, "metrics.jsonl")).read() == log, "resuming a finished run repeated its final rows"
    wa, wb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    from transformers import AutoModelForCausalLM
    assert AutoModelForCausalLM.from_pretrained(a) is not None


@pytest.mark.parametrize("env, env_args", [("tictactoe", '{"max_turns": 3}'), ("reverse", "{}")])
def test_both_engines_run_rl_alike(tiny_model_dir, tmp_path, env, env_args):
    """rl.py --engine hf (generate()) and --engine fast each run a short multi-turn tic-tac-toe and a single-turn
    reverse-text run, and give the same steps: the same sampled tokens, so the same rewards, lengths and losses."""
    rows = {}
    for engine in ("hf", "fast"):
        out = str(tmp_path / engine)
        printed = run_main("rl", ["--model", tiny_model_dir, "--env", env, "--env_args", env_args, "--batch", "8",
                                  "--group", "4", "--steps", "2", "--max_new_tokens", "6", "--lr", "1e-2", "--eval_every", "0",
                                  "--eval_n", "2", "--save_every", "0", "--temp", "1.5", "--engine", engine, "--out", out,
                                  "--device", "cpu"])
        assert "step 2 | reward" in printed and json.load(open(os.path.join(out, "rl_args.json")))["engine"] == engine
        rows[engine] = train_lines(out)
    for a, b in zip(rows["hf"], rows["fast"], strict=True):
        assert a["reward"] == b["reward"] and a["reply_len"] == b["reply_len"] and a["zero_adv"] == b["zero_adv"], (a, b)
        # the trainer computes these from the sampled tokens alone, the same in both: exact
        assert a["entropy"] == b["entropy"] and a["grad_norm"] == b["grad_norm"], (a, b)


def test_non_finite_updates_are_skipped_then_stop_the_run(tiny_model_dir, tmp_path, monkeypatch):
    """From its third call the loss is NaN: each such update is skipped (the weights stay finite),
    and the third step in a row with one stops the run, saying what to do."""
    import rl
    from safetensors.torch import load_file
    (tmp_path / "env_digits.py").write_text(DIGITS_ENV)
    poison_loss(monkeypatch, rl, "policy_loss", clean_calls=2)
    out = str(tmp_path / "rl")
    with pytest.raises(SystemExit, match="3 non-finite updates in a row: stopping"):
        run_rl(tiny_model_dir, out, 8, ["--save_every", "1", "--engine", "hf"], str(tmp_path))
    skipped = [r["skipped_updates"] for r in train_lines(out)]
    assert skipped[-3:] == [1, 1, 1] and not any(skipped[:-3]) and len(skipped) < 8, skipped
    saved = torch.load(os.path.join(out, "trainer_state.pt"), weights_only=True)["step"]
    assert saved == len(skipped) - 1  # the stopping step's save is not made
    assert all(torch.isfinite(w).all() for w in load_file(os.path.join(out, "model.safetensors")).values())


def test_rl_with_a_kl_penalty_logs_the_kl(tiny_model_dir, tmp_path):
    """--beta loads a frozen reference (the initial model) and logs the penalty's KL estimate: 0 at step 1, where
    the policy is still the reference, above 0 once the updates have moved it (without --beta no "kl" is logged:
    test_rl_smoke_and_exact_resume)."""
    (tmp_path / "env_digits.py").write_text(DIGITS_ENV)
    run_rl(tiny_model_dir, str(tmp_path / "kl"), 3, ["--beta", "0.1"], env_dir=str(tmp_path))
    rows = train_lines(str(tmp_path / "kl"))
    assert abs(rows[0]["kl"]) < 1e-6 and rows[-1]["kl"] > 1e-6 and all(r["kl"] >= 0 for r in rows), [r["kl"] for r in rows]
    assert json.load(open(tmp_path / "kl" / "rl_args.json"))["beta"] == 0.1


def test_rl_exploit_certifies_and_resumes_exactly(tiny_model_dir, tmp_path):
    """--exploit N: the certificate of the greedy policy at steps 0, N, 2N, ... is logged and its lines are
    replayed; a run resumed between two certificates replays the same lines (kept in the trainer state)."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    extra = ["--env", "tictactoe", "--env_args", '{"max_turns": 3}', "--exploit", "3"]
    run_rl(tiny_model_dir, a, 4, extra, env_dir=str(tmp_path))
    rows = [json.loads(line) for line in open(os.path.join(a, "metrics.jsonl"))]
    cert = [r for r in rows if "exploit_lines_lost" in r]
    assert [r["step"] for r in cert] == [0, 3, 4] and all(r["exploit_mistakes"] > 0 for r in cert)  # 4: the end
    state = torch.load(os.path.join(a, "trainer_state.pt"), weights_only=True)
    assert state["exploit_lines"]
    # DIR_best: the weights of the best certificate (fewest lost lines, then mistakes, the latest on a tie)
    best = min(cert, key=lambda r: (r["exploit_lines_lost"], r["exploit_mistakes"], -r["step"]))
    saved = json.loads(open(a + "_best/exploit.json").read())
    assert saved["step"] == best["step"] == state["exploit_best"]["step"] and saved["lines_lost"] == best["exploit_lines_lost"]
    from transformers import AutoModelForCausalLM
    assert AutoModelForCausalLM.from_pretrained(a + "_best") is not None
    run_rl(tiny_model_dir, b, 2, extra, env_dir=str(tmp_path))
    run_rl(tiny_model_dir, b, 4, extra + ["--resume"], env_dir=str(tmp_path))
    assert train_lines(b) == train_lines(a)


def test_a_finished_exploit_run_extended_logs_its_last_certificate_once(tiny_model_dir, tmp_path):
    """A run whose last step is a certificate step, resumed with more --steps, replays that certificate's lines
    without running it again: its log and training equal an uninterrupted run's."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    extra = ["--env", "tictactoe", "--env_args", '{"max_turns": 3}', "--exploit", "2"]
    run_rl(tiny_model_dir, a, 3, extra, env_dir=str(tmp_path))
    run_rl(tiny_model_dir, b, 2, extra, env_dir=str(tmp_path))
    run_rl(tiny_model_dir, b, 3, extra + ["--resume"], env_dir=str(tmp_path))
    certified = lambda out: [json.loads(line)["step"] for line in open(os.path.join(out, "metrics.jsonl")) if "exploit_lines" in line]
    assert certified(a) == certified(b) == [0, 2, 3]
    assert train_lines(b) == train_lines(a)


def test_exploit_stop_ends_the_run_at_a_certificate_without_mistakes(tiny_model_dir, tmp_path, monkeypatch):
    """exploit_stop (tictactoe_lab's): once a certificate finds no mistake to replay the run stops there, that certificate logged
    once, its weights the best and the final checkpoint's; --resume then has nothing to do."""
    import env_tictactoe as ttt
    real, calls = ttt.TicTacToe.exploit, []

    def perfect_at_the_third(self, policy):  # the tiny random model errs everywhere: its third certificate is made clean
        summary, key, found = real(self, policy)
        calls.append(1)
        return (summary, (0, 0), []) if len(calls) == 3 else (summary, key, found)
    monkeypatch.setattr(ttt.TicTacToe, "exploit", perfect_at_the_third)
    out = str(tmp_path / "stop")
    extra = ["--env", "tictactoe_lab", "--env_args", '{"max_turns": 3, "exploit_stop": true}', "--exploit", "1"]
    said = run_rl(tiny_model_dir, out, 4, extra, env_dir=str(tmp_path))
    assert "exploit_stop: the verdict at step 2 finds nothing to replay: stopping" in said
    assert [r["step"] for r in train_lines(out)] == [1, 2]
    certified = lambda: [json.loads(line)["step"] for line in open(os.path.join(out, "metrics.jsonl")) if "exploit_lines" in line]
    assert certified() == [0, 1, 2]
    state = torch.load(os.path.join(out, "trainer_state.pt"), weights_only=True)
    assert state["step"] == 2 and state["exploit_lines"] == [] and state["exploit_best"]["step"] == 2
    assert json.load(open(out + "_best/exploit.json"))["step"] == 2
    rows = open(os.path.join(out, "metrics.jsonl")).read()
    said = run_rl(tiny_model_dir, out, 4, extra + ["--resume"], env_dir=str(tmp_path))
    assert "holds the final checkpoint (step 2, --steps 4): nothing to do" in said
    assert open(os.path.join(out, "metrics.jsonl")).read() == rows and len(calls) == 3
    with pytest.raises(SystemExit, match="give --exploit N too"):
        run_rl(tiny_model_dir, str(tmp_path / "no"), 1, ["--env", "tictactoe_lab", "--env_args", '{"exploit_stop": true}'], env_dir=str(tmp_path))


def test_exploit_with_replay_explore_trains_forced_moves(tiny_model_dir, tmp_path, monkeypatch):
    """--exploit with tictactoe_lab's replay_explore: in each step's replayed example (the random tiny model errs on
    every line), the odd rollouts play a scripted move at the mistake, recorded as the model's tokens (mask 1) and
    given an advantage like any sampled reply; the other example's rollouts all sample."""
    import env_tictactoe as ttt
    import env_tictactoe_lab as lab
    import rl
    real, seen = rl.sample_rollouts, []

    def spy(*args, **kwargs):
        records = real(*args, **kwargs)
        seen.append(records)
        return records
    monkeypatch.setattr(rl, "sample_rollouts", spy)
    run_main("rl", ["--model", tiny_model_dir, "--batch", "8", "--group", "4", "--steps", "2", "--max_new_tokens", "60",
                    "--eval_every", "0", "--eval_n", "2", "--out", str(tmp_path / "rl"), "--device", "cpu", "--exploit", "1",
                    "--env", "tictactoe_lab", "--env_args", '{"max_turns": 2, "replay_explore": "rules"}'])
    assert len(seen) == 2
    for records in seen:
        replayed, other = records[:4], records[4:]
        board = replayed[0]["example"]["explore"]
        assert board.count("X") == 0  # the mistake of the line replayed is the model's first move: its first reply
        for r in replayed:
            reply = r["messages"][2]["content"]
            forced = lab.scripted_reply("rules", board, ttt.parse_move(reply, board)[0]) if r["rollout"] % 2 else None
            assert (reply == forced) == bool(r["rollout"] % 2)
            assert sum(r["mask"]) > 0
        assert not any("explore" in r["example"] for r in other)


def test_resume_after_a_crash_past_a_certificate_logs_it_once(tiny_model_dir, tmp_path, monkeypatch):
    """A save step's certificate is logged after its checkpoint: a crash after it and --resume redo that
    certificate, and the log holds each row once, in the order of an uninterrupted run."""
    import rl
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    extra = ["--env", "tictactoe", "--env_args", '{"max_turns": 3}', "--exploit", "2"]
    run_rl(tiny_model_dir, a, 3, extra, env_dir=str(tmp_path))
    real, calls = rl.sample_rollouts, []

    def crash_in_the_third_rollout(*args, **kwargs):  # step 2's: after save(2) and the certificate of step 2
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("killed")
        return real(*args, **kwargs)
    monkeypatch.setattr(rl, "sample_rollouts", crash_in_the_third_rollout)
    with pytest.raises(RuntimeError, match="killed"):
        run_main("rl", ["--model", tiny_model_dir, "--batch", "8", "--group", "4", "--steps", "3", "--max_new_tokens", "6",
                        "--eval_every", "0", "--eval_n", "2", "--save_every", "2", "--out", b, "--device", "cpu", *extra])
    run_rl(tiny_model_dir, b, 3, extra + ["--resume"], env_dir=str(tmp_path))
    kinds = lambda out: [(json.loads(line)["step"], "exploit_lines" in line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert kinds(b) == kinds(a)
    assert [step for step, certificate in kinds(a) if certificate] == [0, 2, 3]


@pytest.mark.parametrize("where, knob", [("rollout", "--gen_batch"), ("update", "--token_budget")])
def test_out_of_memory_says_what_to_lower(tiny_model_dir, tmp_path, monkeypatch, where, knob):
    import rl

    def oom(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 990.00 MiB.")
    monkeypatch.setattr(rl, where, oom)
    with pytest.raises(SystemExit, match=f"out of GPU memory in the {where}.*{knob}"):
        run_main("rl", ["--model", tiny_model_dir, "--batch", "4", "--group", "2", "--steps", "1", "--max_new_tokens", "4",
                        "--eval_every", "0", "--device", "cpu", "--out", str(tmp_path / "rl")])


def test_a_failed_compilation_says_to_turn_it_off(tiny_model_dir, tmp_path, monkeypatch):
    """The update runs the decoder layers compiled (rl.update enters compiled_layers itself), and a compiler that
    fails on them stops rl.py with what to change."""
    import engine
    import rl

    def compiler_failing_on_layers(gm, example_inputs):
        if "self_attn" in gm.code:  # a decoder layer's graph (the LM head's compiles)
            raise RuntimeError("no C++ compiler found")
        return gm.forward
    monkeypatch.setattr(rl, "compile_layers", lambda model, setting, device: engine.compile_layers(
        model, "on", device, backend=compiler_failing_on_layers))
    # the same layer code compiled by an earlier test in this process must not stand in for this compiler
    torch._dynamo.reset()
    # every episode has an advantage, whatever the rewards of a random model: the update runs its forwards
    monkeypatch.setattr(rl, "group_advantages", lambda rewards, *a: torch.tensor([(-1.0) ** i for i in range(len(rewards))]))
    with pytest.raises(SystemExit, match="torch.compile failed on the update's layers: run with TORCH_COMPILE_DISABLE=1"):
        run_main("rl", ["--model", tiny_model_dir, "--batch", "4", "--group", "2", "--steps", "1", "--max_new_tokens", "4",
                        "--eval_every", "0", "--device", "cpu", "--out", str(tmp_path / "rl")])


def test_resume_refuses_a_checkpoint_that_would_run_code(tmp_path):
    """--resume loads trainer_state.pt as data only: a pickled payload (here a shell command) is refused, not run."""
    import argparse
    import common

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))
    torch.save({"step": 3, "optimizer": Payload()}, tmp_path / "trainer_state.pt")
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(SystemExit, match="refusing it"):
        common.start_or_resume(argparse.Namespace(out=str(tmp_path)), opt, resume=True)
    assert not (tmp_path / "ran").exists()


class _Saved:
    """A stand-in for a model and a tokenizer: save_pretrained writes one file."""

    def __init__(self, name, step):
        self.name, self.step = name, step
        self.generation_config = argparse.Namespace()  # save_checkpoint sets its sampling fields

    def save_pretrained(self, path, **kw):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, self.name), "w") as f:
            f.write(str(self.step))


def test_a_kill_anywhere_in_a_save_leaves_the_newest_complete_checkpoint(tmp_path, monkeypatch):
    """save_checkpoint killed before each of its file operations in turn (the kill is an exception raised there),
    then --resume's finish_save: DIR holds a complete checkpoint, the new one as soon as its state was written,
    with the run's logs and data beside it, and nothing else is left over."""
    import shutil
    import common
    out = str(tmp_path / "run")
    ops = [(os, "rename"), (os, "replace"), (shutil, "move"), (torch, "save")]

    def save(step):
        common.save_checkpoint(_Saved("model.txt", step), _Saved("tok.txt", step), out, {"step": step}, {"args.json": {}})
        with open(os.path.join(out, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": step}) + "\n")

    class Killed(Exception):
        pass

    def arm(at):
        """Raise Killed at the at-th file operation from now on; returns the counter."""
        count = [0]
        for module, name in ops:
            real = getattr(module, name)

            def op(*a, real=real, **kw):
                count[0] += 1
                if count[0] == at:
                    raise Killed
                return real(*a, **kw)
            monkeypatch.setattr(module, name, op)
        return count
    shutil.rmtree(out, ignore_errors=True)
    save(1)
    n_ops = arm(0)
    save(2)
    monkeypatch.undo()
    n_ops, newest_at = n_ops[0], None
    assert n_ops >= 5
    for at in range(1, n_ops + 1):
        shutil.rmtree(tmp_path, ignore_errors=True)
        os.makedirs(tmp_path)
        save(1)
        arm(at)
        with pytest.raises(Killed):
            common.save_checkpoint(_Saved("model.txt", 2), _Saved("tok.txt", 2), out, {"step": 2}, {"args.json": {}})
        monkeypatch.undo()
        common.finish_save(out)
        assert sorted(os.listdir(tmp_path)) == ["run"], (at, os.listdir(tmp_path))
        state = torch.load(os.path.join(out, "trainer_state.pt"), weights_only=True)
        assert open(os.path.join(out, "model.txt")).read() == open(os.path.join(out, "tok.txt")).read() == str(state["step"])
        assert [json.loads(line)["step"] for line in open(os.path.join(out, "metrics.jsonl"))] == [1], at
        if state["step"] == 2 and newest_at is None:
            newest_at = at
        assert state["step"] == (2 if newest_at is not None else 1), "once the new state was written, it is the one kept"
    assert newest_at is not None and newest_at < n_ops


def test_resume_drops_a_metrics_line_cut_short(tmp_path):
    """A crash mid-write leaves half a line at the end of metrics.jsonl: --resume drops it (and the lines after
    the checkpoint) instead of failing on it."""
    import argparse
    import common
    torch.save({"step": 2, "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]},
                "rng": common.rng_state()}, tmp_path / "trainer_state.pt")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "x": 1}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "x')
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert common.start_or_resume(argparse.Namespace(out=str(tmp_path)), opt, resume=True)["step"] == 2
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_non_finite_weights_stop_the_rollout_with_a_message(tiny_model, short_env):
    """Weights that went NaN make every logit NaN: the rollout stops with a line saying what to do, no traceback."""
    import copy
    import rl
    from sample import HFPolicy
    model = copy.deepcopy(tiny_model[0])
    with torch.no_grad():
        model.get_output_embeddings().weight.fill_(float("nan"))
    policy = HFPolicy(model, tiny_model[1], short_env.system_prompt, temp=1.0, max_new_tokens=4)
    with pytest.raises(SystemExit, match="not finite"):
        rl.sample_rollouts(short_env, short_env.examples(2), policy, 2, 0)


def test_grad_ckpt_and_compile_auto_are_on_for_big_models_on_a_gpu(tiny_model_dir, monkeypatch):
    """--grad_ckpt: alone means on, absent means auto; auto turns checkpointing on only on a GPU and only from
    GRAD_CKPT_AUTO_PARAMS parameters (a 0.6B model's update does not fit 80 GB without it). --compile auto: the
    same."""
    import common
    import engine
    import rl
    assert rl.parse_args([]).grad_ckpt == "auto" and rl.parse_args(["--grad_ckpt"]).grad_ckpt == "on"
    assert rl.parse_args(["--grad_ckpt", "off"]).grad_ckpt == "off"
    model, _ = common.load_model(tiny_model_dir, device="cpu")
    n = sum(p.numel() for p in model.parameters())
    checkpointing = lambda: model.get_decoder().gradient_checkpointing
    assert not engine.enable_grad_ckpt(model, "auto", "cpu") and not checkpointing()
    assert not engine.enable_grad_ckpt(model, "auto", "cuda") and not checkpointing()  # small: off
    monkeypatch.setattr(engine, "GRAD_CKPT_AUTO_PARAMS", n)
    assert not engine.enable_grad_ckpt(model, "auto", "cpu") and not checkpointing()  # big, but a CPU
    assert not engine.enable_grad_ckpt(model, "off", "cuda:0") and not checkpointing()
    assert engine.enable_grad_ckpt(model, "auto", "cuda:0") and checkpointing()
    assert not engine.compile_layers(model, "auto", "cpu") and engine.compile_layers(model, "auto", "cuda:0")
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    monkeypatch.setattr(engine, "GRAD_CKPT_AUTO_PARAMS", n + 1)
    assert engine.enable_grad_ckpt(model, "on", "cpu") and checkpointing()


def test_report_to_trackio_logs_every_metrics_line(tiny_model_dir, tmp_path, monkeypatch):
    """--report_to trackio: every line of metrics.jsonl, the same step and numbers, lands in trackio's local store
    (TRACKIO_DIR), the run named by --out; nothing leaves the machine."""
    import sys
    from pathlib import Path
    store, out = tmp_path / "trackio", str(tmp_path / "rl")
    monkeypatch.setenv("TRACKIO_DIR", str(store))
    pytest.importorskip("trackio")  # it reads TRACKIO_DIR once, at its import: where that was earlier, set here
    for name, module in list(sys.modules.items()):
        if name.startswith("trackio") and isinstance(getattr(module, "TRACKIO_DIR", None), Path):
            monkeypatch.setattr(module, "TRACKIO_DIR", store)
    from trackio.sqlite_storage import SQLiteStorage
    argv = ["--model", tiny_model_dir, "--batch", "4", "--group", "2", "--max_new_tokens", "4", "--eval_every", "0",
            "--eval_n", "1", "--device", "cpu", "--out", out, "--report_to", "trackio"]
    run_main("rl", argv + ["--steps", "2"])
    logs = SQLiteStorage.get_logs(project="nanorlenv", run=os.path.normpath(out))
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert len(logs) == len(rows) == 4  # two steps, then the final evaluation's two settings
    for got, row in zip(logs, rows):
        assert {k: got[k] for k in row} == row
    assert os.listdir(store)  # the store is the one named, nowhere else
    # --resume goes on in the same tracker run
    run_main("rl", argv + ["--steps", "3", "--resume"])
    logs = SQLiteStorage.get_logs(project="nanorlenv", run=os.path.normpath(out))
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert len(logs) == len(rows) > 4 and [r["step"] for r in logs] == [r["step"] for r in rows]


def test_a_run_that_trained_nothing_says_so(tiny_model_dir, tmp_path):
    """Near-greedy rollouts: the episodes of a group are the same game, every advantage 0, no gradient: the run must
    not end as if it had trained."""
    from conftest import run_main
    printed = run_main("rl", ["--model", tiny_model_dir, "--batch", "4", "--group", "2", "--steps", "2", "--temp", "1e-3",
                              "--max_new_tokens", "4", "--eval_every", "0", "--eval_n", "1", "--device", "cpu",
                              "--out", str(tmp_path / "flat")])
    assert printed.count("zero_adv 1 |") == 2
    assert printed.count("has no gradient") == 1  # the first such step says so, once
    assert "note: step 1 has no gradient: every group's episodes had equal rewards" in printed
    assert "warning: in all 2 steps every group's episodes had equal rewards" in printed
