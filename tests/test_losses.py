"""The loss variants of rl.py against their references: GSPO and Dr. GRPO against TRL 1.16's
GRPOTrainer._compute_loss (transcribed below: TRL is not a dependency), truncated importance
sampling, truncation masking and DAPO's dynamic sampling through update() and the step."""
import pytest
import torch

import rl
from common import Scorer
from rl import dynamic_sampling, loss_weights, policy_loss, update
from test_learning import (NO_AMP, Recorder, episode_logp, fresh, hand_batch,  # noqa: F401
                           reference_grads, rl_args, unclipped, assert_same_grads)

T = torch.tensor


def trl_loss(logps, old, adv, mask, level, loss_type, eps_low, eps_high, max_completion_length=None,
             is_ratio=None):
    """TRL 1.16 trl/trainer/grpo_trainer.py, _compute_loss, beta 0, one process, no gradient
    accumulation: the importance weights at `level`, the clipped objective, then `loss_type`'s
    aggregation (is_ratio: its vLLM importance-sampling correction, token_truncate)."""
    log_ratio = logps - old
    if level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    advantages = adv.unsqueeze(1)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if is_ratio is not None:
        per_token_loss = per_token_loss * is_ratio
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    assert loss_type == "dr_grpo"
    return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)


def padded_batch(noise=1e-3, seed=0):
    """(B, L) logprobs (a leaf), old logprobs a little off, a mask of varied lengths, advantages."""
    g = torch.Generator().manual_seed(seed)
    mask = T([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0],
              [1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.float32)
    logps = (-torch.rand(mask.shape, generator=g) * 3).requires_grad_()
    old = logps.detach() + noise * torch.randn(mask.shape, generator=g)
    adv = T([1.0, -0.5, 0.7, -1.2, 0.3, 2.0])
    return logps, old, adv, mask


def ours(logps, old, adv, mask, loss, loss_agg, eps_low, eps_high, is_weight=None, max_tokens=None):
    """rl.policy_loss on the same tokens, flat as update() gives them, weights from loss_weights."""
    keep = mask.bool()
    sizes = mask.sum(-1).long().tolist()
    per_token = lambda per_episode: torch.cat([torch.full((n,), float(v)) for n, v in zip(sizes, per_episode)])
    weights = loss_weights(sizes, loss_agg, sum(sizes), len(sizes), max_tokens)
    return policy_loss(logps[keep], old[keep], per_token(adv.tolist()), per_token(weights), loss,
                       eps_low, eps_high, sizes=sizes, is_weight=None if is_weight is None else is_weight[keep])


def same_loss_and_grad(a_fn, b_fn, logps):
    """Two formulas of one loss on 21 tokens in fp32: sums of < 100 terms, within 100 * 6e-8 = 6e-6 relative
    (rtol 1e-5); atol for values that cancel to ~0. A wrong normaliser or clip moves them by >= 1%."""
    a = a_fn()
    (ga,) = torch.autograd.grad(a, logps)
    b = b_fn()
    (gb,) = torch.autograd.grad(b, logps)
    torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(ga, gb, atol=1e-8, rtol=1e-5)
    assert ga.abs().max() > 0


@pytest.mark.parametrize("loss_agg, loss_type", [("sequence", "grpo"), ("token", "bnpo")])
def test_gspo_equals_trl_sequence_level_importance_sampling(loss_agg, loss_type):
    logps, old, adv, mask = padded_batch()
    eps_low, eps_high = 3e-4, 4e-4  # the GSPO paper's
    _, clipped = ours(logps, old, adv, mask, "gspo", loss_agg, eps_low, eps_high)
    per_episode = [bool(c.all()) for c in clipped.split(mask.sum(-1).long().tolist())]
    assert any(per_episode) and not all(per_episode)  # the clip binds on some episodes, not all
    same_loss_and_grad(lambda: ours(logps, old, adv, mask, "gspo", loss_agg, eps_low, eps_high)[0],
                       lambda: trl_loss(logps, old, adv, mask, "sequence", loss_type, eps_low, eps_high),
                       logps)


def test_grpo_equals_trl_token_level():
    logps, old, adv, mask = padded_batch(noise=0.3)
    same_loss_and_grad(lambda: ours(logps, old, adv, mask, "grpo", "sequence", 0.2, 0.28)[0],
                       lambda: trl_loss(logps, old, adv, mask, "token", "grpo", 0.2, 0.28), logps)


def test_dr_grpo_constant_normaliser_equals_trl_dr_grpo():
    """Dr. GRPO's normaliser is the batch's episodes x the most loss tokens an episode can have:
    TRL's batch x max_completion_length single-turn, ours batch x max_turns x max_new_tokens."""
    logps, old, adv, mask = padded_batch(noise=0.3)
    max_turns, max_new_tokens = 1, mask.shape[1]
    same_loss_and_grad(
        lambda: ours(logps, old, adv, mask, "grpo", "constant", 0.2, 0.2,
                     max_tokens=max_turns * max_new_tokens)[0],
        lambda: trl_loss(logps, old, adv, mask, "token", "dr_grpo", 0.2, 0.2, max_completion_length=mask.shape[1]),
        logps)
    # three turns of up to 2 tokens: the same batch, the same normaliser as 6 tokens in one turn
    assert loss_weights([4, 2], "constant", 6, 2, 3 * 2) == [1 / 12, 1 / 12]


def test_truncated_importance_sampling_equals_trl_token_truncate():
    logps, old, adv, mask = padded_batch(noise=0.3)
    sampler = old + 0.6 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(3))
    cap = 2.0
    is_ratio = torch.exp(old - sampler).clamp(max=cap)
    assert (is_ratio == cap).any() and (is_ratio < 1).any()
    same_loss_and_grad(lambda: ours(logps, old, adv, mask, "grpo", "token", 0.2, 0.2, is_weight=is_ratio)[0],
                       lambda: trl_loss(logps, old, adv, mask, "token", "bnpo", 0.2, 0.2, is_ratio=is_ratio),
                       logps)


# ----------------------------------------------------------------------------- through update()


def test_mask_truncated_drops_cut_off_episodes_from_the_loss(tiny_model_dir, torch_single_thread, unclipped):
    """Episode 1 has a reply cut off at --max_new_tokens, episode 2 was cut off by the environment
    (metric cut_off): with --mask_truncated only episode 0 trains (3 has advantage 0), weighed by
    the batch's remaining loss tokens, 2 + 4."""
    records, adv = hand_batch()
    for i, r in enumerate(records):
        r.update(truncated=int(i == 1), metrics={"cut_off": float(i == 2)})
    model = fresh(tiny_model_dir)
    opt = Recorder(model.parameters(), lr=0.0)
    update(Scorer(model), records, adv, rl_args("--mask_truncated"), opt, NO_AMP)
    assert_same_grads(opt.grads[0], reference_grads(model, records, adv, [1 / 6] * 4, [0], rl_args()))


def test_tis_cap_weighs_each_token_by_the_capped_ratio(tiny_model_dir, torch_single_thread, unclipped):
    """The sampler's logprobs differ from the trainer's by +-0.5: each loss token is weighed by
    min(exp(trainer - sampler), 1.2); on-policy cispo: -w * A * logp."""
    records, adv = hand_batch()
    model = fresh(tiny_model_dir)
    args = rl_args("--tis_cap", "1.2")
    sampled = {}
    with torch.no_grad():
        for i, r in enumerate(records):
            trainer = episode_logp(model, r, args.temp)
            shift = T([0.5 if k % 2 else -0.5 for k in range(len(trainer))])
            sampled[i] = trainer - shift
            positions = [t for t in range(1, len(r["mask"])) if r["mask"][t]]
            for t, lp in zip(positions, sampled[i].tolist()):
                r["logprobs"][t] = lp
    opt = Recorder(model.parameters(), lr=0.0)
    update(Scorer(model), records, adv, args, opt, NO_AMP)
    model.zero_grad(set_to_none=True)
    total = 0.0
    for i in (0, 1, 2):
        logp = episode_logp(model, records[i], args.temp)
        weight = torch.exp(logp.detach() - sampled[i]).clamp(max=1.2)
        total = total - (weight * float(adv[i]) * logp).sum() / 14
    total.backward()
    assert_same_grads(opt.grads[0], [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()])


def test_dynamic_sampling_fills_the_step_with_informative_groups(monkeypatch):
    """Groups of 2: the first draw has one informative group of 3; the extra draws bring the rest,
    in order; the batch keeps its size; with too few tries, uniform groups of the first draw fill it."""
    draws = {0: [[1, 1], [0, 1], [0, 0]], 1: [[0.5, 0.5], [1, 0]], 2: [[0, 1], [0.2, 0.3]]}
    fake = lambda env, examples, policy, group, first: [
        {"reward": float(x), "draw": first} for g in draws[first] for x in g]
    monkeypatch.setattr(rl, "sample_rollouts", fake)
    draw = lambda k: (None, k)
    first = fake(None, None, None, 2, 0)
    rewards = lambda recs: [[r["reward"] for r in recs[i:i + 2]] for i in range(0, len(recs), 2)]
    records, taken = dynamic_sampling(None, first, draw, None, 2, tries=5)
    assert rewards(records) == [[0, 1], [1, 0], [0, 1]] and taken == 3
    records, taken = dynamic_sampling(None, first, draw, None, 2, tries=1)
    assert rewards(records) == [[0, 1], [1, 0], [1, 1]] and taken == 2
    assert dynamic_sampling(None, first, draw, None, 2, tries=0) == (first, 1)
