"""
The standing benchmark: one full RL step (rollouts + update, rl.py's own functions) on a random-initialised model
of a real shape, built offline from transformers' config classes (no download).

    python bench.py --shape tiny                                   # CPU, seconds (CI runs it): both engines
    python bench.py --shape qwen3-0.6b qwen3-1.7b lfm2-2.6b        # one GPU: the table in the README
    python bench.py --shape qwen3-0.6b --engine fast               # the fast engine alone
    python bench.py --shape qwen3-0.6b --eager --profile 15        # decoding without CUDA graphs; the costliest operators
    python bench.py --shape qwen3-0.6b --grad_ckpt off --token_budget 16384   # the update without checkpointing
    python bench.py --shape qwen3-0.6b --compile off               # the update's layers eager: what compiling saves

Random weights write noise, so the benchmark fixes the workload, not the model: every step is --examples x --group
episodes (default 32 x 8 = 256) of --turns model turns (5) of exactly --reply_tokens sampled tokens (64; the
end-of-turn token is suppressed until then and the turn is cut there), an environment message of --env_tokens
(~40) after each turn and a system prompt of --system_tokens (~150). The tokenizer is a word-level one with one
word per id of the model's vocabulary, so every count is exact.

Reported per shape and rollout engine (--engine: the fast one, engine.py, and generate(), the reference; the median
of --steps timed steps, after --warmup_steps untimed ones):
  gen tok/s     sampled tokens per second of the rollouts;
  floor %       the bandwidth floor of the rollouts' decoding steps over their measured time: each decoding step
                must read every weight once (bf16) plus every live KV-cache entry (each episode's own context, not
                the padded span an engine may read), so the floor is the sum over steps of (weight bytes + live KV
                bytes) / the GPU's memory bandwidth;
  upd tok/s     tokens per second of the update (the forward + backward of every episode's tokens);
  MFU           model FLOPs of the update over the GPU's bf16 dense peak: 6 x params x tokens, the output layer only
                on the positions that predict a sampled token (the only ones the loss puts through it), + causal
                attention; checkpointing's recompute is not counted;
  peak GB       peak GPU memory of the step;
  step          seconds per RL step, split into generation / update / other.
Results are also appended as one JSON line per shape (with vars(args)) to --out.
"""
import argparse
import contextlib
import functools
import json
import os
import random
import statistics
import time
import zlib

import torch

import rl
from common import Scorer, on_device, pick_device, train_autocast
from engine import compile_layers, enable_grad_ckpt
from sample import HFPolicy

# ----------------------------------------------------------------------------- model shapes

# The published shapes of the models our users train, as config keyword arguments (random weights, no download).
SHAPES = {
    "tiny": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=2048)),
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)),
    "qwen3-1.7b": ("qwen3", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)),
    "lfm2-1.2b": ("lfm2", dict(hidden_size=2048, intermediate_size=12288, num_hidden_layers=16, num_attention_heads=32,
                               num_key_value_heads=8, vocab_size=65536, block_auto_adjust_ff_dim=True,
                               full_attn_idxs=[2, 5, 8, 10, 12, 14])),
    "lfm2-2.6b": ("lfm2", dict(hidden_size=2048, intermediate_size=10752, num_hidden_layers=30, num_attention_heads=32,
                               num_key_value_heads=8, vocab_size=65536, block_auto_adjust_ff_dim=False,
                               full_attn_idxs=[2, 6, 10, 14, 18, 21, 24, 27])),
    "gemma3-1b": ("gemma3_text", dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                                      num_key_value_heads=1, head_dim=256, vocab_size=262144, sliding_window=512)),
}

# memory bandwidth (bytes/s) and bf16 dense peak (FLOP/s) by GPU name
GPUS = {"H100": (3.35e12, 989e12), "H200": (4.8e12, 989e12), "A100": (2.0e12, 312e12)}


def word_tokenizer(vocab_size):
    """A word-level tokenizer with one word per id and a ChatML template: text of n words is n tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    words = special + ["system", "user", "assistant"]
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(vocab_size - len(words))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=special)
    fast.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    return fast


def build_model(shape, device):
    """(model, tokenizer): random weights of `shape` (a SHAPES name, or its (model_type, config kwargs)) in fp32
    (as rl.py trains), built directly on the device."""
    from transformers import AutoConfig, AutoModelForCausalLM
    model_type, kw = SHAPES[shape] if isinstance(shape, str) else shape
    tokenizer = word_tokenizer(kw["vocab_size"])
    config = AutoConfig.for_model(model_type, **kw, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return on_device(model, device), tokenizer


# ----------------------------------------------------------------------------- the fixed workload


class FixedEnv:
    """An environment of fixed lengths: a system prompt of `system_tokens` words, user messages of `env_tokens`
    words, `turns` model turns; the reward is a hash of the replies (noise, but it varies, so every episode has an
    advantage and goes through the update)."""
    reward_weights = {"noise": 1.0}

    def __init__(self, system_tokens, env_tokens, turns):
        self.system_prompt = " ".join(f"w{i % 997}" for i in range(system_tokens))
        self.env_tokens, self.max_turns = env_tokens, turns

    def examples(self, n, seed=0):
        return [{"seed": seed * 100_003 + i} for i in range(n)]

    def message(self, seed):
        rng = random.Random(seed)
        return " ".join(f"w{rng.randrange(1000, 60000)}" for _ in range(self.env_tokens))

    def reset(self, example):
        state = {"seed": example["seed"], "turn": 0, "replies": []}
        return state, self.message(example["seed"])

    def step(self, state, reply):
        state["turn"] += 1
        state["replies"].append(reply)
        return None if state["turn"] == self.max_turns else self.message(state["seed"] * 31 + state["turn"])

    def rewards(self, state):
        return {"noise": (zlib.crc32("".join(state["replies"]).encode()) % 1000) / 1000}


# ----------------------------------------------------------------------------- counting bytes and FLOPs


def count_params(model):
    """Parameters a decoding step reads and whose FLOPs count: the input embedding is only gathered, so it counts
    only where it is tied to the output head."""
    total = sum(p.numel() for p in model.parameters())
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return total if emb is head else total - emb.numel()


def attention_dims(config):
    """(attention layers, KV heads x head_dim, query heads x head_dim) of a config."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    n_attn = sum(t in ("full_attention", "sliding_attention") for t in types)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return n_attn, config.num_key_value_heads * head_dim, config.num_attention_heads * head_dim


def decode_floor(records, n_read, config, bandwidth):
    """Seconds the rollouts' decoding steps need at least: every step reads the weights (bf16) and the live KV
    cache (bf16) of every episode still playing. A turn's decoding step j of an episode whose context holds c
    tokens before the reply reads c + j cached positions."""
    n_attn, kv_dim, _ = attention_dims(config)
    kv_per_token = 2 * n_attn * kv_dim * 2  # keys and values, bf16
    steps = {}  # (turn, j) -> live KV tokens summed over the episodes at that step
    for r in records:
        turn = 0
        for i, m in enumerate(r["mask"]):
            if m and (i == 0 or not r["mask"][i - 1]):  # the first sampled token of a turn
                j = 0
                while i + j < len(r["mask"]) and r["mask"][i + j]:
                    steps[(turn, j)] = steps.get((turn, j), 0) + i + j
                    j += 1
                turn += 1
    total_bytes = sum(2 * n_read + kv_per_token * kv for kv in steps.values())
    return total_bytes / bandwidth, len(steps)


def update_flops(records, n_flop, n_head, config):
    """Forward + backward FLOPs: 6 x params x tokens, except the output layer's n_head parameters, which only the
    positions predicting a sampled token go through (common.token_logprobs); causal attention 6 x layers x q_dim x
    T^2 per sequence."""
    n_attn, _, q_dim = attention_dims(config)
    lengths = [len(r["ids"]) for r in records]
    predicting = sum(sum(r["mask"][1:]) for r in records)
    return 6 * (n_flop - n_head) * sum(lengths) + 6 * n_head * predicting + 6 * n_attn * q_dim * sum(t * t for t in lengths)


# ----------------------------------------------------------------------------- one shape


def bench_shape(shape, engine, args, device):
    model, tokenizer = build_model(shape, device)
    rl_args = rl.parse_args(["--batch", str(args.examples * args.group), "--group", str(args.group), "--temp", str(args.temp),
                             "--max_new_tokens", str(args.reply_tokens), "--token_budget", str(args.token_budget),
                             "--gen_batch", str(args.gen_batch), "--grad_ckpt", args.grad_ckpt])
    grad_ckpt = enable_grad_ckpt(model, rl_args.grad_ckpt, device)
    compiled = compile_layers(model, args.compile, device)
    env = FixedEnv(args.system_tokens, args.env_tokens, args.turns)
    policy = HFPolicy(model, tokenizer, env.system_prompt, rl_args.temp, 1.0, args.reply_tokens, rl_args.gen_batch,
                      min_new_tokens=args.reply_tokens, engine=engine, **({"cuda_graphs": not args.eager} if engine == "fast" else {}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.99))
    amp = train_autocast(device)
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step = functools.partial(rl_step, env, policy, model, rl_args, opt, amp, args, sync)
    rows = []
    for n in range(args.warmup_steps + args.steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        records, gen_s, update_s = step(n)
        rows.append(dict(step_s=gen_s + update_s, gen_s=gen_s, update_s=update_s, records=records,
                         peak_gb=torch.cuda.max_memory_allocated() / 2**30 if cuda else None))
        print(f"{shape} step {n}{' (warm-up)' if n < args.warmup_steps else ''}: {gen_s + update_s:.2f}s "
              f"(generation {gen_s:.2f}s, update {update_s:.2f}s)", flush=True)
    if args.profile:  # one more step, untimed, its generation and its update each under the profiler
        step(args.warmup_steps + args.steps, around=functools.partial(profiled, shape, args.profile, cuda))
    timed = rows[args.warmup_steps:]
    median = lambda k: statistics.median(r[k] for r in timed)
    records = timed[-1]["records"]
    gen_tokens = sum(sum(r["mask"]) for r in records)
    n_counted = count_params(model)
    bandwidth, peak_flops = gpu_specs(device, args)
    floor_s, n_steps = decode_floor(records, n_counted, model.config, bandwidth) if bandwidth else (None, None)
    flops = update_flops(records, n_counted, model.get_output_embeddings().weight.numel(), model.config)
    out = {"shape": shape, "engine": policy.engine.name, "params": sum(p.numel() for p in model.parameters()), "episodes": len(records),
           "gen_tokens": gen_tokens, "train_tokens": sum(len(r["ids"]) for r in records), "decode_steps": n_steps,
           "step_s": median("step_s"), "gen_s": median("gen_s"), "update_s": median("update_s"),
           "gen_tok_s": gen_tokens / median("gen_s"),
           "floor_s": floor_s, "floor_frac": floor_s / median("gen_s") if floor_s else None,
           "upd_tok_s": sum(len(r["ids"]) for r in records) / median("update_s"),
           "mfu": flops / median("update_s") / peak_flops if peak_flops else None,
           "peak_gb": max(r["peak_gb"] for r in timed) if cuda else None,
           "cuda_graphs": getattr(policy.engine, "cuda_graphs", False),  # the fast engine's
           "grad_ckpt": grad_ckpt, "compiled": compiled}
    out["other_s"] = out["step_s"] - out["gen_s"] - out["update_s"]
    del model, opt, policy
    if cuda:
        torch.cuda.empty_cache()
    return out


def rl_step(env, policy, model, rl_args, opt, amp, args, sync, n, around=lambda part: contextlib.nullcontext()):
    """RL step n of the fixed workload, rl.py's own functions: (records, generation s, update s); around(part) is
    entered for each part, "generation" and "update"."""
    sync()
    t0 = time.time()
    model.eval()
    with around("generation"):
        records = rl.sample_rollouts(env, env.examples(args.examples, seed=n), policy, args.group, n * args.examples)
    sync()
    t1 = time.time()
    adv = rl.group_advantages([r["reward"] for r in records], args.group)
    model.train()
    with around("update"):
        rl.update(Scorer(model), records, adv, rl_args, opt, amp)
    sync()
    return records, t1 - t0, time.time() - t1


@contextlib.contextmanager
def profiled(shape, rows, cuda, part):
    """Run the block under torch.profiler and print its `rows` costliest operators (by GPU time when there is one)."""
    from torch.profiler import ProfilerActivity, profile
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        yield
    print(f"{shape}: {part}, by {sort}\n" + prof.key_averages().table(sort_by=sort, row_limit=rows))


def gpu_specs(device, args):
    """(memory bandwidth B/s, bf16 peak FLOP/s): the flags, else from the GPU's name; (None, None) on CPU."""
    if args.bandwidth or args.peak_tflops:
        return args.bandwidth, args.peak_tflops * 1e12 if args.peak_tflops else None
    if not device.startswith("cuda"):
        return None, None
    name = torch.cuda.get_device_name()
    return next((v for k, v in GPUS.items() if k in name), (None, None))


def table(results, device_name):
    fmt = lambda v, f: "n/a" if v is None else format(v, f)
    lines = [f"Device: {device_name}", "",
             "| shape | engine | params | gen tok/s | floor % (live KV) | upd tok/s | MFU % | peak GB | step s (gen / update / other) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        setting = ", ".join(s for s, on in (("graphs", r["cuda_graphs"]), ("grad ckpt", r["grad_ckpt"]), ("compiled", r["compiled"])) if on)
        lines.append(f"| {r['shape']}{f' ({setting})' if setting else ''} | {r['engine']} | {r['params'] / 1e6:,.1f}M | {r['gen_tok_s']:,.0f} | "
                     f"{fmt(r['floor_frac'] and 100 * r['floor_frac'], '.0f')} | {r['upd_tok_s']:,.0f} | "
                     f"{fmt(r['mfu'] and 100 * r['mfu'], '.0f')} | {fmt(r['peak_gb'], '.1f')} | "
                     f"{r['step_s']:.2f} ({r['gen_s']:.2f} / {r['update_s']:.2f} / {r['other_s']:.2f}) |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs="+", default=["tiny"], choices=list(SHAPES), help="model shapes to measure")
    p.add_argument("--engine", nargs="+", default=["fast", "hf"], choices=["fast", "hf"], help="rollout engines to time, "
                   "each on its own model of the shape: fast (engine.py) and hf (generate(), the reference)")
    p.add_argument("--examples", type=int, default=32, help="examples per step")
    p.add_argument("--group", type=int, default=8, help="rollouts per example (episodes = examples x group)")
    p.add_argument("--turns", type=int, default=5, help="model turns per episode")
    p.add_argument("--reply_tokens", type=int, default=64, help="sampled tokens per turn, exactly")
    p.add_argument("--env_tokens", type=int, default=40, help="words (= tokens) of each environment message")
    p.add_argument("--system_tokens", type=int, default=150, help="words (= tokens) of the system prompt")
    p.add_argument("--temp", type=float, default=1.1, help="sampling temperature")
    p.add_argument("--steps", type=int, default=2, help="timed steps (the median is reported)")
    p.add_argument("--warmup_steps", type=int, default=1, help="untimed steps first (allocator, kernels, graphs)")
    p.add_argument("--gen_batch", type=int, default=512, help="rl.py --gen_batch: max episodes per rollout batch")
    p.add_argument("--token_budget", type=int, default=32768, help="rl.py --token_budget: padded tokens per micro-batch")
    p.add_argument("--grad_ckpt", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
                   help="rl.py --grad_ckpt: gradient checkpointing in the update (auto: on for 300M+ parameters on a GPU)")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto", help="the decoder "
                   "layers through torch.compile in the update (auto: on a GPU for 300M+ parameters; its compilation falls in the "
                   "warm-up step)")
    p.add_argument("--eager", action="store_true", help="decode without CUDA graphs (on a GPU rl.py captures the "
                   "decoding step as a graph once a turn): to measure what the graphs save")
    p.add_argument("--bandwidth", type=float, default=None, help="memory bandwidth in bytes/s (default: from the GPU's name)")
    p.add_argument("--peak_tflops", type=float, default=None, help="bf16 dense peak in TFLOP/s (default: from the GPU's name)")
    p.add_argument("--profile", type=int, default=0, help="after the timed steps, one more under torch.profiler: print "
                   "this many of its costliest operators, for generation and for the update (0: no profile)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument("--out", default=None, help="append one JSON line per shape here")
    args = p.parse_args()
    device = pick_device(args.device)
    device_name = torch.cuda.get_device_name() if device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"
    results = []
    for shape in args.shape:
        for engine in args.engine:
            results.append(bench_shape(shape, engine, args, device))
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps({**results[-1], "device": device_name, "args": vars(args)}) + "\n")
    print(table(results, device_name))


if __name__ == "__main__":
    main()
