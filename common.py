"""Plumbing shared by sample.py, sft.py, rl.py and eval.py, none of it RL or SFT: loading
environments and models, broadcasting a KV cache, token logprobs for training, the run's flags,
learning-rate schedule, checkpoints with exact resume, and log lines."""
import contextlib
import errno
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import os
import pickle
import random
import shutil
import signal
import sys
import tempfile

import torch
from torch.utils.checkpoint import checkpoint

from ranks import (check_ranks_agree, full_weights, is_sharded, load_optimizer_state,
                   local_optimizer_state, start_ranks, sum_gradients, sum_over_ranks,
                   wait_for_rank0)

# ----------------------------------------------------------------------------- environments
def parse_env_args(env_args):
    """--env_args: a JSON object string (or an already parsed dict)."""
    if isinstance(env_args, dict):
        return env_args
    try:
        parsed = json.loads(env_args) if env_args and env_args.strip() else {}
    except json.JSONDecodeError as e:
        raise SystemExit(f"--env_args is not valid JSON ({e}): e.g. '{{\"num_groups\": 4}}'")
    if not isinstance(parsed, dict):
        raise SystemExit(f"--env_args must be a JSON object of keyword arguments, got {env_args!r}")
    return parsed


def load_env(name, env_args=None, defaults=None):
    """Import env_NAME.py and call its load_environment(**env_args); env_args may be a JSON string.
    `defaults` are passed where load_environment takes them and env_args does not set them."""
    env_args = parse_env_args(env_args)
    try:
        module = importlib.import_module(f"env_{name}")
    except ModuleNotFoundError as e:
        if e.name != f"env_{name}":
            raise SystemExit(f"env_{name}.py imports {e.name!r}, which is not installed ({e})")
        here = os.path.dirname(os.path.abspath(__file__))
        found = sorted(f[4:-3] for f in os.listdir(here) if f.startswith("env_") and f.endswith(".py"))
        raise SystemExit(f"no environment {name!r}: write env_{name}.py with a load_environment() "
                         f"(found: {', '.join(found)})")
    except Exception as e:  # a syntax error, or an error raised while the file runs
        raise SystemExit(f"env_{name}.py failed to import: {type(e).__name__}: {e}")
    if not callable(getattr(module, "load_environment", None)):
        raise SystemExit(f"env_{name}.py has no load_environment() function")
    accepted = inspect.signature(module.load_environment).parameters
    env_args = {**{k: v for k, v in (defaults or {}).items() if k in accepted}, **env_args}
    try:
        return module.load_environment(**env_args)
    except TypeError as e:
        raise SystemExit(f"bad --env_args for {name}: {e}; it accepts {list(accepted)}")
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"bad --env_args for {name}: {e}")


def eval_settings(name):
    """{setting: overrides of --env_args} of the standard evaluations, from env_NAME.py."""
    return getattr(importlib.import_module(f"env_{name}"), "EVAL_SETTINGS", {"default": {}})


# ----------------------------------------------------------------------------- models
def pick_device(device="auto"):
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def weights_dtype(device, train=False, path=None):
    """bf16 on a GPU for sampling, else fp32; a local float64 checkpoint (path) stays float64 (the
    tests compare runs that sum in another order in float64, far below any real difference)."""
    config = os.path.join(path or "", "config.json")
    if path and os.path.isfile(config):
        with open(config) as f:
            cfg = json.load(f)
        if "float64" in (cfg.get("dtype"), cfg.get("torch_dtype")):
            return torch.float64
    return torch.bfloat16 if device.startswith("cuda") and not train else torch.float32


def at_least_fp32(x):
    """x in fp32, or in its own dtype where that is wider (float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


LOCAL_PREFIXES = ("out/", "./", "../", "/", "~")  # paths naming a local directory, never a hub id


def load_model(path, device="auto", train=False):
    """(model, tokenizer) from a hub id or a save_pretrained directory, SDPA; bf16 on a GPU for
    sampling, else fp32 (train=True: bf16 autocast), as bf16 would round RL's AdamW updates away."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # our own progress is what matters, not weight-loading bars
    device = pick_device(device)
    if path.startswith(LOCAL_PREFIXES) and not os.path.isdir(path):  # fail now, not after retries
        made_by = ("`python sft.py` (its --out, out/sft by default)"
                   if os.path.normpath(path) == os.path.normpath("out/sft")
                   else "the script whose --out it is (`bash speedrun.sh` writes out/speedrun/...)")
        raise SystemExit(f"could not load model {path!r}: there is no such directory. Make it with "
                         f"{made_by}, or pass --model a hub id or a save_pretrained directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=weights_dtype(device, train, path), attn_implementation="sdpa")
    except Exception as e:  # not found, not a model, or a corrupt weights file
        hint = ("it is not a local directory and could not be fetched from the hub (no network?). "
                "Pass a directory saved with save_pretrained (e.g. out/sft), or build one offline "
                "with `python sft.py --model scratch`" if not os.path.isdir(path)
                else "the directory is not a complete, readable save_pretrained model")
        raise SystemExit(f"could not load model {path!r}: {hint}.\n  "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:300]})")
    if not tokenizer.chat_template:
        raise SystemExit(f"{path!r} has no chat template: use an instruct/chat model, or set "
                         "tokenizer.chat_template and save it (sft.py --model scratch writes one)")
    return on_device(model, device), tokenizer


def on_device(model, device):
    """The model on `device`, in eval mode, with the attention settings the rollouts need there."""
    if device.startswith("cuda"):
        # cuDNN's attention plans anew, on the CPU, for each new shape: a rollout's keys grow by one
        # every token, so planning left the GPU idle. Flash and memory-efficient attention don't.
        torch.backends.cuda.enable_cudnn_sdp(False)
    return model.to(device).eval()


def train_autocast(device):
    """The training forward's autocast: bf16 on a GPU (fp32 weights: load_model), off on CPU."""
    cuda = device.startswith("cuda")
    return torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=cuda)


# ----------------------------------------------------------------------------- KV caches
def cache_kwarg(module):
    """The name under which a transformers model's forward takes its KV cache: `cache` in recent
    transformers (5.24 warns at the old name, which 5.40 drops), `past_key_values` before (5.17)."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def plain_cache_layers(output):
    """[(keys (B, H, T, D), values)] per layer of the KV cache a forward returned (under either
    name: cache_kwarg) when all of it is plain full attention, so its rows can be broadcast into a
    new DynamicCache; else None (sliding windows, recurrent layers)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer
    cache = output["cache"] if "cache" in output else output.past_key_values
    if isinstance(cache, DynamicCache) and all(type(l) is DynamicLayer for l in cache.layers):
        return [(l.keys, l.values) for l in cache.layers]
    return None


# ----------------------------------------------------------------------------- token logprobs
def pad_batch(seqs, pad_id, device):
    """Right-pad lists of ids (and matching lists) into (B, T) tensors."""
    width = max(len(s) for s in seqs[0])
    out = []
    for rows, fill in zip(seqs, (pad_id,) + (0,) * (len(seqs) - 1)):
        dtype = torch.long if isinstance(rows[0][0], int) else torch.float
        t = torch.full((len(rows), width), fill, dtype=dtype)
        for b, r in enumerate(rows):
            t[b, :len(r)] = torch.tensor(r, dtype=t.dtype)
        out.append(t.to(device))
    return out


def token_microbatches(lengths, budget):
    """Sequence indices in micro-batches of at most `budget` padded tokens (a long one alone)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > budget:
            batches.append(cur)
            cur = []
        cur.append(i)
    return batches + ([cur] if cur else [])


def decoder_hidden(model, ids):
    """Last hidden states (B, T, H) of right-padded rows (no mask needed). The rows' common prefix
    runs once, its keys/values broadcast to every row as the cache the rest attends to; a full
    forward where that cannot be (sliding windows, recurrent layers) or checkpointing is on."""
    from transformers import DynamicCache
    decoder = model.get_decoder()
    B, T = ids.shape
    prefix = int((ids == ids[:1]).all(0).long().cumprod(0).sum().clamp(max=T - 1))  # shared by all
    # --fsdp outside ranks.gathered: one forward a call, as every rank must gather the same weights
    one_pass = getattr(decoder, "gradient_checkpointing", False) or is_sharded(decoder)
    if B == 1 or prefix < 8 or one_pass:
        return decoder(input_ids=ids).last_hidden_state
    head = decoder(input_ids=ids[:1, :prefix], use_cache=True)
    kv = plain_cache_layers(head)
    if kv is None:
        return decoder(input_ids=ids).last_hidden_state
    # (1, heads, prefix, D) -> (B, heads, prefix, D), views: the backward sums over rows
    cache = DynamicCache([(K.expand(B, -1, -1, -1), V.expand(B, -1, -1, -1)) for K, V in kv])
    rest = decoder(input_ids=ids[:, prefix:], **{cache_kwarg(decoder): cache}).last_hidden_state
    return torch.cat([head.last_hidden_state.expand(B, -1, -1), rest], 1)  # rest: (B, T-prefix, H)


def head_logprobs(head, h, targets, temp):
    """(logprobs of `targets`, entropies) of hidden states h (n, H) under softmax(head(h)/temp)."""
    logp = torch.log_softmax(at_least_fp32(head(h)) / temp, dim=-1)  # (n, V)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(1, targets[:, None]).squeeze(1), entropy


def token_logprobs(model, ids, mask, temp, chunk=2048):
    """Logprobs and entropies of the tokens at mask == 1 under softmax(logits / temp); ids, mask:
    (B, T). Only loss positions reach the LM head, in checkpointed chunks of (chunk, V) logits."""
    hidden = decoder_hidden(model, ids)  # (B, T, H)
    sel = mask[:, 1:].bool()  # (B, T-1): position t predicts token t+1
    h, targets = hidden[:, :-1][sel], ids[:, 1:][sel]  # (N, H), (N,)
    head = model.get_output_embeddings()
    piece = getattr(model, "compiled_head_logprobs", head_logprobs)  # compile_layers: fused
    outs = [checkpoint(piece, head, h[i:i + chunk], targets[i:i + chunk], temp, use_reentrant=False)
            for i in range(0, len(h), chunk)]
    if not outs:
        return hidden.new_zeros(0, dtype=torch.float), hidden.new_zeros(0, dtype=torch.float)
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


class Scorer(torch.nn.Module):
    """token_logprobs(model, ...) as a module, the one training calls: under it --fsdp shards the
    model (ranks.shard), and a forward through it gathers what no decoder layer holds."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, mask, temp):
        return token_logprobs(self.model, ids, mask, temp)


# ----------------------------------------------------------------------------- training runs
@contextlib.contextmanager
def out_of_memory_says(what_to_lower):
    """Out of GPU memory within: one line naming the flags to turn down, not a traceback."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        raise SystemExit(f"out of GPU memory {what_to_lower}.\n  ({str(e)[:200]})") from e


GRAD_CKPT_AUTO_PARAMS = 300 * 10**6  # GPU models this big: --grad_ckpt auto on, update compiled
GRAD_CLIP = 1.0  # the gradient's norm is clipped to this in SFT and RL
MAX_BAD_STEPS = 3  # steps in a row with a non-finite update before a run stops


def optimizer_step(model, opt, loss):
    """The gradients summed over the ranks and clipped to GRAD_CLIP, then the optimizer's step,
    skipped (with a warning) where the ranks' summed loss or the norm is not finite. Returns (that
    loss, the norm before clipping, a number, whether it stepped)."""
    sum_gradients(model)
    loss = sum_over_ranks([loss])[0]
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)  # --fsdp: a DTensor
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    stepped = math.isfinite(loss) and math.isfinite(norm)
    if stepped:
        opt.step()
    else:
        print(f"warning: non-finite loss {loss} or grad norm {norm}: update skipped")
    opt.zero_grad(set_to_none=True)
    return loss, norm, stepped


def end_of_step(step, total, args, preempt, rank, run_eval, save, bad_steps):
    """What follows a step in sft.py and rl.py: the stop after MAX_BAD_STEPS steps in a row with a
    non-finite update; unless it was the last step (the run's end does its own), run_eval() and
    save() where due, and on a signal (Preemption) the save and the exit. Every rank calls it."""
    if bad_steps >= MAX_BAD_STEPS:
        raise SystemExit(f"{bad_steps} non-finite updates in a row: stopping. The last good "
                         f"checkpoint is in {args.out}; lower --lr, or check the model's dtype.")
    if step >= total:
        return
    signalled = preempt.due()  # a collective: the ranks stop after the same step
    if args.eval_every and step % args.eval_every == 0:
        run_eval()
    if signalled or args.save_every and step % args.save_every == 0:
        save()
    if signalled:
        preempt.stop(f"the checkpoint of step {step} is in {args.out}", rank)


def run_training(parse_args, train):
    """main() of sft.py and rl.py: train(args, preempt) where SIGTERM or Ctrl-C ends the step in
    flight, saves it and exits (Preemption), and a full disk ends in one line, not a traceback."""
    with disk_full_says_what_is_kept("The last complete checkpoint in --out is kept: free space, "
                                     "then rerun with --resume."), Preemption() as preempt:
        train(parse_args(), preempt)


def add_train_args(p, lr, warmup, token_budget, out, eval_every, eval_n, save_every):
    """Optimizer and run flags shared by sft.py and rl.py; the defaults differ per script."""
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=warmup, help="linear lr warm-up steps")
    p.add_argument("--token_budget", type=int, default=token_budget,
                   help="max padded tokens per micro-batch (gradient accumulation above it)")
    p.add_argument("--grad_ckpt", nargs="?", const="on", default="auto",
                   choices=["auto", "on", "off"], help="gradient checkpointing in the transformer "
                   "(less memory, slower; --grad_ckpt alone: on). auto: on for a model of "
                   f"{GRAD_CKPT_AUTO_PARAMS // 10**6}M+ parameters on a GPU, off otherwise")
    p.add_argument("--fsdp", action="store_true", help="under torchrun: shard the weights, "
                   "gradients and optimizer state over the ranks (FSDP2), not a whole copy each")
    p.add_argument("--out", default=out, help="run directory: model checkpoint, logs, evaluations")
    p.add_argument("--resume", action="store_true", help="continue exactly from DIR's checkpoint")
    p.add_argument("--eval_every", type=int, default=eval_every,
                   help="greedy game evaluation every N steps (0: only at the end)")
    p.add_argument("--eval_n", type=int, default=eval_n, help="episodes per evaluation setting")
    p.add_argument("--save_every", type=int, default=save_every, help="checkpoint every N steps")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--device", default="auto",
                   help="cuda, cpu or auto (under torchrun each rank takes its LOCAL_RANK's GPU)")
    p.add_argument("--report_to", choices=["none", "trackio", "wandb"], default="none",
                   help="also log every line to a trackio run (local, no account: `trackio show` "
                   "draws it) or a wandb run; optional imports")
    return p


def positive(x):
    return math.isfinite(x) and x > 0


def non_negative(x):
    return math.isfinite(x) and x >= 0


def at_least(n):
    return lambda x: x >= n


def can_write(path):
    """True when directory PATH can be created or written, by a probe file (permission bits lie)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return False  # a regular file sits where a directory of the path must be
    try:
        with tempfile.TemporaryFile(dir=probe):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def disk_full_says_what_is_kept(kept):
    """A full or read-only disk mid-run ends with one line saying what is kept, not a traceback."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise
        raise SystemExit(f"could not write{' ' + str(e.filename) if e.filename else ''}: "
                         f"{e.strerror}. {kept}") from None


class Preemption:
    """SIGTERM or SIGINT (a cluster preempting the job, Ctrl-C): the first asks the training loop to
    finish its step, save and exit (the grace period before SIGKILL); a second stops at once, the
    last complete checkpoint intact (saves are written, then renamed). Under torchrun each rank asks
    due() after every step, together, so all stop after the same one. now=True: the first stops."""

    def __init__(self, now=False):
        self.now, self.signal = now, None

    def __enter__(self):
        self.saved = {s: signal.signal(s, self._caught) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc):
        for s, handler in self.saved.items():
            signal.signal(s, handler)

    def _caught(self, signum, frame):
        if self.now or self.signal is not None:
            self.signal = self.signal or signum
            raise KeyboardInterrupt
        self.signal = signum
        print(f"\n{signal.Signals(signum).name}: finishing this step, then saving (again: stop "
              "at once)", flush=True)

    def due(self):
        return sum_over_ranks([float(self.signal is not None)])[0] > 0

    def stop(self, what, rank=0):
        """Exit 128 + the signal's number, saying what is kept and the command that goes on."""
        argv = " ".join(a for a in sys.argv if a != "--resume")
        if rank == 0:
            print(f"stopped by {signal.Signals(self.signal or signal.SIGTERM).name}: {what}; go "
                  f"on with: python {argv} --resume", flush=True)
        raise SystemExit(128 + (self.signal or signal.SIGTERM))


TRAIN_FLAG_RULES = {  # the flags of add_train_args: (test, what the value must be)
    "lr": (positive, "a finite number > 0"),
    "warmup": (at_least(0), ">= 0"),
    "token_budget": (at_least(1), ">= 1"),
    "eval_every": (at_least(0), ">= 0 (0: evaluate only at the end)"),
    "eval_n": (at_least(1), ">= 1"),
    "save_every": (at_least(0), ">= 0"),
    "seed": (at_least(0), ">= 0"),
    "device": (lambda d: d in ("auto", "cpu") or (d.split(":")[0] == "cuda" and d.count(":") <= 1 and
               d.split(":")[-1].isdigit() or d == "cuda"), "auto, cpu, cuda or cuda:N"),
    "out": (can_write, "a directory you can write"),
}


def check_flags(args, rules):
    """Stop, before any work, at the first flag breaking its rule ({flag: (test, must be)})."""
    for flag, (ok, must) in rules.items():
        value = getattr(args, flag)
        if not ok(value):
            raise SystemExit(f"{'-' if len(flag) == 1 else '--'}{flag} {value}: must be {must}")


def lr_at(step, lr, warmup, total, schedule):
    """Linear warm-up, then constant or cosine decay to 10% of lr."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "cosine" and total > warmup:
        return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup)))))
    return lr


def start_run(args):
    """(rank, world size, device), seeds set; under torchrun, ranks but 0 print only errors."""
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    rank, world, device = start_ranks(pick_device(args.device))
    if rank:
        sys.stdout = open(os.devnull, "w")
    return rank, world, device


def save_run(model, tokenizer, out, rank, trainer_state, extra_json, opt=None):
    """Checkpoint, optimizer and RNG states, which rank 0 completes: the weights once all ranks
    checked theirs agree, or under --fsdp gathered to it, each rank's optimizer part beside them
    (optimizer.rankR.pt: resume joins the parts, for any number of ranks). Every rank calls it."""
    state, weights, tmp = {**trainer_state, "rng": rng_state()}, None, out.rstrip("/") + ".tmp"
    if not is_sharded(model):
        check_ranks_agree(model)
        state.update({"optimizer": opt.state_dict()} if opt else {})
    else:
        weights = full_weights(model)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        wait_for_rank0(f"creation of {tmp}")
        if opt:
            torch.save(local_optimizer_state(opt), os.path.join(tmp, f"optimizer.rank{rank}.pt"))
            state["optimizer_ranks"] = torch.distributed.get_world_size()
        wait_for_rank0(f"every rank's optimizer part in {tmp}")
    if rank == 0:
        save_checkpoint(model, tokenizer, out, state, extra_json, weights,
                        tmp_made=weights is not None)


def checkpoint_to_resume(args, rank=0):
    """True when --resume finds a checkpoint in DIR (and says so when not), once rank 0 finished a
    save a crash cut short (finish_save): the newest complete one, whatever ranks wrote it."""
    if args.resume and rank == 0:
        finish_save(args.out)
    if args.resume:
        wait_for_rank0(f"check of the checkpoint in {args.out}")
    found = args.resume and os.path.exists(os.path.join(args.out, "trainer_state.pt"))
    if args.resume and not found:
        print(f"--resume: no checkpoint in {args.out} yet, starting fresh")
    return found


def start_or_resume(args, opt, resume, rank=0):
    """Fresh run: clear DIR/metrics.jsonl. Resume: every rank loads the trainer state (optimizer,
    step, RNG) from DIR's checkpoint; rank 0 drops the log lines after it (they are redone)."""
    state_path = os.path.join(args.out, "trainer_state.pt")
    metrics_path = os.path.join(args.out, "metrics.jsonl")
    if not resume:
        if os.path.exists(metrics_path) and rank == 0:
            os.remove(metrics_path)
        return {"step": 0}
    try:  # a checkpoint is data: loading it never runs code that someone pickled into it
        ts = torch.load(state_path, weights_only=True)
        parts = [torch.load(os.path.join(args.out, f"optimizer.rank{r}.pt"), mmap=True,
                            weights_only=True) for r in range(ts.get("optimizer_ranks", 0))]
    except pickle.UnpicklingError as e:
        raise SystemExit(
            f"{args.out}'s trainer state holds more than tensors and plain data, which could run "
            "code when loaded: refusing it. This project's checkpoints never do; resume from one "
            f"of them, or start fresh without --resume.\n  ({str(e).splitlines()[0][:200]})")
    # the returned state holds no second copy of the optimizer's (parts: --fsdp's, per rank)
    load_optimizer_state(opt, *([parts[0], parts[1:]] if parts else [ts.pop("optimizer")]))
    set_rng_state(ts["rng"])
    if os.path.exists(metrics_path) and rank == 0:  # keep whole lines from before the checkpoint
        rows = open(metrics_path).readlines()[:ts.get("log_lines")]
        # json.dumps escapes newlines: a line without one is cut short by a crash
        rows = [r for r in rows if r.endswith("\n") and json.loads(r)["step"] <= ts["step"]]
        with open(metrics_path + ".part", "w") as f:
            f.writelines(rows)
        os.replace(metrics_path + ".part", metrics_path)
    print(f"resumed from {args.out} at step {ts['step']}")
    return ts


def samples_when_served(model):
    """The generation config for a server honouring it (transformers serve, vLLM) to sample as rl.py
    trains: do_sample (else greedy at any temperature), no top-k, temperature per request."""
    g = model.generation_config
    g.do_sample, g.top_k, g.top_p, g.temperature = True, 0, 1.0, 1.0


def save_checkpoint(model, tokenizer, out, trainer_state, extra_json, weights=None,
                    tmp_made=False):
    """save_pretrained + trainer state into OUT.tmp, swapped in by finish_save; trainer_state.pt is
    written last (atomically), so a crash leaves the old or a complete new checkpoint. weights:
    --fsdp's gathered state dict; tmp_made: OUT.tmp made by save_run, the optimizer's parts in it."""
    tmp = out.rstrip("/") + ".tmp"
    if not tmp_made:
        shutil.rmtree(tmp, ignore_errors=True)
    # the log's length now: --resume drops what is logged after this checkpoint (its step included)
    metrics_path = os.path.join(out, "metrics.jsonl")
    log_lines = sum(1 for _ in open(metrics_path)) if os.path.exists(metrics_path) else 0
    trainer_state = {**trainer_state, "log_lines": log_lines}
    samples_when_served(model)
    model.save_pretrained(tmp, safe_serialization=True, state_dict=weights)
    tokenizer.save_pretrained(tmp)
    for name, obj in extra_json.items():
        with open(os.path.join(tmp, name), "w") as f:
            json.dump(obj, f, indent=2)
    torch.save(trainer_state, os.path.join(tmp, "trainer_state.pt.part"))
    os.replace(os.path.join(tmp, "trainer_state.pt.part"), os.path.join(tmp, "trainer_state.pt"))
    finish_save(out)


def finish_save(out):
    """Bring OUT to the newest complete checkpoint, wherever a crash cut save_checkpoint short: a
    complete OUT.tmp takes OUT's logs and replaces it (OUT -> OUT.old, OUT.tmp -> OUT, OUT.old
    removed), an incomplete one is removed, a lone OUT.old is put back. Each step can be redone."""
    tmp, old = out.rstrip("/") + ".tmp", out.rstrip("/") + ".old"

    def take_logs(src):  # the run's logs and data move into the new checkpoint, where it lacks them
        for name in os.listdir(src):
            ours = name.endswith((".jsonl", ".png")) or name.startswith("eval")
            if ours and not os.path.exists(os.path.join(tmp, name)):
                shutil.move(os.path.join(src, name), os.path.join(tmp, name))
    if os.path.exists(os.path.join(tmp, "trainer_state.pt")):
        if os.path.isdir(out):
            take_logs(out)
            shutil.rmtree(old, ignore_errors=True)
            os.rename(out, old)
        elif os.path.isdir(old):  # a crash between the two renames: OUT.old may hold some logs
            take_logs(old)
        os.rename(tmp, out)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isdir(out) and os.path.exists(os.path.join(old, "trainer_state.pt")):
            os.rename(old, out)
    shutil.rmtree(old, ignore_errors=True)


def rng_state():
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s):
    random.setstate(s["python"])
    torch.set_rng_state(s["torch"])
    if s.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


# ----------------------------------------------------------------------------- log lines
class RunLog:
    """A run's log (rank 0's): one grep-able line per step on stdout, metrics.jsonl, --report_to."""

    def __init__(self, args, rank=0):
        self.path = os.path.join(args.out, "metrics.jsonl") if rank == 0 else None
        self.args, self.tracker = args, None
        self.report_to = args.report_to if rank == 0 and args.report_to != "none" else None
        if self.report_to and importlib.util.find_spec(self.report_to) is None:  # before any work
            raise SystemExit(f"--report_to {self.report_to}: it is not installed "
                             f"(pip install {self.report_to})")

    def __call__(self, step, metrics):
        # trackio keeps its runs on this machine; wandb needs an account or WANDB_MODE=offline
        if self.report_to and not self.tracker:
            self.tracker = importlib.import_module(self.report_to)
            # a --resume goes on in the run of the same name (wandb needs the id as well)
            again = {"resume": "allow"} if getattr(self.args, "resume", False) else {}
            if self.report_to == "wandb":
                again["id"] = hashlib.sha256(os.path.abspath(self.args.out).encode()).hexdigest()[:16]
            self.tracker.init(project="nanorlenv", name=os.path.normpath(self.args.out),
                              config=vars(self.args), **again)
        parts = [f"step {step}"] + [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                    for k, v in metrics.items()]
        print(" | ".join(parts), flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.tracker:
            self.tracker.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def evals(self, step, results):
        """The lines of an evaluate_standard() result: rates and mean reward per setting."""
        for name, (s, _) in results.items():
            self(step, {f"eval_{name}_{k}": v for k, v in s.items()
                        if k.endswith("_rate") or k == "reward_mean"})

    def close(self):
        if self.tracker:
            self.tracker.finish()
