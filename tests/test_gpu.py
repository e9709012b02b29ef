"""The GPU paths, on a GPU: the fast engine's CUDA-graph decoding against its eager step and against the
reference engine, the update under bf16 autocast, the update's compiled layers (inductor's generated kernels) and
a two-step rl.py run. On a machine without CUDA (CI) every test here is skipped; on one GPU:

    python -m pytest tests/test_gpu.py -v        # about 2 minutes on one H200

TEST_GPU_DEVICE=cpu runs them on the CPU, to check this file itself (no CUDA graphs there; the compiled update
then takes minutes of compilation).

Small random models of five architectures (Llama, Qwen3, Gemma 3 with a sliding window, LFM2 with short
convolutions, Qwen3.5 with linear attention) are built on the device with bench.py's word-level tokenizer; their
weight matrices are scaled so that greedy replies depend on the context.
"""
import copy
import json
import os

import pytest
import torch

import bench
import common
import engine
import rl
from sample import HFPolicy, rollout
from conftest import run_main
from rounding import bf16_excess, bf16_spread, recorded_minus_fp32

DEV = os.environ.get("TEST_GPU_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")

SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=4096)
ARCHS = {
    "llama": ("llama", dict(SMALL, head_dim=64)),
    "qwen3": ("qwen3", dict(SMALL, head_dim=64)),
    "gemma3": ("gemma3_text", dict(SMALL, head_dim=64, sliding_window=16,
                                   layer_types=["sliding_attention", "full_attention"] * 2)),
    "lfm2": ("lfm2", dict(SMALL, full_attn_idxs=[1, 3], block_auto_adjust_ff_dim=False)),
    "qwen3_5": ("qwen3_5_text", dict(SMALL, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
                                     layer_types=["linear_attention", "full_attention"] * 2,
                                     linear_num_key_heads=2, linear_num_value_heads=4)),
}
SHARPEN = {"gemma3": 1.5}  # the factor on the weight matrices; 3 saturates Gemma 3 into one repeated token
# Two fp32 computations of a logprob (the engines' against each other or against one forward over the
# trajectory), in IEEE fp32 (cuDNN's convolutions, LFM2's, set off TF32 below): each logit is about 29 sums
# (7 a layer and the head), each of n <= 512 products whose magnitudes sum to S < 13 (RMSNorm keeps every sum's
# inputs at unit scale; these weights are 3x those of std 0.02). Every rounding moves a sum by at most 2^-24 * S,
# n of them a sum; jointly, under rounding.py's probabilistic model, a logit moves by at most
# 7 * 2^-24 * sqrt(29 * 512 * 13^2) = 6.6e-4 where each sum reaches it with gain <= 1, a logprob (a logit less a
# log-sum-exp) twice that: 1.3e-3 a computation, 3e-3 for two. A wrong position, mask or temperature moves one by
# >= 1e-2.
FP32_ATOL = 3e-3


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request):
    """(name, model, tokenizer): fp32 weights on the device, as rl.py trains and samples them."""
    model, tok = bench.build_model(ARCHS[request.param], DEV)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(SHARPEN.get(request.param, 3.0))
    return request.param, model, tok


def replay_excess(model, rec, temp, bf16):
    """The largest |recorded logprob - that of one fp32 forward over the whole trajectory| over rec's sampled
    tokens, less the bound on it: bf16's spread (rounding.bf16_spread) or, in fp32, FP32_ATOL."""
    if bf16:
        return bf16_excess(model, rec, temp)
    return float(recorded_minus_fp32(model, rec, temp)[0].abs().max()) - FP32_ATOL


@pytest.fixture
def ieee_fp32():
    """fp32 as FP32_ATOL's argument takes it: cuDNN's convolutions otherwise round their inputs to TF32."""
    old, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, False
    yield
    torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize("temp", [0.0, 1.0])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_fast_engine_is_exact(arch, bf16, temp, ieee_fp32):
    """Multi-turn rollouts, two per example, through the fast engine with a CUDA graph per turn, the same engine
    eager, and the reference engine (generate() re-encoding every turn): the graph gives the eager step's tokens
    and logprobs bit for bit; every recorded logprob is an fp32 replay's (within FP32_ATOL in fp32, bf16's
    rounding under autocast, how rl.py samples on a GPU); in fp32 the fast engine gives the reference engine's
    tokens. Under bf16 a near tie may flip a token between the two engines' different kernels, so they are not
    compared there."""
    name, model, tok = arch
    env = bench.FixedEnv(system_tokens=30, env_tokens=7, turns=3)
    runs = {}
    for label, graphs, engine_name in (("graphs", True, "fast"), ("eager", False, "fast"), ("hf", False, "hf")):
        options = {"cuda_graphs": graphs} if engine_name == "fast" else {}
        policy = HFPolicy(model, tok, env.system_prompt, temp=temp, max_new_tokens=24, batch_size=8, seed=3,
                          engine=engine_name, **options)
        assert policy.engine.name == engine_name
        policy.engine.autocast = bf16
        runs[label] = rollout(env, env.examples(6, seed=1), policy, group=2, progress=False)
        if graphs and DEV == "cuda":
            assert policy.engine.cuda_graphs, "CUDA graph capture failed"
    graphed, eager, hf = runs["graphs"], runs["eager"], runs["hf"]
    assert len({tuple(x for x, m in zip(r["ids"], r["mask"]) if m) for r in graphed}) > 3, "replies vary"
    for a, b in zip(graphed, eager):
        assert a["ids"] == b["ids"] and a["logprobs"] == b["logprobs"], name
    excess = max(replay_excess(model, rec, temp or 1.0, bf16) for rec in graphed)
    assert excess <= 0, (name, excess)
    if not bf16:
        assert [r["ids"] for r in graphed] == [r["ids"] for r in hf], name
        assert [r["mask"] for r in graphed] == [r["mask"] for r in hf], name
        for a, b in zip(graphed, hf):
            torch.testing.assert_close(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), atol=FP32_ATOL,
                                       rtol=0)


def batch_of(model, seed=0):
    """ids, mask (4, 48): random tokens, the first 10 of each row a prompt (mask 0)."""
    torch.manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (4, 48), device=DEV)
    mask = torch.ones_like(ids)
    mask[:, :10] = 0
    return ids, mask


def logprobs_and_grads(model, ids, mask, amp):
    """The trainer's logprobs of the masked tokens (common.token_logprobs, through compiled layers where
    compile_layers set them) and the gradients of their sum, the loss's shape."""
    model.zero_grad()
    with engine.compiled_layers(model):
        with amp:
            logp, _ = common.token_logprobs(model, ids, mask, 1.0)
        logp.sum().backward()
    return logp.detach().float(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_update_under_bf16_autocast(arch):
    """The update as rl.py runs it on a GPU (fp32 weights, bf16 autocast, checkpointed layers): the gradients
    land in fp32 on every parameter the loss reaches, point where fp32's point (cosine > 0.99), and the
    logprobs are fp32's within bf16's rounding."""
    name, base, _ = arch
    model = copy.deepcopy(base).train()
    engine.enable_grad_ckpt(model, "on", DEV)
    ids, mask = batch_of(model)
    fp32 = logprobs_and_grads(model, ids, mask, torch.autocast(DEV, enabled=False))
    bf16 = logprobs_and_grads(model, ids, mask, common.train_autocast(DEV) if DEV == "cuda"
                              else torch.autocast(DEV, dtype=torch.bfloat16))
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in bf16[1]), name
    assert len(bf16[1]) == len(fp32[1]) == sum(1 for p in model.parameters() if p.grad is not None)
    got = (bf16[0] - fp32[0]).abs().cpu()  # the masked tokens, row by row
    spread = torch.tensor([s for row, keep in zip(ids.tolist(), mask.tolist())
                           for s in bf16_spread(base, row, [(t, row[t]) for t in range(len(row)) if keep[t]])])
    assert (got <= spread).all(), (name, float((got - spread).max()))
    flat = lambda grads: torch.cat([g.flatten() for g in grads])
    cosine = torch.nn.functional.cosine_similarity(flat(bf16[1]), flat(fp32[1]), dim=0)
    assert cosine > 0.99, (name, float(cosine))


@pytest.mark.parametrize("arch", ["qwen3", "lfm2"], indirect=True)
def test_compiled_update_gives_eager_gradients(arch):
    """The update's decoder layers and LM head compiled by inductor (its generated GPU kernels; on the CPU
    tests/test_engine.py checks the traced graphs without code generation) give eager's logprobs and gradients,
    checkpointing on: each as near float64's as eager fp32 is (2x, plus 1e-6 of the largest value)."""
    name, base, _ = arch
    model = copy.deepcopy(base).train()
    engine.enable_grad_ckpt(model, "on", DEV)
    ids, mask = batch_of(model, seed=1)
    plain = torch.autocast(DEV, enabled=False)
    truth = logprobs_and_grads(copy.deepcopy(model).double(), ids, mask, plain)
    eager = logprobs_and_grads(model, ids, mask, plain)
    assert engine.compile_layers(model, "on", DEV)
    compiled = logprobs_and_grads(model, ids, mask, plain)
    for t, a, b in zip([truth[0]] + truth[1], [eager[0]] + eager[1], [compiled[0]] + compiled[1], strict=True):
        t = t.float()
        eager_err, compiled_err = (a - t).abs().max(), (b - t).abs().max()
        assert compiled_err <= 2 * eager_err + 1e-6 * t.abs().max().clamp(min=1), \
            (name, t.shape, float(eager_err), float(compiled_err))


NOISE_ENV = """
import bench
def load_environment():
    return bench.FixedEnv(system_tokens=30, env_tokens=7, turns=2)
"""


def test_rl_two_steps(tmp_path, monkeypatch):
    """rl.py on the GPU for two steps, as a user runs it on a big model: a Qwen3-architecture model saved like a
    hub model, on bench.py's environment of varying rewards; the size threshold lowered so that checkpointing and
    the compiled update are on. Each step's trainer logprobs are the sampler's within bf16's rounding (both under
    autocast), the loss finite, the weights moved, and the checkpoint loads back."""
    model, tok = bench.build_model(ARCHS["qwen3"], "cpu")
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    monkeypatch.setattr(engine, "GRAD_CKPT_AUTO_PARAMS", 0)
    compiled, compile_layers = [], rl.compile_layers
    monkeypatch.setattr(rl, "compile_layers", lambda *a, **kw: compiled.append(compile_layers(*a, **kw)))
    out = tmp_path / "rl"
    (tmp_path / "env_noise.py").write_text(NOISE_ENV)
    printed = run_main("rl", ["--model", str(tmp_path / "model"), "--env", "noise", "--batch", "16", "--group", "4",
                              "--steps", "2", "--max_new_tokens", "16", "--lr", "1e-3", "--warmup", "1",
                              "--eval_every", "0", "--eval_n", "2", "--save_every", "2", "--temp", "1.1",
                              "--device", DEV, "--out", str(out)], env_dir=str(tmp_path))
    assert compiled == [DEV == "cuda"], printed[-2000:]
    steps = [json.loads(line) for line in open(out / "metrics.jsonl") if '"step"' in line]
    steps = [s for s in steps if "logp_mismatch" in s]
    assert len(steps) == 2, steps
    for s in steps:
        assert s["logp_mismatch"] < 0.02 and s["grad_norm"] > 0, s
    trained, _ = common.load_model(str(out), device="cpu")
    moved = sum((a - b).abs().sum().item() for a, b in zip(trained.parameters(), model.parameters()))
    assert moved > 0
