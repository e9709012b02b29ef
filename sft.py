"""
SFT warm-up: play teacher games, keep the good ones, train every parameter on the teacher's replies.

    python sft.py --model Qwen/Qwen3-1.7B --teacher gpt-5-mini --n_games 200 \
        --api_base https://api.openai.com/v1 --max_steps 30 --batch 32 --lr 1e-5  # GPU, reference
    python sft.py --model scratch --env_args '{"player_random_prob": 0.2}'  # CPU (speedrun.sh)
    python sft.py --model scratch --n_games 40 --max_steps 5 --eval_every 0 --out /tmp/sft  # smoke
    torchrun --standalone --nproc_per_node 8 sft.py --model Qwen/Qwen3-1.7B \
        --data out/sft/data.jsonl --batch 64  # 8 GPUs

--model scratch builds a small random-init Llama and a byte-level BPE tokenizer trained on the
environment's transcripts (ChatML template): an ordinary save_pretrained directory. Conversations
are laid out as rollouts are (sample.ChatTokens): the loss is on the assistant replies and their
end-of-turn tokens, except that the scratch model, which has never read anything, also learns to
predict the system and environment messages (--context_loss 0.3): that dense signal teaches it to
read what the environment says (docs/LESSONS.md).
Under torchrun each rank trains on its share of each batch (loss over the whole batch's reply
tokens, gradients summed; --fsdp shards the model over the ranks); rank 0 plays the teacher games,
builds a scratch model; others read DIR.
Output: DIR (out/sft), a save_pretrained model (eval.py, rl.py, transformers, vLLM), sft_args.json,
sft_results.json, metrics.jsonl, data.jsonl (the kept games), trainer_state.pt (for --resume).
"""
import argparse
import json
import math
import os
import random
import time

import torch

from common import (TRAIN_FLAG_RULES, RunLog, add_train_args, at_least, check_flags,
                    checkpoint_to_resume, end_of_step, load_env, load_model, lr_at, non_negative,
                    optimizer_step, pad_batch, parse_env_args, positive, run_training,
                    samples_when_served, save_run, start_or_resume, start_run, token_microbatches,
                    train_autocast)
from engine import scorer_to_train
from eval import evaluate_standard
from ranks import empty_passes, gathered, passes_behind, stop_ranks, sum_over_ranks, wait_for_rank0
from policies import FunctionPolicy, ScriptedPolicy, add_api_args, is_function_spec, make_policy
from sample import ChatTokens, HFPolicy, rollout

# the scratch tokenizer's chat template: ChatML, the format Qwen's models use too
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
          "{{ message['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# ----------------------------------------------------------------------------- teacher data
def keep_rules(keep):
    """--keep parsed: [] (all), [("reward>=", X)] or [(METRIC, VALUE), ...]; None unless each part
    is NAME=NUMBER, finite."""
    try:
        rules = ([] if keep == "all" else
                 [("reward>=", float(keep[len("reward>="):]))] if keep.startswith("reward>=") else
                 [(name, float(value)) for name, value in (r.split("=") for r in keep.split(","))])
    except ValueError:  # not a number, or not NAME=VALUE
        return None
    return rules if all(name and math.isfinite(value) for name, value in rules) else None


def keep_game(rec, rules):
    """Whether a teacher game passes keep_rules(): reward>=X, or each named metric equal to VALUE
    (one the environment does not report passes), e.g. format=1,loss=0: well-formed and not lost."""
    metrics = rec.get("metrics", {})
    return all(rec["reward"] >= value if name == "reward>=" else metrics.get(name, value) == value
               for name, value in rules)


def teacher_games(args, env):
    """Play --n_games with the teacher, each written to DIR/teacher_games.jsonl; return the kept."""
    policy = make_policy(args.teacher, env, args.device, args.teacher_temp, 1.0,
                         args.max_new_tokens, 256, args.api_base, args.api_key_env,
                         args.concurrency, args.seed, not args.no_api_seed)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "teacher_games.jsonl")
    games = []
    with open(path, "w", buffering=1) as f:  # line-buffered: each game is on disk as it ends
        def write(rec):
            games.append(rec)
            f.write(json.dumps({k: rec[k] for k in ("messages", "reward", "rewards", "metrics")}) + "\n")
        try:
            rollout(env, env.examples(args.n_games, args.seed + 1), policy, on_done=write)
        except RuntimeError as e:
            raise SystemExit(f"teacher failed after {len(games)} games (kept in {path}; "
                             f"reuse them with --data {path}): {e}")
    rules = keep_rules(args.keep)
    kept = [g for g in games if keep_game(g, rules)]
    means = {k: sum(g["metrics"][k] for g in kept) / len(kept) for k in (kept[0]["metrics"] if kept else {})}
    print(f"teacher {args.teacher}: {len(games)} games played, {len(kept)} kept ({args.keep}); "
          "the kept games' mean " + ", ".join(f"{k} {v:.3g}" for k, v in means.items()))
    return [g["messages"] for g in kept]


def read_data(path):
    if not os.path.exists(path):
        raise SystemExit(f"--data {path!r} does not exist (write one with --teacher, it lands in DIR/data.jsonl)")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError as e:
        raise SystemExit(f"--data {path!r} is not UTF-8 text (byte {e.start}): give a JSONL file "
                         "of {\"messages\": [...]} lines") from None
    convs = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            msgs = json.loads(line)["messages"]
            assert isinstance(msgs, list) and all(m["role"] in ("system", "user", "assistant")
                                                  and isinstance(m["content"], str) for m in msgs)
            assert len(msgs) >= 3 and msgs[0]["role"] == "system" and msgs[1]["role"] == "user"
        except (ValueError, KeyError, TypeError, AssertionError):
            raise SystemExit(f"{path}:{i}: expected a JSON object with \"messages\": [system, "
                             "user, assistant, ...] chat messages (role + content); fix or delete "
                             "that line") from None
        convs.append(msgs)
    return convs


# ----------------------------------------------------------------------------- the scratch model
def build_scratch(out, env, vocab_size=512, d_model=128, n_layers=4, n_heads=4, n_games=2000,
                  seed=0, max_len=2048, teacher=None):
    """Train a byte-level BPE tokenizer on scripted transcripts of `env` (its scripted_players, or
    the `teacher` function "module:function"), build a random-init Llama, save both."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    texts = [env.system_prompt]
    players = [ScriptedPolicy(env, name) for name in getattr(env, "scripted_players", ())]
    players += [FunctionPolicy(teacher)] if teacher and is_function_spec(teacher) else []
    if not players:
        raise SystemExit("--model scratch trains its tokenizer on a scripted player's games: this "
                         "environment has no scripted_players; give --teacher module:function "
                         "(conversation -> reply)")
    for i, policy in enumerate(players):
        for rec in rollout(env, env.examples(n_games // len(players), seed + i), policy, progress=False):
            texts += [m["content"] for m in rec["messages"][1:]]
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    # digits stand alone, so a number is the same tokens wherever it stands (after a space, a bar or
    # a tag): copying a number from the prompt to the reply is then an identity map
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special + ["system", "user", "assistant"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>",
                                        additional_special_tokens=special[1:2])
    tokenizer.chat_template = CHATML
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=d_model, intermediate_size=4 * d_model,
        num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_heads,
        max_position_embeddings=max_len, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    model = LlamaForCausalLM(config)  # its generation config takes eos and pad from `config`
    samples_when_served(model)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"scratch model: {n / 1e6:.2f}M parameters, vocab {len(tokenizer)}, saved to {out}")
    return out


# ----------------------------------------------------------------------------- the SFT loss
def sft_loss(scorer, rows, context_loss, pad_id):
    """Summed next-token loss of right-padded (ids, mask) rows: weight 1 on replies (mask 1),
    `context_loss` on other real tokens, 0 on padding. Returns (loss tensor, reply nll, context nll,
    context tokens), the last three as numbers. scorer: the model's common.Scorer."""
    ids, mask = pad_batch(([r[0] for r in rows], [r[1] for r in rows]), pad_id, scorer.model.device)
    real = (torch.arange(ids.shape[1], device=ids.device)[None]
            < torch.tensor([len(r[0]) for r in rows], device=ids.device)[:, None])  # (B, T) as ids
    w = mask + context_loss * (1 - mask) * real  # (B, T)
    logp = scorer(ids, w, 1.0)[0]  # (N,): every token with a weight
    keep = w[:, 1:] > 0  # (B, T-1): the positions token_logprobs scored
    w, reply = w[:, 1:][keep], mask[:, 1:][keep].bool()  # (N,), (N,)
    loss = -(logp * w).sum()
    return loss, -logp[reply].sum().item(), -logp[~reply].sum().item(), int((~reply).sum())


# ----------------------------------------------------------------------------- main
def model_path(args, env, rank, resume):
    """The model to train: the run's own checkpoint on --resume, --model, or a scratch model that
    rank 0 builds in DIR_init (under torchrun the others then load what it saved)."""
    if resume:
        return args.out
    if args.model != "scratch":
        return args.model
    if rank == 0:
        build_scratch(args.out + "_init", env, args.vocab_size, args.d_model, args.n_layers,
                      args.n_heads, seed=args.seed, teacher=args.teacher)
    wait_for_rank0(f"scratch model in {args.out}_init")
    return args.out + "_init"


def training_data(args, env, chat, rank, resume, user_data):
    """[(ids, mask)] to train on: --data's conversations or the teacher's kept games, written to
    DIR/data.jsonl (under torchrun rank 0 plays them; others wait up to DIST_TIMEOUT, read it)."""
    data_path = os.path.join(args.out, "data.jsonl")
    if rank == 0 and not resume:
        convs = user_data if args.data else teacher_games(args, env)
        if not convs:
            raise SystemExit(f"no conversations left after filtering (--keep {args.keep}): play "
                             "more --n_games, use a stronger teacher, or loosen --keep (the played "
                             "games are in DIR/teacher_games.jsonl)")
        os.makedirs(args.out, exist_ok=True)
        with open(data_path, "w") as f:
            f.writelines(json.dumps({"messages": c}) + "\n" for c in convs)
    wait_for_rank0(f"teacher games in {data_path}")
    if rank or resume:
        convs = read_data(data_path)
    encoded = [chat.encode_conversation(c) for c in convs]
    dropped = sum(len(ids) > args.max_len for ids, _ in encoded)
    encoded = [e for e in encoded if len(e[0]) <= args.max_len]
    if not encoded:
        raise SystemExit(f"every conversation is longer than --max_len {args.max_len}")
    print(f"data: {len(encoded)} conversations, {sum(len(i) for i, _ in encoded)} tokens, "
          f"{sum(sum(m) for _, m in encoded)} trained on"
          + (f", {dropped} dropped as longer than --max_len" if dropped else ""))
    return encoded


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    # model and data
    add("--model", default="scratch", help="hub id, directory, or 'scratch' (build a small model)")
    add("--env", default="tictactoe", help="environment NAME (env_NAME.py)")
    add("--env_args", default="{}", help="JSON keyword arguments for load_environment()")
    add("--teacher", default=None, help="a scripted player (default: the environment's first), "
        "module:function (conversation -> reply), an API model with --api_base, or an HF model")
    add("--teacher_temp", type=float, default=1.0, help="sampling temperature (API/HF teachers)")
    add_api_args(p, "--teacher")
    add("--max_new_tokens", type=int, default=512, help="teacher's max tokens per turn")
    add("--n_games", type=int, default=12000, help="teacher games (scripted: free; API: ~200)")
    add("--keep", default=None, help="games to train on: all, reward>=X, or METRIC=VALUE,... (each "
        "metric equal to VALUE; a missing one passes); default: the environment's `keep`, else all")
    add("--data", default=None, help="train on a JSONL of {'messages': [...]}, not teacher games")
    # scratch model
    add("--vocab_size", type=int, default=512, help="scratch: BPE vocabulary size")
    add("--d_model", type=int, default=128, help="scratch: hidden size")
    add("--n_layers", type=int, default=4, help="scratch: transformer layers")
    add("--n_heads", type=int, default=4, help="scratch: attention heads")
    # optimization
    add("--epochs", type=float, default=1.0, help="passes over the data (when --max_steps is 0)")
    add("--max_steps", type=int, default=1000, help="optimizer steps (0: from --epochs)")
    add("--batch", type=int, default=8, help="conversations per optimizer step")
    add("--context_loss", type=float, default=None, help="loss weight on system and environment "
        "tokens (default: 0.3 for scratch, which must learn to read; else 0, the usual SFT)")
    add("--max_len", type=int, default=2048, help="drop conversations longer than this many tokens")
    add("--schedule", choices=["constant", "cosine"], default="cosine",
        help="lr schedule after warm-up (cosine: to 10%% of --lr)")
    add_train_args(p, lr=2e-3, warmup=10, token_budget=16384, out="out/sft", eval_every=500,
                   eval_n=50, save_every=500)
    args = p.parse_args(argv)
    check_flags(args, {
        **TRAIN_FLAG_RULES, "n_games": (at_least(1), ">= 1"), "batch": (at_least(1), ">= 1"),
        "max_steps": (at_least(0), ">= 0 (0: from --epochs)"),
        "epochs": (positive, "a finite number > 0"), "max_new_tokens": (at_least(1), ">= 1"),
        "max_len": (at_least(2), ">= 2"),
        "teacher_temp": (non_negative, "a finite number >= 0 (0: greedy)"),
        "concurrency": (at_least(1), ">= 1"),
        "keep": (lambda k: k is None or keep_rules(k) is not None,
                 "all, reward>=X or METRIC=VALUE,... (X and VALUE numbers)"),
        "vocab_size": (at_least(1), ">= 1"), "n_layers": (at_least(1), ">= 1"),
        "n_heads": (at_least(1), ">= 1"),
        "d_model": (lambda d: d >= 1 and d % max(args.n_heads, 1) == 0,
                    f"a positive multiple of --n_heads {args.n_heads}"),
        "context_loss": (lambda x: x is None or non_negative(x), "a finite number >= 0")})
    if args.context_loss is None:
        args.context_loss = 0.3 if args.model == "scratch" else 0.0
    return args


def main():
    run_training(parse_args, train)  # SIGTERM, Ctrl-C: the step in flight ends, is saved, then exit


def train(args, preempt):
    t_start = time.time()
    rank, world, device = start_run(args)  # under torchrun, rank 0 alone prints and writes files
    env = load_env(args.env, args.env_args)
    # the environment's defaults: its first scripted player teaches, its `keep` rules pick the games
    args.teacher = args.teacher or next(iter(getattr(env, "scripted_players", ())), None)
    if args.keep is None:  # a --keep given is checked with the other flags
        args.keep = getattr(env, "keep", "all")
        if keep_rules(args.keep) is None:
            raise SystemExit(f"{args.env}'s keep {args.keep!r}: must be all, reward>=X or "
                             "METRIC=VALUE,... (give --keep)")
    if args.teacher is None and not args.data:
        raise SystemExit(f"--teacher: {args.env} has no scripted_players; name a teacher (a "
                         "function module:function, an API model with --api_base, or an HF model) "
                         "or give --data")
    resume = checkpoint_to_resume(args, rank)
    # a --data file is read first: a bad line stops the run before a model is built or loaded
    user_data = read_data(args.data) if args.data and rank == 0 and not resume else None
    # the model is loaded before any game is played or any file written, so a bad --model costs and
    # loses nothing (an HF teacher then plays while the student is in memory)
    # (--fsdp: loaded on the CPU, then sharded over the ranks' devices)
    model, tokenizer = load_model(model_path(args, env, rank, resume),
                                  "cpu" if args.fsdp else device, train=True)
    chat = ChatTokens(tokenizer, env.system_prompt, getattr(env, "tools", None))
    encoded = training_data(args, env, chat, rank, resume, user_data)
    scorer = scorer_to_train(model, args, device)

    # ---- optimizer
    steps_per_epoch = max(1, len(encoded) // args.batch)
    total = args.max_steps if args.max_steps > 0 else max(1, round(args.epochs * steps_per_epoch))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    step = start_or_resume(args, opt, resume, rank)["step"]

    def batch_indices(step):
        """The step alone fixes the data (for exact resume): epoch e is shuffled by (seed, e)."""
        epoch, k = divmod(step, steps_per_epoch)
        perm = list(range(len(encoded)))
        random.Random(args.seed * 1000 + epoch).shuffle(perm)
        return perm[k * args.batch:(k + 1) * args.batch]

    if resume and step >= total:  # final eval and save done: running them again would repeat rows
        print(f"--resume: {args.out} holds the final checkpoint (step {step} of {total}): nothing to do")
        return stop_ranks()

    # ---- loop
    log = RunLog(args, rank)
    results, eval_envs = {}, {}

    def run_eval():  # every rank calls it, rank 0 evaluates
        model.eval()
        policy = HFPolicy(model, tokenizer, env.system_prompt, temp=0.0, max_new_tokens=64,
                          tools=getattr(env, "tools", None))
        with gathered(scorer):
            if rank == 0:
                evals = evaluate_standard(args.env, parse_env_args(args.env_args), policy,
                                          args.eval_n, envs=eval_envs)
                results.update({name: s for name, (s, _) in evals.items()})
                log.evals(step, evals)
        model.train()

    def save():
        save_run(model, tokenizer, args.out, rank, {"step": step},
                 {"sft_args.json": vars(args), "sft_results.json": {
                     "step": step, "eval": results, "wall_s": time.time() - t_start}}, opt)

    model.train()
    amp, bad_steps = train_autocast(device), 0
    while step < total:
        t0 = time.time()
        opt.param_groups[0]["lr"] = lr = lr_at(step, args.lr, args.warmup, total, args.schedule)
        idx = batch_indices(step)
        n_loss_tokens = sum(sum(encoded[i][1]) for i in idx)  # full batch: each rank divides by it
        idx = idx[rank::world]  # under torchrun: this rank's conversations of the batch
        loss_sum, ctx_sum, n_ctx, n_tok = 0.0, 0.0, 0, 0
        mbs = token_microbatches([len(encoded[i][0]) for i in idx], args.token_budget)
        behind = passes_behind(scorer, len(mbs))  # --fsdp: empty passes to run, as other ranks'
        for mb in mbs:
            with amp:
                loss, reply_nll, ctx_nll, ctx_n = sft_loss(scorer, [encoded[idx[j]] for j in mb],
                                                           args.context_loss, chat.eot_id)
            (loss / n_loss_tokens).backward()
            loss_sum, ctx_sum, n_ctx = (loss_sum + reply_nll / n_loss_tokens, ctx_sum + ctx_nll,
                                        n_ctx + ctx_n)
            n_tok += len(mb) * max(len(encoded[idx[j]][0]) for j in mb)
        empty_passes(scorer, behind, amp)
        loss_sum, gnorm, stepped = optimizer_step(model, opt, loss_sum)  # over the ranks' batch
        ctx_sum, n_ctx, n_tok = sum_over_ranks([ctx_sum, n_ctx, n_tok])
        step, bad_steps = step + 1, 0 if stepped else bad_steps + 1
        dt = time.time() - t0
        ctx = {"context_loss": ctx_sum / n_ctx} if n_ctx else {}
        log(step, {"loss": loss_sum, **ctx, "lr": lr, "grad_norm": gnorm,
                   "tokens_per_s": n_tok / dt, "step_time": dt})
        end_of_step(step, total, args, preempt, rank, run_eval, save, bad_steps)

    # ---- final eval and save
    run_eval()
    save()
    print(f"done in {time.time() - t_start:.0f}s: model saved to {args.out}")
    log.close()
    stop_ranks()


if __name__ == "__main__":
    main()
