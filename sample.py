"""
Batched multi-turn rollouts with exact token trajectories: the engine eval.py, sft.py and rl.py use.

    python sample.py --model out/rl --env tictactoe -n 4          # watch a model play (GPU or CPU)
    python sample.py --model minimax --env tictactoe -n 2         # the scripted players: minimax, random
    python sample.py --model gpt-5-mini --api_base https://api.openai.com/v1 -n 2   # any OpenAI-compatible API
    python sample.py --model out/rl --play                        # play against the model yourself

A policy maps a batch of unfinished episodes to one reply each. Three kinds share that interface:
  HFPolicy       a Hugging Face causal LM; all unfinished episodes go through ONE generate() call per turn.
                 It keeps each episode's exact token trajectory: `ids` (prompt, every sampled reply with its
                 end-of-turn token, every environment message), `mask` (1 exactly on sampled tokens) and
                 `logprobs` (of the sampled tokens under the sampling temperature, 0 elsewhere). Later
                 environment messages are appended as the tokens the chat template puts between an assistant
                 turn and the next generation prompt; the conversation is never re-rendered, so templates
                 that rewrite past turns (Qwen3 drops earlier <think> blocks) cannot make ids drift. Each
                 episode also keeps the KV cache of what was already encoded, so a turn encodes only the new
                 environment message, not the whole conversation again (plain full-attention caches only).
  APIPolicy      an OpenAI-compatible endpoint, concurrent requests, retries with backoff.
  ScriptedPolicy the environment's own scripted players (tic-tac-toe: random, minimax).
"""
import argparse
import concurrent.futures
import json
import os
import random
import threading
import time

import torch
from tqdm import tqdm

from common import load_env, load_model, plain_cache_layers, roomy_cache

# ----------------------------------------------------------------------------- environments


def total_reward(env, rewards):
    return sum(env.reward_weights.get(k, 1.0) * v for k, v in rewards.items())


# ----------------------------------------------------------------------------- models and tokenizers


class ChatTokens:
    """The token pieces of a chat template that a multi-turn rollout needs, found once by rendering a probe.

    Rendering [system, user, assistant=SENTINEL, user=X] + generation prompt, the text after SENTINEL is
    `<end-of-turn>` + (user turn X + generation prompt). The first token of that text is the end-of-turn
    token the model must sample to stop; the rest, for a real message X, is what we append after it."""
    SENTINEL = "\u2063S3NT1N3L\u2063"

    def __init__(self, tokenizer, system_prompt):
        self.tokenizer, self.system = tokenizer, system_prompt
        probe = self.after_sentinel("X")
        ids = tokenizer(probe, add_special_tokens=False).input_ids
        self.eot_id = ids[0]
        self.stop_ids = sorted({self.eot_id} | set(_as_list(tokenizer.eos_token_id)))

    def render(self, messages, **kw):
        return self.tokenizer.apply_chat_template(messages, tokenize=False, **kw)

    def after_sentinel(self, user_message):
        msgs = [{"role": "system", "content": self.system}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": self.SENTINEL}, {"role": "user", "content": user_message}]
        text = self.render(msgs, add_generation_prompt=True)
        if self.SENTINEL not in text:
            raise SystemExit("the chat template drops assistant messages; cannot build multi-turn trajectories")
        return text[text.index(self.SENTINEL) + len(self.SENTINEL):]

    def prompt_ids(self, messages):
        """Token ids of the first turn: the template's own rendering + generation prompt."""
        return self.tokenizer(self.render(messages, add_generation_prompt=True), add_special_tokens=False).input_ids

    def user_turn_ids(self, user_message):
        """Tokens after the end-of-turn token up to the next generation prompt, for a new user message."""
        ids = self.tokenizer(self.after_sentinel(user_message), add_special_tokens=False).input_ids
        assert ids[0] == self.eot_id, "chat template: end-of-turn token is not where expected"
        return ids[1:]


    def encode_conversation(self, messages):
        """(ids, mask) of a finished conversation laid out exactly as a rollout lays it out: the first prompt,
        then each assistant reply + end-of-turn (mask 1), then each later user message's turn tokens (mask 0)."""
        ids = self.prompt_ids(messages[:2])
        mask = [0] * len(ids)
        for m in messages[2:]:
            new = (self.tokenizer(m["content"], add_special_tokens=False).input_ids + [self.eot_id]
                   if m["role"] == "assistant" else self.user_turn_ids(m["content"]))
            ids += new
            mask += [int(m["role"] == "assistant")] * len(new)
        return ids, mask


def _as_list(x):
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


class _RecordLogprobs:
    """Logits processor that keeps the logprob of each sampled token under softmax(logits / temp).

    generate() applies it before its own temperature/top-p warpers, so it sees the model's logits. At each
    step it gathers the token chosen at the previous step: memory stays (B, V) instead of (B, T, V)."""

    def __init__(self, temp):
        self.temp, self.prev, self.out = (temp if temp > 0 else 1.0), None, []

    def __call__(self, input_ids, scores):
        self.collect(input_ids[:, -1])
        self.prev = torch.log_softmax(scores.float() / self.temp, dim=-1)  # (B, V)
        return scores

    def collect(self, tokens):
        if self.prev is not None:
            self.out.append(self.prev.gather(1, tokens[:, None]).squeeze(1))  # (B,)
            self.prev = None


# ----------------------------------------------------------------------------- policies


class HFPolicy:
    def __init__(self, model, tokenizer, system_prompt, temp=1.0, top_p=1.0, max_new_tokens=128, batch_size=256,
                 reuse_cache=True, min_new_tokens=0):
        self.model, self.tokenizer = model, tokenizer
        self.chat = ChatTokens(tokenizer, system_prompt)
        self.temp, self.top_p, self.max_new_tokens, self.batch_size = temp, top_p, max_new_tokens, batch_size
        self.min_new_tokens = min_new_tokens  # end-of-turn suppressed before this many tokens (bench.py's fixed replies)
        self.reuse_cache = reuse_cache  # switched off by the first cache that is not plain full attention
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.chat.eot_id
        self.gen_tokens = 0  # sampled tokens, for throughput
        # on a GPU, sample under bf16 autocast, as the model trains (a model being trained keeps fp32 weights,
        # load_model), and keep the KV cache in bf16: fp32 keys doubled it, and a 1.7B model at batch 256 ran out
        # of an H100's memory in its rollout
        self.autocast = model.device.type == "cuda"

    def __call__(self, episodes):
        for ep in episodes:  # bring each trajectory up to the generation prompt of this turn
            if "ids" not in ep:
                ids = self.chat.prompt_ids(ep["messages"])
                ep.update(ids=ids, mask=[0] * len(ids), logprobs=[0.0] * len(ids))
            else:
                new = self.chat.user_turn_ids(ep["messages"][-1]["content"])
                ep["ids"] += new
                ep["mask"] += [0] * len(new)
                ep["logprobs"] += [0.0] * len(new)
        replies = []
        for i in range(0, len(episodes), self.batch_size):
            replies += self._generate(episodes[i:i + self.batch_size])
        return replies

    @torch.no_grad()
    def _generate(self, episodes):
        """One generate() call for a batch of trajectories, each continued from its own KV cache.

        Re-encoding the whole conversation every turn (system prompt and all earlier turns) costs more than the
        reply itself on a CPU, so each episode keeps the keys/values of the tokens already encoded (`kv`, the
        first `kv_len` ids). A batch lays each row out as [pad | cached ids][pad | new ids]: the cached part
        right-aligned at column `cached`, the new tokens right-aligned at the end, the pads masked. generate() then
        encodes only the new columns; positions come from the attention mask, so the holes change nothing."""
        device = self.model.device
        kv_lens = [ep.get("kv_len", 0) if self.reuse_cache else 0 for ep in episodes]
        cached = max(kv_lens)  # columns of the cached part
        width = cached + max(len(ep["ids"]) - kv_len for ep, kv_len in zip(episodes, kv_lens))
        input_ids = torch.full((len(episodes), width), self.pad_id, dtype=torch.long)  # (B, T)
        attention = torch.zeros((len(episodes), width), dtype=torch.long)
        for b, (ep, kv_len) in enumerate(zip(episodes, kv_lens)):
            new = ep["ids"][kv_len:]
            input_ids[b, cached - kv_len:cached] = torch.tensor(ep["ids"][:kv_len], dtype=torch.long)
            input_ids[b, width - len(new):] = torch.tensor(new)
            attention[b, cached - kv_len:cached], attention[b, width - len(new):] = 1, 1
        cache = None
        if cached:  # (B, H, cached, D) per layer: each episode's keys/values right-aligned, zeros where masked
            donor = next(ep["kv"] for ep, kv_len in zip(episodes, kv_lens) if kv_len)
            cache = roomy_cache(len(donor), capacity=width + self.max_new_tokens)
            for layer, (ref, _) in enumerate(donor):
                keys = ref.new_zeros((len(episodes), ref.shape[0], cached, ref.shape[2]))
                values = keys.clone()
                for b, (ep, kv_len) in enumerate(zip(episodes, kv_lens)):
                    if kv_len:
                        keys[b, :, cached - kv_len:], values[b, :, cached - kv_len:] = ep["kv"][layer]
                        ep["kv"][layer] = None  # in the batch's cache now: do not hold it twice
                cache.update(keys, values, layer)
        record = _RecordLogprobs(self.temp)
        sampling = dict(do_sample=True, temperature=self.temp, top_p=self.top_p, top_k=0) if self.temp > 0 else dict(do_sample=False)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = self.model.generate(
                input_ids=input_ids.to(device), attention_mask=attention.to(device), past_key_values=cache,
                max_new_tokens=self.max_new_tokens, eos_token_id=self.chat.stop_ids, pad_token_id=self.pad_id,
                logits_processor=[record], return_dict_in_generate=True, min_new_tokens=self.min_new_tokens, **sampling)
        new = out.sequences[:, width:].cpu()  # (B, L)
        record.collect(out.sequences[:, -1])
        logprobs = torch.stack(record.out, 1).cpu() if record.out else torch.zeros_like(new, dtype=torch.float)  # (B, L)
        kept = self._cache_layers(out.past_key_values)
        encoded = kept[0][0].shape[2] if kept else 0  # columns in the cache: the last sampled token never went in
        replies, cols = [], []
        for b, ep in enumerate(episodes):
            toks, lps = new[b].tolist(), logprobs[b].tolist()
            stop = next((i for i, t in enumerate(toks) if t in self.chat.stop_ids), None)
            toks, lps = (toks[:stop + 1], lps[:stop + 1]) if stop is not None else (toks, lps)
            if kept:  # this episode's encoded tokens: its unmasked input columns + its reply, as far as encoded
                c = torch.cat([attention[b].nonzero().squeeze(1), width + torch.arange(len(toks))])
                cols.append(c[c < encoded].to(device))
            self.gen_tokens += len(toks)
            ep["ids"] += toks
            ep["mask"] += [1] * len(toks)
            ep["logprobs"] += lps
            if not toks or toks[-1] != self.chat.eot_id:  # cut off (or another eos): close the turn, not trained on
                ep["ids"].append(self.chat.eot_id)
                ep["mask"].append(0)
                ep["logprobs"].append(0.0)
            ep["truncated"] = ep.get("truncated", 0) + (stop is None)
            replies.append(self.tokenizer.decode(toks[:stop] if stop is not None else toks, skip_special_tokens=True))
        if kept:  # each episode's own cache, in bf16 under autocast (the keys of fp32 weights come out in fp32)
            dt = torch.bfloat16 if self.autocast else self.model.dtype
            for ep, c in zip(episodes, cols):
                ep["kv"], ep["kv_len"] = [], len(c)
            for layer in range(len(kept)):  # layer by layer, each freed once copied: never two copies of it all
                keys, values = kept[layer]
                for b, (ep, c) in enumerate(zip(episodes, cols)):
                    ep["kv"].append((keys[b][:, c].to(dt), values[b][:, c].to(dt)))
                kept[layer] = out.past_key_values.layers[layer] = keys = values = None
        return replies

    def _cache_layers(self, cache):
        """plain_cache_layers(cache) while reuse is on; the first cache that cannot be continued switches to
        re-encoding from then on."""
        kept = plain_cache_layers(cache) if self.reuse_cache else None
        self.reuse_cache = kept is not None
        return kept


class APIPolicy:
    """Chat completions from an OpenAI-compatible server; the key comes from the variable named by key_env."""
    RETRYABLE_STATUS = {408, 409, 429, 500, 502, 503, 504}

    def __init__(self, model, api_base, key_env="OPENAI_API_KEY", temp=1.0, max_new_tokens=1024,
                 concurrency=16, retries=6, timeout=120.0, backoff=1.0):
        import openai
        self.openai, self.model, self.temp, self.max_new_tokens = openai, model, temp, max_new_tokens
        self.client = openai.OpenAI(base_url=api_base, api_key=os.environ.get(key_env) or "EMPTY",
                                    max_retries=0, timeout=timeout)
        self.api_base, self.concurrency, self.retries, self.backoff = api_base, concurrency, retries, backoff
        self.gen_tokens, self.lock = 0, threading.Lock()

    def __call__(self, episodes):
        with concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(lambda ep: self._one(ep["messages"]), episodes))

    def _one(self, messages):
        for attempt in range(self.retries + 1):
            try:
                resp = self.client.chat.completions.create(model=self.model, messages=messages, temperature=self.temp,
                                                           max_tokens=self.max_new_tokens)
                with self.lock:
                    self.gen_tokens += getattr(resp.usage, "completion_tokens", 0) or 0
                return resp.choices[0].message.content or ""
            except (self.openai.APITimeoutError, self.openai.APIConnectionError, self.openai.APIStatusError) as e:
                status = getattr(e, "status_code", None)
                if status is not None and status not in self.RETRYABLE_STATUS:
                    raise RuntimeError(f"API error {status} from {self.api_base} for model {self.model!r}: {e}. "
                                       "Check --model, --api_base and the key in --api_key_env.") from e
                if attempt == self.retries:
                    raise RuntimeError(f"API at {self.api_base} still failing after {self.retries + 1} attempts "
                                       f"({type(e).__name__}: {e}). Is the server up? Retry later or raise --retries; "
                                       "finished rollouts are kept (eval.py --resume continues).") from e
                time.sleep(min(self.backoff * 2 ** attempt, 30.0) * (0.5 + random.random()))


class ScriptedPolicy:
    def __init__(self, env, name, random_move_prob=0.0):
        self.player, self.gen_tokens = env.scripted_player(name, random_move_prob), 0

    def __call__(self, episodes):
        return [self.player(ep["state"]) for ep in episodes]


def make_policy(model, env, device="auto", temp=1.0, top_p=1.0, max_new_tokens=128, batch_size=256,
                api_base=None, api_key_env="OPENAI_API_KEY", concurrency=16, random_move_prob=0.0):
    """A policy from a --model string: a scripted player name, an API model (with api_base), or an HF model."""
    if model in ("random", "minimax", "oracle"):
        return ScriptedPolicy(env, model, random_move_prob)
    if api_base:
        return APIPolicy(model, api_base, api_key_env, temp, max_new_tokens, concurrency)
    lm, tokenizer = load_model(model, device)
    return HFPolicy(lm, tokenizer, env.system_prompt, temp, top_p, max_new_tokens, batch_size)


# ----------------------------------------------------------------------------- the rollout loop


def new_episode(env, example, index=0, rollout=0):
    state, first = env.reset(example)
    return {"example": example, "index": index, "rollout": rollout, "state": state,
            "messages": [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": first}]}


def advance(env, ep, reply):
    """Give one reply to the environment; True when the episode is over."""
    ep["messages"].append({"role": "assistant", "content": reply})
    msg = env.step(ep["state"], reply)
    if msg is not None:
        ep["messages"].append({"role": "user", "content": msg})
    return msg is None


def finish(env, ep):
    """The JSON-able rollout record of a finished episode."""
    rewards = env.rewards(ep["state"])
    ep.pop("kv", None)  # the policy's KV cache of this episode: free it now, not when the batch ends
    rec = {"index": ep["index"], "rollout": ep["rollout"], "example": ep["example"], "messages": ep["messages"],
           "rewards": rewards, "reward": total_reward(env, rewards),
           "metrics": env.metrics(ep["state"]) if hasattr(env, "metrics") else {}}
    if "ids" in ep:
        rec.update(ids=ep["ids"], mask=ep["mask"], logprobs=ep["logprobs"], truncated=ep.get("truncated", 0))
    return rec


def rollout(env, examples, policy, group=1, start_index=0, on_done=None, progress=True, skip=()):
    """Play every example `group` times; returns records ordered by (example, rollout).

    Each turn, ALL unfinished episodes go to the policy at once; finished ones leave the batch and are handed
    to on_done(record) immediately (eval.py writes them to disk as they finish). `skip` holds (index, rollout)
    pairs already done."""
    active = [new_episode(env, ex, start_index + i, r) for i, ex in enumerate(examples) for r in range(group)
              if (start_index + i, r) not in skip]
    done = []
    bar = tqdm(total=len(active), desc="episodes", unit="ep", disable=not progress, leave=False)
    for _ in range(env.max_turns):
        if not active:
            break
        replies = policy(active)
        still = []
        for ep, reply in zip(active, replies):
            if advance(env, ep, reply):
                done.append(finish(env, ep))
                if on_done:
                    on_done(done[-1])
                bar.update(1)
            else:
                still.append(ep)
        active = still
    assert not active, "environment did not end its episodes within max_turns"
    bar.close()
    return sorted(done, key=lambda r: (r["index"], r["rollout"]))


# ----------------------------------------------------------------------------- printing and playing


def show(rec, env=None):
    """A rollout as a person wants to read it."""
    lines = [f"=== example {rec['index']} rollout {rec['rollout']} | " + " | ".join(f"{k} {v:.2f}" for k, v in rec["rewards"].items())
             + f" | total {rec['reward']:.3f}"]
    for m in rec["messages"][1:]:
        tag = "model" if m["role"] == "assistant" else "env"
        lines.append(f"[{tag}] " + m["content"].replace("\n", "\n        "))
    if rec.get("metrics"):
        lines.append("metrics: " + ", ".join(f"{k}={v:g}" for k, v in rec["metrics"].items()))
    return "\n".join(lines)


def play_human(env_name, env_args, policy):
    """Terminal game: the model is X, you are O (a game environment whose load_environment takes an `opponent`)."""
    def ask(state):
        free = [i for i, c in enumerate(state["board"]) if c == "."]
        while True:
            text = input(f"your move (O), one of {free}: ").strip()
            if text.isdigit() and int(text) in free:
                return int(text)
            print("not a free cell, try again")
    env = load_env(env_name, env_args, defaults={"opponent": ask})  # passed where load_environment takes one
    if getattr(env, "opponent", None) is not ask:
        raise SystemExit(f"--play needs a game environment that takes an opponent (tictactoe), not {env_name!r}")
    try:
        _play_games(env, policy)
    except (EOFError, KeyboardInterrupt):
        print("\nbye")


def _play_games(env, policy):
    while True:
        ex = env.examples(1, seed=random.randrange(2**31))[0]
        ep = new_episode(env, ex)
        print("\n" + ep["messages"][1]["content"])
        while True:
            reply = policy([ep])[0]
            print(f"[model] {reply}")
            if advance(env, ep, reply):
                break
            print(ep["messages"][-1]["content"])
        print(env.describe(ep["state"]))
        if input("again? [Y/n] ").strip().lower().startswith("n"):
            return


# ----------------------------------------------------------------------------- CLI


def add_policy_args(p):
    """Flags shared by every script that plays episodes (sample.py, eval.py)."""
    p.add_argument("--model", default="out/sft", help="hub id or save_pretrained directory, an API model name with --api_base, or a scripted player (random, minimax)")
    p.add_argument("--env", default="tictactoe", help="environment NAME: imports env_NAME.py")
    p.add_argument("--env_args", default="{}", help="JSON keyword arguments for load_environment()")
    p.add_argument("--temp", type=float, default=1.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling threshold")
    p.add_argument("--max_new_tokens", type=int, default=128, help="max generated tokens per turn")
    p.add_argument("--batch_size", type=int, default=256, help="max episodes per generate() call (bounds memory)")
    p.add_argument("--seed", type=int, default=0, help="seed for examples and sampling")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument("--api_base", default=None, help="OpenAI-compatible base URL; --model is then the served model name")
    p.add_argument("--api_key_env", default="OPENAI_API_KEY", help="name of the environment variable holding the API key")
    p.add_argument("--concurrency", type=int, default=16, help="max concurrent API requests")
    p.add_argument("--random_move_prob", type=float, default=0.0, help="--model minimax only: its own random-move probability")
    return p


def policy_from_args(args, env, temp=None):
    return make_policy(args.model, env, args.device, args.temp if temp is None else temp, args.top_p, args.max_new_tokens,
                       args.batch_size, args.api_base, args.api_key_env, args.concurrency, args.random_move_prob)


def main():
    p = add_policy_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("-n", type=int, default=4, help="number of episodes to play and print")
    p.add_argument("--play", action="store_true", help="play tic-tac-toe against the model in the terminal")
    p.add_argument("--out", default=None, help="also write the rollout records (JSONL) to this file")
    args = p.parse_args()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    env = load_env(args.env, args.env_args)
    policy = policy_from_args(args, env)
    if args.play:
        return play_human(args.env, args.env_args, policy)
    records = rollout(env, env.examples(args.n, args.seed), policy)
    for rec in records:
        print(show(rec, env) + "\n")
    if args.out:
        with open(args.out, "w") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
