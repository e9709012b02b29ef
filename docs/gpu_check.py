"""
The rollout engine on a GPU against generate(), and two experiments (compile_decoding, checkpoint_half) that
gpu_next.sh patches into bench.py. The engine's exactness on a GPU is tests/test_gpu.py's.

    python docs/gpu_check.py generate --shape qwen3-0.6b   # one turn of 256 x 64 tokens: engine vs model.generate

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
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from test_gpu import replay_logprobs  # noqa: E402
from sample import HFPolicy, rollout  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: to check this script itself


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
    p.add_argument("what", choices=["generate"], help="which check")
    p.add_argument("--shape", default="qwen3-0.6b", choices=list(bench.SHAPES), help="generate: the model shape")
    p.add_argument("--engine_only", action="store_true", help="generate: time the engine only, not model.generate()")
    a = p.parse_args()
    generate(a.shape, engine_only=a.engine_only)
