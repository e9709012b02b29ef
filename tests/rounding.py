"""How far bf16 autocast may move a logprob: a bound derived from the model's own sensitivities, for the tests
that compare a bf16 computation with fp32 (the logprobs a RowCache or re-encoding records, those of the update).

Every value that autocast rounds to bf16 (round to nearest, unit roundoff u = 2^-8) moves by delta_i with
|delta_i| <= u * |v_i|. To first order a logprob then moves by E = sum_i g_i * delta_i, g_i = d logprob / d v_i.
The worst case, u * sum_i |g_i v_i|, is far from what happens (for the tests' sharpened models it exceeds 10,
larger than the logprobs themselves), because roundings do not all go the same way. The probabilistic model of
rounding error (Higham and Mary, SIAM J. Sci. Comput. 2019) takes the delta_i as independent with mean zero;
Hoeffding's inequality then gives P(|E| >= LAMBDA * u * ||g * v||_2) <= 2 exp(-LAMBDA^2 / 2): 4.6e-11 at
LAMBDA = 7, so a test comparing a few thousand logprobs fails by chance with probability < 1e-6.

Sensitivities are taken on the trajectory being compared, with eager attention: its rounded values (the
scores, the probabilities, the output) are a superset of those SDPA and the fast engine's matmul decoding round,
and extra terms only widen the bound. Neglected: second-order terms (u^2), and fp32 accumulation (2^-24 per
operation, 2^16 times finer than bf16's rounding).
"""
import torch
from torch.overrides import TorchFunctionMode

UNIT_ROUNDOFF = 2.0 ** -8
LAMBDA = 7.0


class _RoundedValues(TorchFunctionMode):
    """Collects every tensor autocast rounds: each bf16 result, and each fp32 argument of a call that returns bf16
    (autocast cast it first); weights (Parameters) only with weights=True."""

    def __init__(self, weights):
        super().__init__()
        self.weights, self.values = weights, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.requires_grad:
            self.values.setdefault(id(out), out)
            for arg in [*args, *(kwargs or {}).values()]:
                for t in arg if isinstance(arg, (list, tuple)) else [arg]:
                    if (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.requires_grad
                            and (self.weights or not isinstance(t, torch.nn.Parameter))):
                        self.values.setdefault(id(t), t)
        return out


def bf16_spread(model, ids, queries, temp=1.0, weights=True, enough=None):
    """LAMBDA * u * ||g * v||_2 for each query: the bound on how far bf16 autocast moves a logprob at temperature
    temp, against exact arithmetic (with weights=False, against bf16 with the same rounded weights). A query
    (t, x) is log p(x | ids[:t]); (t, x, y) is log p(x | ids[:t]) - log p(y | ids[:t]), the gap that decides a
    greedy choice between x and y. enough (a value per query, optional): where one term of the sum, the
    rounding of the bf16 logits z themselves (closed form: d log p(x) / d z_j = (1[j = x] - p_j) / temp),
    already reaches it, that lower bound is returned instead, without a backward pass."""
    impl = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        dev = model.device
        n = max(q[0] for q in queries)
        embeds = model.get_input_embeddings()(torch.tensor([ids[:n]], device=dev)).detach().requires_grad_(True)
        collect = _RoundedValues(weights)
        with torch.autocast(dev.type, dtype=torch.bfloat16), collect:
            rounded = model(inputs_embeds=embeds).logits[0]  # (n, V) bf16
        logp = torch.log_softmax(rounded.float() / temp, -1)
        values = list(collect.values.values())
        spreads = []
        for k, query in enumerate(queries):
            t, x, *y = query
            dz = torch.zeros_like(logp[t - 1]) if y else -logp[t - 1].detach().exp()  # temp * d query / d z, (V,)
            dz[x] += 1
            if y:
                dz[y[0]] -= 1
            logits_term = LAMBDA * UNIT_ROUNDOFF * float((dz * rounded[t - 1].detach().float()).norm()) / temp
            if enough is not None and id(rounded) in collect.values and logits_term >= enough[k]:
                spreads.append(logits_term)
                continue
            grads = torch.autograd.grad(_query(logp, query), values, retain_graph=True, allow_unused=True)
            sq = sum(float((g.double() * v.detach().double()).pow(2).sum()) for g, v in zip(grads, values)
                     if g is not None)
            spreads.append(LAMBDA * UNIT_ROUNDOFF * sq ** 0.5)
        return spreads
    finally:
        model.set_attn_implementation(impl)


def _query(logp, query):
    """A query's value from logp (T, V), the log-softmax over the positions: see bf16_spread."""
    t, x, *y = query
    return logp[t - 1, x] - (logp[t - 1, y[0]] if y else 0)


def fp32_logprobs(model, ids, queries, temp=1.0):
    """The queries of bf16_spread, computed in one fp32 forward (no autocast): the reference a bf16 computation is
    within its spread of (fp32's own rounding, 2^-24 a step, is left out as above)."""
    dev = model.device
    n = max(q[0] for q in queries)
    with torch.no_grad(), torch.autocast(dev.type, enabled=False):
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids[:n]], device=dev)).logits[0].float() / temp, -1)
    return torch.stack([_query(logp, q) for q in queries]).cpu()


def recorded_minus_fp32(model, rec, temp=1.0):
    """Each sampled token's recorded logprob in rollout record rec less fp32_logprobs' for it, and the queries."""
    queries = [(t, rec["ids"][t]) for t, m in enumerate(rec["mask"]) if m]
    recorded = torch.tensor([rec["logprobs"][t] for t, _ in queries])
    return recorded - fp32_logprobs(model, rec["ids"], queries, temp), queries


def bf16_excess(model, rec, temp=1.0):
    """The largest amount by which a recorded logprob of rec, sampled under bf16 autocast, is further from fp32's
    than its spread: <= 0 where every one is within."""
    got, queries = recorded_minus_fp32(model, rec, temp)
    spread = torch.tensor(bf16_spread(model, rec["ids"], queries, temp, enough=got.abs().tolist()))
    return float((got.abs() - spread).max())
