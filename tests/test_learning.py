"""The learning path of rl.py against hand computations: group advantages, the per-token loss weights, the
gradient that `update` produces (token and sequence averaging, micro-batches, minibatches, several PPO epochs,
the KL reference), the temperature on the sampler's and the trainer's side, and a few real rl.py steps that
must raise the probability of the one rewarded reply.

Each test here was checked by planting a fault by hand (a flipped advantage, groups laid out the wrong way, a
dropped normaliser, the trainer at temperature 1, ...) and watching it fail."""
import json
import os
import sys
import tempfile

import pytest
import torch

import rl
from rl import group_advantages, loss_weights, update
from common import Scorer, load_model
from sample import HFPolicy, rollout

T = torch.tensor
NO_AMP = torch.autocast("cpu", enabled=False)


# ----------------------------------------------------------------------------- group advantages by hand

def test_group_advantages_by_hand():
    # two examples of four rollouts each, laid out example by example as rollout() returns them
    rewards = [1.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.0, 1.0]
    adv = group_advantages(rewards, 4)
    assert torch.allclose(adv, T([0.5, -0.5, 0.0, 0.0, -0.25, -0.25, -0.25, 0.75]))
    # --scale_rewards group: / std with Bessel's correction; group 1: sqrt(0.5 / 3), group 2: sqrt(0.75 / 3) = 0.5
    scaled = group_advantages(rewards, 4, "group")
    s1 = (0.5 / 3) ** 0.5
    want = T([0.5 / (s1 + 1e-4), -0.5 / (s1 + 1e-4), 0.0, 0.0] + [x / (0.5 + 1e-4) for x in (-0.25, -0.25, -0.25, 0.75)])
    assert torch.allclose(scaled, want, atol=1e-6)
    # a group whose rewards are all equal carries no signal: zeros, not NaN, in both settings
    for scale in ("none", "group"):
        assert torch.equal(group_advantages([0.3] * 4 + [1.0, 0.0, 0.0, 0.0], 4, scale)[:4], torch.zeros(4))
    # exactly 0, whatever the rewards: a tic-tac-toe draw's 0.5 + 0.2 x format, the calculator's 1.05, a thirds'
    # sum, ... (R - mean(R) in float32 leaves ~6e-08, which the update does not skip and zero_adv does not count)
    for value in (0.7, 1.05, 0.1 + 0.2, 1 / 3, 2.3e-5, -0.35, 1234.567):
        for scale in ("none", "group"):
            assert torch.equal(group_advantages([value] * 8 + [1.0] + [0.0] * 7, 8, scale)[:8], torch.zeros(8)), (value, scale)
    # groups of two: A = +-(difference / 2), scaled: +-1/sqrt(2) (without Bessel's correction it would be +-1)
    assert torch.allclose(group_advantages([1.0, 0.0, 0.2, 0.6], 2), T([0.5, -0.5, -0.2, 0.2]))
    assert torch.allclose(group_advantages([1.0, 0.0], 2, "group"), T([1, -1]) * 0.5 / (0.5 ** 0.5 + 1e-4))


class Ladder:
    """Example k lasts k + 1 turns, so episodes finish out of order; the reward of rollout r of example k is
    10 k + r: the group advantage must be r - mean(r) = r - 1.5 whatever the example."""
    system_prompt = "Climb."
    reward_weights = {"height": 1.0}
    max_turns = 4

    def examples(self, n, seed=0):
        return [{"seed": seed + k, "k": k} for k in range(n)]

    def reset(self, example):
        return {"k": example["k"], "turns": 0, "reply": ""}, "go"

    def step(self, state, reply):
        state["turns"] += 1
        state["reply"] = reply
        return "again" if state["turns"] <= state["k"] else None

    def rewards(self, state):
        return {"height": 10.0 * state["k"] + float(state["reply"])}


def test_group_advantages_follow_rollout_records():
    env = Ladder()

    def policy(episodes):  # the rollout number as the reply
        return [str(ep["rollout"]) for ep in episodes]
    records = rollout(env, env.examples(3), policy, group=4, progress=False)  # 3 x 4: a transposed layout differs
    adv = group_advantages([r["reward"] for r in records], 4)
    for rec, a in zip(records, adv.tolist()):
        assert a == pytest.approx(rec["rollout"] - 1.5), (rec["index"], rec["rollout"], a)


# ----------------------------------------------------------------------------- update() against a hand-built batch

def test_loss_weights_by_hand():
    n_tok = [2, 3, 5, 4]
    assert loss_weights(n_tok, "token", 14, 4) == pytest.approx([1 / 14] * 4)
    assert loss_weights(n_tok, "sequence", 14, 4) == pytest.approx([1 / (2 * 4), 1 / (3 * 4), 1 / (5 * 4), 1 / (4 * 4)])
    # a rank holding episodes 2-3 of the batch weighs them as the whole batch does (the normalisers are the batch's)
    for agg in ("token", "sequence"):
        assert loss_weights(n_tok[2:], agg, 14, 4) == pytest.approx(loss_weights(n_tok, agg, 14, 4)[2:])


PREFIX = list(range(3, 13))  # a common prefix of 10 tokens: update() runs it once (common.decoder_hidden)


def hand_batch():
    """Four episodes of different lengths and loss-token counts (2, 3, 5, 4 after the first position), loss tokens in
    several runs as in a multi-turn game; the last episode's advantage is 0."""
    g = torch.Generator().manual_seed(7)
    masks = [[0] * 10 + [1, 1, 0],
             [0] * 10 + [1, 0, 1, 1, 0, 0],
             [0] * 10 + [1, 1, 0, 0, 1, 1, 1, 0, 0, 0],
             [0] * 10 + [0, 1, 1, 0, 1, 1, 0]]
    records = []
    for mask in masks:
        ids = PREFIX + torch.randint(20, 290, (len(mask) - 10,), generator=g).tolist()
        records.append({"ids": ids, "mask": mask, "logprobs": [0.0] * len(mask)})
    assert [sum(r["mask"][1:]) for r in records] == [2, 3, 5, 4]
    return records, T([1.0, -0.5, 2.0, 0.0])


# update()'s settings in these tests, as a command line gives them; --eps_low is left unset (None:
# no lower clip for cispo, 0.2 for grpo) unless a test sets it
UPDATE_FLAGS = {"--loss": "cispo", "--loss_agg": "token", "--eps_high": "0.2", "--beta": "0.0",
                "--ppo_epochs": "1", "--minibatch": "0", "--token_budget": str(1 << 20),
                "--temp": "0.8"}


def rl_args(*argv):
    """update()'s args from rl.py's own parser: UPDATE_FLAGS, then ARGV over them (argparse keeps
    an option's last value; switches such as --mask_truncated work too). A flag added to rl.py then
    comes with its default, as in a real run, and a value rl.py refuses stops the test. --out is the
    temporary directory: rl.py's writability probe then goes there, not into the repository's out/."""
    flags = [x for flag_value in UPDATE_FLAGS.items() for x in flag_value]
    return rl.parse_args([*flags, *argv, "--out", tempfile.gettempdir()])


@pytest.fixture
def unclipped(monkeypatch):
    """The update's gradient unclipped: the hand computations are of the loss's own gradient."""
    import common
    monkeypatch.setattr(common, "GRAD_CLIP", 1e9)


class Recorder(torch.optim.SGD):
    """SGD that keeps, at every step, the parameters before it and the gradient it applies."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.before, self.grads = [], []

    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        self.before.append([p.detach().clone() for p in params])
        self.grads.append([p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params])
        return super().step(closure)


def episode_logp(model, rec, temp):
    """Logprobs (n,) of an episode's loss tokens under softmax(logits / temp), by a plain full forward."""
    ids = T(rec["ids"])
    logits = model(ids[None]).logits[0, :-1].float()  # (T-1, V)
    logp = torch.log_softmax(logits / temp, -1).gather(1, ids[1:, None]).squeeze(1)
    return logp[T(rec["mask"][1:]).bool()]


def reference_grads(model, records, adv, weights, episodes, args, old=None, ref_model=None):
    """The gradient of sum over `episodes` and their loss tokens of weight * per-token loss, written out from
    the published formulas, one episode at a time (no batching, no shared prefix, no micro-batches)."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for i in episodes:
        logp = episode_logp(model, records[i], args.temp)
        r = torch.exp(logp - (old[i] if old is not None else logp.detach()))
        a = float(adv[i])
        if args.loss == "cispo":  # no lower clip unless --eps_low
            lo = None if args.eps_low is None else 1 - args.eps_low
            per = -torch.clamp(r, min=lo, max=1 + args.eps_high).detach() * a * logp
        else:  # grpo's lower clip: 0.2 unless --eps_low
            lo = 1 - (0.2 if args.eps_low is None else args.eps_low)
            per = -torch.min(r * a, torch.clamp(r, lo, 1 + args.eps_high) * a)
        if args.beta:
            with torch.no_grad():
                d_ref = episode_logp(ref_model, records[i], args.temp)
            d = d_ref - logp
            per = per + args.beta * (torch.exp(d) - d - 1)
        total = total + weights[i] * per.sum()
    total.backward()
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def assert_same_grads(got, want, nonzero=True):
    """The trainer's gradients against the reference's: the same fp32 products summed in other orders (batched,
    episode by episode), each sum of n < 1e3 terms within n * 6e-8 = 6e-5 of its terms' magnitude, so rtol 1e-4;
    atol 1e-7 for entries that cancel to ~0 (their terms here are < 1e-3). A dropped normaliser or a flipped sign
    moves them by 100%."""
    assert not nonzero or any(w.abs().max() > 0 for w in want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-7, rtol=1e-4)


def fresh(tiny_model_dir):
    model, _ = load_model(tiny_model_dir, "cpu", train=True)
    return model


@pytest.mark.parametrize("loss", ["cispo", "grpo"])
@pytest.mark.parametrize("loss_agg, weights", [("token", [1 / 14] * 4), ("sequence", [1 / 8, 1 / 12, 1 / 20, 1 / 16])])
@pytest.mark.parametrize("token_budget", [1 << 20, 20])  # one micro-batch, or one episode per micro-batch
def test_update_gradient_equals_hand_computation(tiny_model_dir, torch_single_thread, unclipped, loss, loss_agg, weights, token_budget):
    model = fresh(tiny_model_dir)
    records, adv = hand_batch()
    args = rl_args("--loss", loss, "--loss_agg", loss_agg, "--token_budget", str(token_budget))
    opt = Recorder(model.parameters(), lr=0.0)
    stats = update(Scorer(model), records, adv, args, opt, NO_AMP)
    assert len(opt.grads) == 1 and stats["skipped"] == 0
    # on-policy (one step per batch) both losses are REINFORCE: the gradient of -sum w * A * logp
    assert_same_grads(opt.grads[0], reference_grads(model, records, adv, weights, range(4), args))


@pytest.mark.parametrize("loss, eps_low", [("cispo", None), ("grpo", None), ("cispo", 0.05), ("grpo", 0.05)])
def test_update_minibatches_and_ppo_epochs(tiny_model_dir, torch_single_thread, unclipped, loss, eps_low):
    """--minibatch 2 --ppo_epochs 2 on four episodes: four optimizer steps (episodes 0-1, 2-3, 0-1, 2-3); each
    gradient is the clipped loss at the parameters of that moment, with the importance ratio against the
    logprobs from BEFORE the first step and the whole batch's token weights."""
    model = fresh(tiny_model_dir)
    records, adv = hand_batch()
    args = rl_args("--loss", loss, "--minibatch", "2", "--ppo_epochs", "2",
                   *(["--eps_low", str(eps_low)] if eps_low is not None else []))
    with torch.no_grad():
        old = [episode_logp(model, rec, args.temp) for rec in records]
    opt = Recorder(model.parameters(), lr=0.1)  # steps large enough that ratios leave [0.8, 1.2]
    stats = update(Scorer(model), records, adv, args, opt, NO_AMP)
    assert len(opt.grads) == 4 and stats["clip_frac"] > 0
    reference = fresh(tiny_model_dir)
    for k, episodes in enumerate([[0, 1], [2], [0, 1], [2]]):  # episode 3 has A = 0: skipped, still weighed
        with torch.no_grad():
            for p, q in zip(reference.parameters(), opt.before[k]):
                p.copy_(q)
        # (grpo: in the last step every token may be clipped, and then its gradient is 0)
        assert_same_grads(opt.grads[k], reference_grads(reference, records, adv, [1 / 14] * 4, episodes, args, old=old), nonzero=k < 2)


def test_update_kl_to_the_reference_model(tiny_model_dir, torch_single_thread, unclipped):
    model = fresh(tiny_model_dir)
    ref_model = fresh(tiny_model_dir)
    with torch.no_grad():  # a reference that differs from the policy
        for p in ref_model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    records, _ = hand_batch()
    adv = torch.zeros(4)  # no reward signal at all: the KL term alone moves the model, on every episode
    args = rl_args("--beta", "0.1")
    opt = Recorder(model.parameters(), lr=0.0)
    update(Scorer(model), records, adv, args, opt, NO_AMP, Scorer(ref_model))
    assert_same_grads(opt.grads[0], reference_grads(model, records, adv, [1 / 14] * 4, range(4), args, ref_model=ref_model))


# ----------------------------------------------------------------------------- temperature on both sides

def test_trainer_logprobs_match_sampler_at_temperature(sharp_model_dir, short_env, torch_single_thread):
    """Rollouts sampled at temperature 1.5: the trainer's logprobs of the sampled tokens (update's logged
    logp_mismatch) equal the sampler's; at temperature 1 they would be far off."""
    model = fresh(sharp_model_dir)
    tok = load_model(sharp_model_dir, "cpu")[1]
    torch.manual_seed(0)
    temp = 1.5
    policy = HFPolicy(model, tok, short_env.system_prompt, temp=temp, max_new_tokens=12)
    records = rollout(short_env, short_env.examples(3, seed=2), policy, group=2, progress=False)
    adv = group_advantages([r["reward"] for r in records], 2) + 0.1  # every episode enters the update
    stats = update(Scorer(model), records, adv, rl_args("--temp", str(temp)),
                   Recorder(model.parameters(), lr=0.0), NO_AMP)
    assert stats["logp_mismatch"] < 1e-4, stats
    untempered = update(Scorer(model), records, adv, rl_args("--temp", "1.0"),
                        Recorder(model.parameters(), lr=0.0), NO_AMP)
    assert untempered["logp_mismatch"] > 0.05, untempered  # the check above can see a wrong temperature


# ----------------------------------------------------------------------------- RL learns, in the right direction

LETTERS_ENV = '''
"""A test environment: answer one letter; only "A" is rewarded."""
class Letters:
    system_prompt, reward_weights, max_turns = "Say A B C or D", {"a": 1.0}, 1
    def examples(self, n, seed=0): return [{"seed": seed * 1000 + i} for i in range(n)]
    def reset(self, example): return {"reply": None}, "letter"
    def step(self, state, reply): state["reply"] = reply.strip()  # None: the episode is over
    def rewards(self, state): return {"a": float(state["reply"] == "A")}
load_environment = Letters
'''


@pytest.fixture(scope="module")
def letters_model_dir(tmp_path_factory):
    """A tiny random Llama over an 11-token vocabulary (ChatML specials, role names, the letters A-D): each reply
    token starts with a probability near 1/11, so a few RL steps show clearly which way the probability of "A" moves."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from sft import CHATML
    words = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]", "system", "user", "assistant", "A", "B", "C", "D"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(words[:3])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="[UNK]")
    tokenizer.chat_template = CHATML
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, max_position_embeddings=64, eos_token_id=2, pad_token_id=0, bos_token_id=None)
    out = str(tmp_path_factory.mktemp("letters_model"))
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def prob_of_a(model_dir):
    """P(first reply token = "A") at temperature 1, from the model saved in model_dir."""
    from sample import ChatTokens
    model, tok = load_model(model_dir, "cpu")
    chat = ChatTokens(tok, "Say A B C or D")
    ids = chat.prompt_ids([{"role": "system", "content": "Say A B C or D"}, {"role": "user", "content": "letter"}])
    with torch.no_grad():
        probs = torch.softmax(model(T([ids])).logits[0, -1].float(), -1)
    return float(probs[tok.convert_tokens_to_ids("A")])


def test_rl_raises_the_rewarded_reply(letters_model_dir, tmp_path, monkeypatch, torch_single_thread):
    (tmp_path / "env_letters.py").write_text(LETTERS_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = str(tmp_path / "rl")
    monkeypatch.setattr(sys, "argv", ["rl.py", "--model", letters_model_dir, "--env", "letters", "--batch", "32", "--group", "8",
                                      "--steps", "6", "--lr", "3e-2", "--warmup", "1", "--max_new_tokens", "1", "--temp", "1.3",
                                      "--eval_every", "0", "--eval_n", "2", "--save_every", "0", "--device", "cpu", "--out", out])
    rl.main()
    before, after = prob_of_a(letters_model_dir), prob_of_a(out)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    rewards = [r["reward"] for r in rows if "reward" in r]
    print(f"P(A) {before:.3f} -> {after:.3f}; mean reward per step {rewards}")
    assert max(r["logp_mismatch"] for r in rows if "reward" in r) < 1e-5, "trainer and sampler disagree at --temp 1.3"
    assert before < 0.15, "the fixture's model should start near 1/11"
    assert after > 0.5, f"P(A) {before:.3f} -> {after:.3f}: RL did not learn the rewarded reply"
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.2, rewards


def test_rl_steps_at_the_scheduled_learning_rate(letters_model_dir, tmp_path, monkeypatch, torch_single_thread):
    """Each optimizer step runs at lr_at(step): the warm-up and the decay reach AdamW, not only the log line."""
    from common import lr_at
    (tmp_path / "env_letters.py").write_text(LETTERS_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    used, adamw_step = [], torch.optim.AdamW.step

    def recording_step(self, *a, **kw):
        used.append(self.param_groups[0]["lr"])
        return adamw_step(self, *a, **kw)
    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    monkeypatch.setattr(sys, "argv", ["rl.py", "--model", letters_model_dir, "--env", "letters", "--batch", "32", "--group", "8",
                                      "--steps", "4", "--lr", "1e-3", "--warmup", "2", "--max_new_tokens", "1",
                                      "--temp", "1.3",
                                      "--eval_every", "0", "--eval_n", "1", "--save_every", "0", "--device", "cpu", "--out", str(tmp_path / "rl")])
    rl.main()
    assert used == pytest.approx([lr_at(s, 1e-3, 2, 4, "constant") for s in range(4)])
    assert used[0] < used[1] == used[2] == used[3]  # the warm-up, then the constant rate, reached the optimizer
