"""
Batched multi-turn rollouts with exact token trajectories: the rollout loop of eval.py, sft.py and
rl.py, and HFPolicy, a Hugging Face causal LM as a policy (policies.py has the others). Watch a
model play with `python eval.py --model out/rl --show 4 -n 4`.

A policy maps a batch of unfinished episodes to one reply each. HFPolicy keeps each episode's exact
token trajectory (ids, mask, logprobs: see Episode), appending environment messages as the chat
template's tokens between an assistant turn and the next generation prompt, never re-rendering, so
templates that rewrite past turns (Qwen3 drops earlier <think> blocks) cannot make ids drift.

Turns run on one of two engines (--engine): GenerateEngine below, Hugging Face generate(), the
reference to read; and engine.FastEngine, a KV cache row per episode for the whole game and a CUDA
graph per turn, which auto picks wherever it holds the model's layers. Both draw every token through
HFPolicy._sample: inverse-CDF with one uniform number per token, seeded by (seed, episode, rollout,
turn), so an episode's tokens do not depend on the engine, --gen_batch or the number of ranks.
"""

import contextlib
from typing import Any, TypedDict

import numpy as np
import torch
from tqdm import tqdm

import engine
from common import at_least_fp32


# ------------------------------------------------------------------------------- environments
def total_reward(env, rewards):
    return sum(env.reward_weights.get(k, 1.0) * v for k, v in rewards.items())


# ---------------------------------------------------------------------- models and tokenizers
class ChatTokens:
    """The token pieces of a chat template that a multi-turn rollout needs, found from a probe.

    Rendering [system, user, assistant=SENTINEL, user=X] + generation prompt, the text after
    SENTINEL is `<end-of-turn>` + (user turn X + generation prompt): its first token is the one the
    model must sample to stop; the rest, for a real message X, is what we append after it. A message
    in the tool role (a tool's result) goes in as such where the template renders it (ChatML; Qwen3
    puts it in a user turn as <tool_response>), else as a user message with the same content. An
    environment's `tools` (OpenAI function schemas) are offered as the template renders them."""
    SENTINEL = "\u2063S3NT1N3L\u2063"  # the probe's reply: a marker no real text contains

    def __init__(self, tokenizer, system_prompt, tools=None):
        self.tokenizer, self.system, self.tools = tokenizer, system_prompt, tools
        probe = self.after_sentinel({"role": "user", "content": "X"})
        self.eot_id = tokenizer(probe, add_special_tokens=False).input_ids[0]
        self.stop_ids = sorted({self.eot_id} | set(_as_list(tokenizer.eos_token_id)))
        try:
            self.tool_role = "X7Q" in self.after_sentinel({"role": "tool", "content": "X7Q"})
        except Exception:  # a template that raises on a role it does not know (Gemma 3's check)
            self.tool_role = False

    def render(self, messages, **kw):
        tools = {"tools": self.tools} if self.tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, **tools, **kw)

    def after_sentinel(self, messages):
        msgs = [{"role": "system", "content": self.system}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": self.SENTINEL}, *_as_messages(messages)]
        text = self.render(msgs, add_generation_prompt=True)
        if self.SENTINEL not in text:
            raise SystemExit("the chat template drops assistant messages; "
                             "cannot build multi-turn trajectories")
        return text[text.index(self.SENTINEL) + len(self.SENTINEL):]

    def prompt_ids(self, messages):
        """Token ids of the first turn: the template's own rendering + generation prompt."""
        text = self.render(messages, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def turn_ids(self, messages):
        """Tokens after end-of-turn up to the next generation prompt, for the environment's next
        message (a user message or a tool result) or messages (several tool results, one each)."""
        messages = [{"role": "user", "content": m["content"]} if m["role"] == "tool" and not self.tool_role
                    else m for m in _as_messages(messages)]
        ids = self.tokenizer(self.after_sentinel(messages), add_special_tokens=False).input_ids
        assert ids[0] == self.eot_id, "chat template: end-of-turn token is not where expected"
        return ids[1:]

    def reply_ids(self, text):
        """An assistant reply's tokens as SFT trains on them: its text's encoding + end-of-turn."""
        return self.tokenizer(text, add_special_tokens=False).input_ids + [self.eot_id]

    def encode_conversation(self, messages):
        """(ids, mask) of a finished conversation laid out exactly as a rollout lays it out: the
        first prompt, then each assistant reply + end-of-turn (mask 1), then the turn tokens of the
        environment's messages that follow it (mask 0)."""
        ids = self.prompt_ids(messages[:2])
        mask = [0] * len(ids)
        for i, m in enumerate(messages[2:], 2):
            if m["role"] == "assistant":
                new = self.reply_ids(m["content"])
            elif messages[i - 1]["role"] == "assistant":  # all the environment's messages since it
                new = self.turn_ids(_until_reply(messages[i:]))
            else:
                continue
            ids += new
            mask += [int(m["role"] == "assistant")] * len(new)
        return ids, mask


def _as_messages(messages):
    return [messages] if isinstance(messages, dict) else list(messages)


def trailing_messages(messages):
    """The environment's messages after the conversation's last assistant reply."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages) - 1)
    return messages[last + 1:]


def _until_reply(messages):
    return messages[:next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))]


def _as_list(x):
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


# ------------------------------------------------------------ a Hugging Face model as a policy
def pick_engine(name, model, **options):
    """The engine of HFPolicy's turns: "hf" (GenerateEngine), "fast" (engine.FastEngine) or "auto":
    the fast one, faster on a GPU and a CPU (bench.py), where it holds the model's layers."""
    if name not in ("auto", "hf", "fast"):
        raise ValueError(f"unknown engine {name!r}: auto, hf or fast")
    fits = engine.FastEngine.fits(model)
    if name == "fast" and not fits:
        layers = sorted(set(getattr(model.config, 'layer_types', None) or ['?']))
        raise SystemExit(f"--engine fast: the fast engine cannot hold this model's layers "
                         f"({layers}); use --engine hf or auto")
    if name == "hf" or not fits:
        return GenerateEngine(model)
    return engine.FastEngine(model, **options)


class HFPolicy:
    """A Hugging Face causal LM as a policy. Each turn brings every episode's token ids up to the
    generation prompt (the environment's message as the chat template's tokens, ChatTokens), has the
    engine sample the replies, and appends them to the trajectories (ids, mask, logprobs)."""

    def __init__(self, model, tokenizer, system_prompt, temp=1.0, top_p=1.0, max_new_tokens=128,
                 batch_size=256, min_new_tokens=0, seed=0, engine="auto", tools=None,
                 **engine_options):
        self.model, self.tokenizer, self.seed, self.batch_size = model, tokenizer, seed, batch_size
        self.chat = ChatTokens(tokenizer, system_prompt, tools)
        self.temp, self.top_p, self.max_new_tokens = temp, top_p, max_new_tokens
        self.min_new_tokens = min_new_tokens  # no end-of-turn before this many (bench.py's replies)
        self.pad_id = self.chat.eot_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
        self.gen_tokens = 0  # sampled tokens, for throughput
        self.engine = pick_engine(engine, model, **engine_options)

    def __call__(self, episodes):
        for ep in episodes:  # bring each trajectory up to the generation prompt of this turn
            new = self.chat.prompt_ids(ep["messages"]) if "ids" not in ep else \
                self.chat.turn_ids(trailing_messages(ep["messages"]))
            ep.setdefault("ids", []).extend(new)
            ep.setdefault("mask", []).extend([0] * len(new))
            ep.setdefault("logprobs", []).extend([0.0] * len(new))
        return [self._record(ep, toks, lps) for ep, (toks, lps) in zip(episodes, self.engine.turn(self, episodes))]

    def _record(self, ep, toks, lps):
        """Add a reply's tokens (its stop token too, if it stopped) to the trajectory; its text."""
        stopped = toks[-1] in self.chat.stop_ids
        self.gen_tokens += len(toks)
        # cut off (or another eos): an end-of-turn closes the turn, not trained on
        close = [] if toks[-1] == self.chat.eot_id else [self.chat.eot_id]
        ep["ids"] += toks + close
        ep["mask"] += [1] * len(toks) + [0] * len(close)
        ep["logprobs"] += lps + [0.0] * len(close)
        ep["truncated"] = ep.get("truncated", 0) + (not stopped)
        return self.tokenizer.decode(toks[:-1] if stopped else toks, skip_special_tokens=True)

    def drawer(self, episodes, device):
        """draw(logits (B, V)) -> tokens (B,): at its t-th call, token t of each episode's reply
        this turn (_sample with the row's seeded number, or the environment's forced token), kept
        with its logprob in draw.tokens and draw.logprobs. Both engines draw through it."""
        uniforms, forced = self._uniforms(episodes, device), self._forced(episodes, device)
        stop_ids = torch.tensor(self.chat.stop_ids, device=device)

        def draw(logits):
            t = len(draw.tokens)
            token, logprob = self._sample(logits, uniforms[:, t], t < self.min_new_tokens, stop_ids,
                                          None if forced is None else forced[:, t])
            draw.tokens.append(token)
            draw.logprobs.append(logprob)
            return token
        draw.tokens, draw.logprobs, draw.stop_ids = [], [], stop_ids
        return draw

    def sample_replies(self, logits, step, episodes):
        """[(tokens, logprobs)] of each episode's reply, sampled from the first logits (B, V), each
        token fed back through step(tokens (B,)) -> logits (B, V), the engine's decoding step."""
        device = logits.device
        draw = self.drawer(episodes, device)
        done = torch.zeros(len(episodes), dtype=torch.bool, device=device)
        check = 8 if device.type == "cuda" else 1  # done.all() is a host sync: on a GPU, every 8th
        for t in range(self.max_new_tokens):
            token = draw(logits)
            done |= torch.isin(token, draw.stop_ids)
            if t + 1 == self.max_new_tokens or (t % check == check - 1 and bool(done.all())):
                break
            logits = step(token)
        return self.replies(torch.stack(draw.tokens, 1), torch.stack(draw.logprobs, 1))

    def replies(self, tokens, logprobs):
        """[(tokens, logprobs)] per row of (B, L) tokens and logprobs, each cut after its stop."""
        tokens, logprobs = tokens.cpu(), logprobs.cpu()
        if self.temp and not torch.isfinite(logprobs).all():  # once a turn: per token would stall
            raise SystemExit("the model's logits are not finite (NaN or inf weights), so its "
                             "samples mean nothing (in RL: resume from the last checkpoint, "
                             "--resume, with a lower --lr)")
        stopped = torch.isin(tokens, torch.tensor(self.chat.stop_ids))  # (B, L)
        n = torch.where(stopped.any(1), stopped.int().argmax(1) + 1, tokens.shape[1]).tolist()
        return [(tokens[b, :n[b]].tolist(), logprobs[b, :n[b]].tolist()) for b in range(len(n))]

    def _uniforms(self, episodes, device):
        """(B, max_new_tokens) uniform numbers in [0, 1), one per token this turn may sample: row
        b's from a generator seeded by (seed, episode index, rollout, turn), whatever its batch."""
        if self.temp == 0:
            return torch.zeros((len(episodes), self.max_new_tokens), device=device)  # not used
        rows = [np.random.default_rng([self.seed, ep.get("index", 0), ep.get("rollout", 0),
                                       len(ep["messages"])]).random(self.max_new_tokens)
                for ep in episodes]
        return torch.tensor(np.stack(rows), dtype=torch.float32, device=device)

    def _forced(self, episodes, device):
        """(B, max_new_tokens) token ids of the replies the environment forces (ep["force"]), -1
        where the row samples: a forced reply is its text's encoding + end-of-turn. None when no row
        is forced (nearly every turn): the decoding loop then pays nothing for it."""
        if all(ep.get("force") is None for ep in episodes):
            return None
        forced = torch.full((len(episodes), self.max_new_tokens), -1, dtype=torch.long)
        for b, ep in enumerate(episodes):
            if ep.get("force") is not None:
                ids = self.chat.reply_ids(ep["force"])[:self.max_new_tokens]
                forced[b, :len(ids)] = torch.tensor(ids)
        return forced.to(device)

    def _sample(self, logits, uniform, suppress_stop, stop_ids, forced):
        """(token (B,), its logprob (B,)) from logits (B, V) and one uniform number per row (B,):
        the first token whose cumulative probability exceeds the number (inverse CDF), or the forced
        token (B,) where given and not -1. The logprob is the model's at the sampling temperature,
        before any top-p or end-of-turn suppression."""
        logp = torch.log_softmax(at_least_fp32(logits) / (self.temp or 1.0), dim=-1)  # (B, V)
        choose = logp.index_fill(1, stop_ids, float("-inf")) if suppress_stop else logp
        if self.temp == 0:
            token = choose.argmax(-1)
        else:
            probs = torch.softmax(choose, dim=-1)
            if self.top_p < 1.0:  # nucleus: the fewest most likely tokens with probability >= top_p
                sorted_probs, order = probs.sort(-1, descending=True)
                outside = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p
                probs = probs.scatter(1, order, sorted_probs.masked_fill(outside, 0.0))
            cdf = probs.cumsum(-1)  # (B, V)
            total = cdf[:, -1:].contiguous()  # (B, 1): 1 up to rounding
            # right=True: a zero-probability token is never the first past the number; a number that
            # rounds up to the total would fall past the end: take the last token with probability
            token = torch.searchsorted(cdf, uniform[:, None] * total, right=True)  # (B, 1)
            token = torch.where(token >= cdf.shape[1], torch.searchsorted(cdf, total), token).squeeze(1)
            token = token.clamp(max=cdf.shape[1] - 1)  # NaN (bad weights) sorts past the end too
        if forced is not None:
            token = torch.where(forced >= 0, forced, token)
        return token, logp.gather(1, token[:, None]).squeeze(1)


class GenerateEngine:
    """Turns through Hugging Face generate(), the reference engine: each turn a batch's left-padded
    trajectories go through generate() whole, and a logits processor draws each token as HFPolicy
    does (_sample), leaving generate() nothing to choose. Simple, exact, re-encoding every turn."""
    name = "hf"

    def __init__(self, model):
        self.model = model
        self.autocast = model.device.type == "cuda"  # as the fast engine: bf16 on a GPU, any dtype

    @torch.no_grad()
    def turn(self, policy, episodes):
        out = []
        for i in range(0, len(episodes), policy.batch_size):
            out += self._batch(policy, episodes[i:i + policy.batch_size])
        return out

    def _batch(self, policy, episodes):
        from transformers import GenerationConfig, LogitsProcessorList
        device, B = self.model.device, len(episodes)
        W = max(len(ep["ids"]) for ep in episodes)
        ids = torch.full((B, W), policy.pad_id, dtype=torch.long)  # (B, W), left-padded
        att = torch.zeros((B, W), dtype=torch.long)
        for b, ep in enumerate(episodes):
            ids[b, W - len(ep["ids"]):] = torch.tensor(ep["ids"])
            att[b, W - len(ep["ids"]):] = 1
        draw = policy.drawer(episodes, device)

        def choose(input_ids, scores):  # (B, V) fp32 logits -> -inf except at the drawn token
            return torch.full_like(scores, float("-inf")).scatter(1, draw(scores)[:, None], 0.0)
        # top_k at generate()'s default: else the saved model's top_k 0 (samples_when_served) is
        # merged in and warned about as if a user's flag were ignored; the draw decides every token
        config = GenerationConfig(max_new_tokens=policy.max_new_tokens, do_sample=False, top_k=50,
                                  eos_token_id=policy.chat.stop_ids, pad_token_id=policy.pad_id)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.autocast):
            # synced_gpus off: under --fsdp each rank generates alone, on the gathered weights
            self.model.generate(input_ids=ids.to(device), attention_mask=att.to(device),
                                generation_config=config, synced_gpus=False,
                                logits_processor=LogitsProcessorList([choose]))
        return policy.replies(torch.stack(draw.tokens, 1), torch.stack(draw.logprobs, 1))


# ---------------------------------------------------------------------------- the rollout loop
class Episode(TypedDict, total=False):
    """An episode as the rollout loop plays it (new_episode), and as its record when it is over
    (finish: without state, force and kv; with rewards, reward and metrics). The one declaration of
    its keys: policies, engines, environments' hooks and the trainers read these."""
    example: dict  # the environment's example row; its "seed" is the episode's
    index: int  # the episode's number in the run: draws are keyed by (seed, index, rollout, turn)
    rollout: int  # which of its example's rollouts
    state: Any  # the environment's own state (reset, step)
    messages: list  # the conversation so far: {"role", "content"} dicts, the system prompt first
    ids: list  # HF policies: every token id of the trajectory, as sampled (ChatTokens)
    mask: list  # 1 on the model's tokens (sampled or forced): the loss tokens, 0 elsewhere
    logprobs: list  # the sampler's logprob of each token, 0.0 where mask is 0
    truncated: int  # the replies cut off at max_new_tokens
    force: Any  # this turn's reply the environment plays in the policy's place (None: none)
    kv: Any  # the fast engine's KV-cache row, freed when the episode ends
    rewards: dict  # the record: the environment's named reward components,
    reward: float  # their weighted sum (total_reward),
    metrics: dict  # and its per-episode metrics


def new_episode(env, example, index=0, rollout=0) -> Episode:
    state, first = env.reset(example)
    return {"example": example, "index": index, "rollout": rollout, "state": state,
            "messages": [{"role": "system", "content": env.system_prompt},
                         {"role": "user", "content": first}]}


def advance(env, ep, reply):
    """Give one reply to the environment; True when the episode is over. It answers with a user
    message (a string), a tool-role message dict (a tool's result), a list of those, or None."""
    ep["messages"].append({"role": "assistant", "content": reply})
    msg = env.step(ep["state"], reply)
    if msg is not None:
        ep["messages"] += msg if isinstance(msg, list) else [msg if isinstance(msg, dict) else
                                                             {"role": "user", "content": msg}]
    return msg is None


def finish(env, ep) -> Episode:
    """The JSON-able rollout record of a finished episode."""
    rewards = env.rewards(ep["state"])
    ep.pop("kv", None)  # the episode's KV cache in the policy: free it now, not at the batch's end
    rec = {"index": ep["index"], "rollout": ep["rollout"], "example": ep["example"],
           "messages": ep["messages"], "rewards": rewards, "reward": total_reward(env, rewards),
           "metrics": env.metrics(ep["state"]) if hasattr(env, "metrics") else {}}
    if "ids" in ep:
        rec.update(ids=ep["ids"], mask=ep["mask"], logprobs=ep["logprobs"], truncated=ep.get("truncated", 0))
    return rec


def rollout(env, examples, policy, group=1, start_index=0, on_done=None, progress=True, skip=()):
    """Play every example `group` times in waves of policy.batch_size episodes (KV caches live until
    their episodes end: the wave bounds memory); records ordered by (example, rollout). Each turn a
    wave's unfinished episodes go to the policy at once, finished ones to on_done(record) (eval.py
    writes them as they finish); `skip`: (index, rollout) pairs already done. An environment's
    forced_reply(state, rollout) may play a reply in the policy's place (None: the policy's); its
    turn(), a context manager, wraps each turn's steps."""
    episodes = [new_episode(env, ex, start_index + i, r) for i, ex in enumerate(examples)
                for r in range(group) if (start_index + i, r) not in skip]
    wave, done = getattr(policy, "batch_size", None) or max(len(episodes), 1), []
    bar = tqdm(total=len(episodes), desc="episodes", unit="ep", disable=not progress, leave=False)
    for first in range(0, len(episodes), wave):
        active = episodes[first:first + wave]
        for _ in range(env.max_turns):
            if not active:
                break
            if hasattr(env, "forced_reply"):  # an environment's exploration, in the policy's place
                for ep in active:
                    ep["force"] = env.forced_reply(ep["state"], ep["rollout"])
            still, replies = [], policy(active)
            with getattr(env, "turn", contextlib.nullcontext)():  # guard.py: one limit for all
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


def rollout_metrics(records):
    """Means over rollout records of the reward, its components, the environment's metrics (counts
    n_X as mean_X, as eval.py names them) and reply lengths (runs of mask 1): tokens per reply, the
    longest, and the share of replies cut off at the limit."""
    n = len(records)
    out = {"reward": sum(r["reward"] for r in records) / n}
    out.update({f"reward_{k}": sum(r["rewards"][k] for r in records) / n for k in records[0]["rewards"]})
    out.update({f"mean_{k[2:]}" if k.startswith("n_") else k: sum(r["metrics"][k] for r in records) / n
                for k in records[0].get("metrics", {})})
    lengths = [len(run) for r in records for run in "".join(map(str, r["mask"])).split("0") if run]
    out.update(reply_len=sum(lengths) / max(len(lengths), 1), reply_len_max=max(lengths, default=0),
               truncated=sum(r.get("truncated", 0) for r in records) / max(len(lengths), 1))
    return out


# ------------------------------------------------------------------------------------ printing
def show(rec, env=None):
    """A rollout as a person wants to read it."""
    rewards = " | ".join(f"{k} {v:.2f}" for k, v in rec["rewards"].items())
    lines = [f"=== example {rec['index']} rollout {rec['rollout']} | {rewards} | total {rec['reward']:.3f}"]
    for m in rec["messages"][1:]:
        tag = {"assistant": "model", "tool": "tool"}.get(m["role"], "env")
        lines.append(f"[{tag}] " + m["content"].replace("\n", "\n        "))
    if rec.get("metrics"):
        lines.append("metrics: " + ", ".join(f"{k}={v:g}" for k, v in rec["metrics"].items()))
    return "\n".join(lines)
