"""
The rollout engine on a GPU: exactness of the CUDA-graph decoding step, and the engine against generate().

    python docs/gpu_check.py exact                 # graphs vs no graphs, RowCache vs re-encoding, vs a replay
    python docs/gpu_check.py generate --shape qwen3-0.6b   # one turn of 256 x 64 tokens: engine vs model.generate

`exact` builds small random models of four architectures on the GPU (Qwen3, Gemma 3 with a sliding window, LFM2
with convolutions, Qwen3.5 with linear attention), plays greedy and sampled multi-turn rollouts and checks that
  - the CUDA-graph decoding step gives the same tokens and logprobs, bit for bit, as the same step run eagerly;
  - the RowCache gives the tokens of re-encoding every turn (bf16: a near-tie may flip; the share is printed);
  - every recorded logprob is that of one forward over the whole trajectory, within bf16 rounding.
`generate` times the first turn of the standard step (256 episodes, a ~190-token prompt, exactly 64 sampled tokens)
through our engine (fp32 weights under bf16 autocast, as rl.py samples: eager, then a CUDA graph per turn with SDPA
and with matrix products as the decoding step's attention) and through model.generate (dynamic cache, then static
cache; the same weights in bf16; --engine_only skips these).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import bench  # noqa: E402
from sample import HFPolicy, rollout  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: to check this script itself

SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=4096)
ARCHS = {
    "qwen3": ("qwen3", dict(SMALL, head_dim=64)),
    "gemma3": ("gemma3_text", dict(SMALL, head_dim=64, sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2)),
    "lfm2": ("lfm2", dict(SMALL, full_attn_idxs=[1, 3], block_auto_adjust_ff_dim=False)),
    "qwen3_5": ("qwen3_5_text", dict(SMALL, head_dim=64, layer_types=["linear_attention", "full_attention"] * 2,
                                     linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
                                     linear_num_value_heads=4)),
}


# bf16: how far a recorded logprob may be from the replay's. Linear attention's bf16 rounding is larger: on a CPU
# transformers' own cache path (re-encoding) is 0.08-0.11 from the replay, as far as the RowCache's rows
BF16_REPLAY = {"qwen3_5": 0.2}


def small_model(name, sharpen=3.0):
    bench.SHAPES[name] = ARCHS[name]
    model, tok = bench.build_model(name, DEV)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(sharpen)  # greedy replies that depend on the context, not one repeated token
    return model, tok


def replay_logprobs(model, rec, temp, bf16):
    """Max |recorded logprob - that of one forward over the whole trajectory| over the sampled tokens of `rec`."""
    ids = torch.tensor([rec["ids"]], device=DEV)
    with torch.no_grad(), torch.autocast(DEV, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits / temp, -1)
    pos = [t for t, m in enumerate(rec["mask"]) if m]
    want = logp[torch.tensor(pos) - 1, torch.tensor([rec["ids"][t] for t in pos])]
    return (torch.tensor([rec["logprobs"][t] for t in pos], device=DEV) - want).abs().max().item()


def exact():
    """In fp32 every check is tight: graphs == eager bit for bit, the RowCache gives re-encoding's tokens, every
    logprob within 1e-3 of the replay. Under bf16 autocast (how rl.py samples on a GPU) the graph must still equal the
    eager step bit for bit, and the replay agrees within bf16's rounding (0.1; BF16_REPLAY); near-ties may flip a token between
    the RowCache and re-encoding, so their share is printed, not checked."""
    env = bench.FixedEnv(system_tokens=30, env_tokens=7, turns=3)
    failures = 0
    for name in ARCHS:
        model, tok = small_model(name)
        for bf16 in (False, True):
            for temp in (0.0, 1.0):
                runs = {}
                for label, graphs, engine in (("graphs", True, "fast"), ("eager", False, "fast"), ("reencode", False, "hf")):
                    options = {"cuda_graphs": graphs} if engine == "fast" else {}
                    policy = HFPolicy(model, tok, env.system_prompt, temp=temp, max_new_tokens=24, batch_size=8, seed=3,
                                      engine=engine, **options)
                    policy.engine.autocast = bf16
                    runs[label] = rollout(env, env.examples(6, seed=1), policy, group=2, progress=False)
                    if graphs and DEV == "cuda":
                        assert policy.engine.cuda_graphs, "CUDA graph capture failed"
                g, e, r = runs["graphs"], runs["eager"], runs["reencode"]
                same_ge = all(a["ids"] == b["ids"] and a["logprobs"] == b["logprobs"] for a, b in zip(g, e))
                same_gr = sum(a["ids"] == b["ids"] for a, b in zip(g, r)) / len(g)
                replay = max(replay_logprobs(model, rec, temp or 1.0, bf16) for rec in g)
                distinct = len({tuple(x for x, m in zip(rec["ids"], rec["mask"]) if m) for rec in g})
                ok = same_ge and (replay < BF16_REPLAY.get(name, 0.1) if bf16 else replay < 1e-3 and same_gr == 1)
                failures += not ok
                print(f"{name:7s} {'bf16' if bf16 else 'fp32'} temp {temp}: graphs == eager bit for bit: {same_ge}; "
                      f"same tokens as re-encoding: {same_gr:.0%} of episodes; max |logprob - replay| {replay:.1e}; "
                      f"distinct replies {distinct}/{len(g)} -> {'ok' if ok else 'FAIL'}", flush=True)
        del model
    print("EXACT", "ok" if not failures else f"{failures} FAILED")


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def compile_decoding():
    """An experiment, not in engine.py: decoding steps run the decoder layers compiled (common.compile_layers,
    inductor) inside the engine's CUDA graph, to fuse the small kernels of a decoding step (a Qwen3-0.6B step on an
    H100: ~1,250 kernels, ~7 of its ~15 ms outside attention). The RowCache's update stays eager (a graph break),
    and modules' int attributes stay dynamic, so the layer index (the cache's key) does not make one graph per
    layer. Patches engine.FastEngine for the rest of the process (bench.main too); returns the undo."""
    import torch._dynamo
    import engine
    from engine import compile_layers, compiled_layers
    saved = (torch._dynamo.config.allow_unspec_int_on_nn_module, torch._dynamo.config.recompile_limit,
             engine.RowCache.update, engine.FastEngine._continue)
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    torch._dynamo.config.recompile_limit = 32
    engine.RowCache.update = torch._dynamo.disable(saved[2])

    def _continue(self, policy, episodes, cache):
        logits, step = saved[3](self, policy, episodes, cache)
        if not hasattr(self.model.get_decoder().layers[0], "compiled_call"):
            compile_layers(self.model, "on", self.model.device.type)

        def compiled_step(tokens):
            with compiled_layers(self.model):
                return step(tokens)
        return logits, compiled_step
    engine.FastEngine._continue = _continue

    def undo():
        (torch._dynamo.config.allow_unspec_int_on_nn_module, torch._dynamo.config.recompile_limit,
         engine.RowCache.update, engine.FastEngine._continue) = saved
    return undo


def checkpoint_half():
    """An experiment, not in rl.py: gradient checkpointing on every other decoder layer only (transformers checks
    each layer's own flag), to recompute half as much in the update where memory allows (Qwen3-0.6B's update peaks
    at 33.6 GB of 80 with every layer checkpointed). Patches bench.py's enable_grad_ckpt for the rest of the
    process."""
    enable = bench.enable_grad_ckpt

    def enable_grad_ckpt(model, setting, device):
        on = enable(model, setting, device)
        for i, layer in enumerate(model.get_decoder().layers):
            layer.gradient_checkpointing = on and i % 2 == 0
        return on
    bench.enable_grad_ckpt = enable_grad_ckpt


def generate(shape, episodes=256, prompt_tokens=190, new_tokens=64, engine_only=False):
    model, tok = bench.build_model(shape, DEV)
    env = bench.FixedEnv(system_tokens=150, env_tokens=40, turns=1)
    timings, replay = {}, {}
    for graphs, by_matmul, compiled in ((False, True, False), (True, False, False), (True, True, False), (True, True, True)):
        policy = HFPolicy(model, tok, env.system_prompt, temp=1.1, max_new_tokens=new_tokens, batch_size=episodes,
                          min_new_tokens=new_tokens, engine="fast", cuda_graphs=graphs, decode_by_matmul=by_matmul)
        label = "engine (RowCache), " + ("a CUDA graph per turn" if policy.engine.cuda_graphs else "eager")
        label += ", decoding attention by " + ("matrix products" if by_matmul else "SDPA")
        label += ", layers compiled (experiment)" if compiled else ""
        undo = compile_decoding() if compiled else (lambda: None)
        for run in range(3):  # the first run warms up (kernels, allocator; the experiment's compilation)
            sync()
            t0 = time.time()
            recs = rollout(env, env.examples(episodes // 8, seed=run), policy, group=8, progress=False)
            sync()
            timings.setdefault(label, []).append(time.time() - t0)
        undo()
        replay[label] = max(replay_logprobs(model, rec, 1.1, policy.engine.autocast) for rec in recs[:8])
    prompt = len(recs[0]["ids"]) - new_tokens - 1
    ids = torch.randint(10, model.config.vocab_size, (episodes, prompt), device=DEV)
    if DEV == "cuda" and not engine_only:  # generate() in the weights' bf16 (a static cache takes the model's dtype, not autocast's)
        model.to(torch.bfloat16)
    generates = [] if engine_only else [("generate(), dynamic cache", {}), ("generate(), static cache", {"cache_implementation": "static"})]
    for label, kw in generates:
        try:
            for run in range(3):
                sync()
                t0 = time.time()
                with torch.no_grad():
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                         min_new_tokens=new_tokens, do_sample=True, temperature=1.1, top_k=0,
                                         pad_token_id=tok.pad_token_id, **kw)
                sync()
                timings.setdefault(label, []).append(time.time() - t0)
            assert out.shape[1] == prompt + new_tokens
        except Exception as e:
            print(f"{label}: failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    print(f"\n{shape}: one turn, {episodes} episodes, a {prompt}-token prompt, {new_tokens} sampled tokens each")
    for label, ts in timings.items():
        best = min(ts[1:]) if len(ts) > 1 else ts[0]
        print(f"| {label} | {best:.2f} s | {episodes * new_tokens / best:,.0f} tok/s | first run {ts[0]:.2f} s |"
              + (f" max abs(logprob - replay) {replay[label]:.1e} (8 episodes) |" if label in replay else ""))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["exact", "generate"], help="which check")
    p.add_argument("--shape", default="qwen3-0.6b", choices=list(bench.SHAPES), help="generate: the model shape")
    p.add_argument("--engine_only", action="store_true", help="generate: time the engine only, not model.generate()")
    a = p.parse_args()
    exact() if a.what == "exact" else generate(a.shape, engine_only=a.engine_only)
