"""
Batched multi-turn rollouts with exact token trajectories: the engine eval.py, sft.py and rl.py use.

    python sample.py --model out/rl --env tictactoe -n 4          # watch a model play (GPU or CPU)
    python sample.py --model minimax --env tictactoe -n 2         # the scripted players: minimax, random
    python sample.py --model gpt-5-mini --api_base https://api.openai.com/v1 -n 2   # any OpenAI-compatible API
    python sample.py --model out/rl --play                        # play against the model yourself

A policy maps a batch of unfinished episodes to one reply each. Three kinds share that interface:
  HFPolicy       a Hugging Face causal LM on a decoding loop of its own (the engine, below). It keeps each
                 episode's exact token trajectory: `ids` (prompt, every sampled reply with its end-of-turn token,
                 every environment message), `mask` (1 exactly on the model's tokens: sampled, or a reply the
                 environment forced, see `rollout`) and `logprobs` (of those tokens under the sampling temperature,
                 0 elsewhere). Later environment messages are appended as the tokens the chat template puts between
                 an assistant turn and the next generation prompt; the conversation is never re-rendered, so
                 templates that rewrite past turns (Qwen3 drops earlier <think> blocks) cannot make ids drift.
  APIPolicy      an OpenAI-compatible endpoint, concurrent requests, retries with backoff.
  ScriptedPolicy the environment's own scripted players (tic-tac-toe: random, minimax).

The engine, and why not generate(): a rollout batch keeps ONE preallocated KV cache (RowCache) in which each
episode has its own row for the whole game (a prompt shared by a group's rollouts is encoded once, its row copied
for each). A turn writes only each row's new tokens at that row's end (the environment's message) and decodes from
there; finished episodes leave at turn boundaries. A decoding step is one forward of the HF model and the sampling,
with fixed shapes for the whole turn and no host sync, so on a GPU it is captured as a CUDA graph once a turn
(`cuda_graphs`, on by default; bit for bit the eager step's tokens and logprobs on an H100, `docs/gpu_check.py
exact`): one launch per token. On an H100, one turn of 256 episodes x 64 tokens (Qwen3-0.6B shape) took 0.88 s
graphed, 2.04 s eager (with SDPA), 1.86 s through generate() with a static cache and 2.43 s with its dynamic cache
(docs/GPU.md).
generate() could not do this: it takes one cache per call with the rows left-padded to a common length, so
continuing a game meant re-stacking every episode's cache each turn (two copies of it at once), and it pays its
per-token Python and launch overhead at every step. Layers with a recurrent state keep it in the same row: LFM2's
short convolutions (each row's last inputs, placed before its new tokens), Qwen3.5's linear attention (that
convolution, and the gated delta rule's state, which padding and a finished row's decoding steps leave as it is).
`reuse_cache=False` re-encodes the conversation every turn through the model's own cache instead, on the same
decoding loop (the tests' reference, and the fallback for layers of other kinds).

Sampling is inverse-CDF with one uniform number per token, drawn from a generator seeded by (seed, episode number,
rollout, turn): an episode's tokens do not depend on which episodes share its batch, so --gen_batch, the order of
the batches, or splitting a step over several torchrun ranks change no rollout.
"""
import argparse
import concurrent.futures
import copy
import functools
import json
import os
import random
import sys
import threading
import time

import numpy as np
import torch
from tqdm import tqdm

from common import (TRAIN_FLAG_RULES, at_least, cache_kwarg, can_write, check_flags, load_env, load_model, non_negative,
                    returned_cache)

# ----------------------------------------------------------------------------- environments


def total_reward(env, rewards):
    return sum(env.reward_weights.get(k, 1.0) * v for k, v in rewards.items())


# ----------------------------------------------------------------------------- models and tokenizers


class ChatTokens:
    """The token pieces of a chat template that a multi-turn rollout needs, found once by rendering a probe.

    Rendering [system, user, assistant=SENTINEL, user=X] + generation prompt, the text after SENTINEL is
    `<end-of-turn>` + (user turn X + generation prompt). The first token of that text is the end-of-turn
    token the model must sample to stop; the rest, for a real message X, is what we append after it.
    An environment's message in the tool role (a tool's result) goes in the same way where the template renders a
    tool role (ChatML and Qwen3, which puts it in a user turn as <tool_response>); where the template refuses or
    drops it, it goes in as a user message with the same content."""
    SENTINEL = "\u2063S3NT1N3L\u2063"

    def __init__(self, tokenizer, system_prompt):
        self.tokenizer, self.system = tokenizer, system_prompt
        probe = self.after_sentinel({"role": "user", "content": "X"})
        ids = tokenizer(probe, add_special_tokens=False).input_ids
        self.eot_id = ids[0]
        self.stop_ids = sorted({self.eot_id} | set(_as_list(tokenizer.eos_token_id)))
        try:
            self.tool_role = "X7Q" in self.after_sentinel({"role": "tool", "content": "X7Q"})
        except Exception:  # a template that raises on roles it does not know (Gemma 3's alternation check)
            self.tool_role = False

    def render(self, messages, **kw):
        return self.tokenizer.apply_chat_template(messages, tokenize=False, **kw)

    def after_sentinel(self, message):
        msgs = [{"role": "system", "content": self.system}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": self.SENTINEL}, message]
        text = self.render(msgs, add_generation_prompt=True)
        if self.SENTINEL not in text:
            raise SystemExit("the chat template drops assistant messages; cannot build multi-turn trajectories")
        return text[text.index(self.SENTINEL) + len(self.SENTINEL):]

    def prompt_ids(self, messages):
        """Token ids of the first turn: the template's own rendering + generation prompt."""
        return self.tokenizer(self.render(messages, add_generation_prompt=True), add_special_tokens=False).input_ids

    def turn_ids(self, message):
        """Tokens after the end-of-turn token up to the next generation prompt, for the environment's next message
        (a user message, or a tool result)."""
        if message["role"] == "tool" and not self.tool_role:
            message = {"role": "user", "content": message["content"]}
        ids = self.tokenizer(self.after_sentinel(message), add_special_tokens=False).input_ids
        assert ids[0] == self.eot_id, "chat template: end-of-turn token is not where expected"
        return ids[1:]

    def reply_ids(self, text):
        """An assistant reply's tokens as SFT trains on them: the tokenizer's encoding of its text, + end-of-turn."""
        return self.tokenizer(text, add_special_tokens=False).input_ids + [self.eot_id]

    def encode_conversation(self, messages):
        """(ids, mask) of a finished conversation laid out exactly as a rollout lays it out: the first prompt,
        then each assistant reply + end-of-turn (mask 1), then each later user message's turn tokens (mask 0)."""
        ids = self.prompt_ids(messages[:2])
        mask = [0] * len(ids)
        for m in messages[2:]:
            new = self.reply_ids(m["content"]) if m["role"] == "assistant" else self.turn_ids(m)
            ids += new
            mask += [int(m["role"] == "assistant")] * len(new)
        return ids, mask


def _as_list(x):
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


# ----------------------------------------------------------------------------- the decoding engine


DELTA_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "conv1d", "A_log", "dt_bias", "norm", "out_proj",
               "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim", "activation")


def row_cache_fits(config, states):
    """True when every layer's state can live in a RowCache row: softmax attention over its own keys and values (full
    or in a sliding window), LFM2's short convolution or Qwen3.5's gated delta rule (`states`, state_modules), whose
    modules have the parts that _row_conv and _row_delta use."""
    types = getattr(config, "layer_types", None) or ["full_attention"]
    return (set(types) <= {"full_attention", "sliding_attention", "conv", "linear_attention"}
            and all(isinstance(getattr(m, "conv", None), torch.nn.Conv1d) and hasattr(m, "in_proj") and hasattr(m, "out_proj")
                    if t == "conv" else all(hasattr(m, part) for part in DELTA_PARTS) for t, m in states.values()))


def state_modules(model):
    """{layer index: (layer type, module)} of the layers that carry a state besides keys and values: LFM2's short
    convolutions ("conv") and Qwen3.5's linear attention ("linear_attention"); {} for plain attention models."""
    types = getattr(model.config, "layer_types", None) or []
    layers = model.get_decoder().layers
    attribute = {"conv": "conv", "linear_attention": "linear_attn"}
    return {i: (t, getattr(layers[i], attribute[t], None)) for i, t in enumerate(types) if t in attribute}


def sliding_window(config):
    """(window, only some layers): the sliding window of a model's attention, None if it has none; `only some
    layers` when the config's layer_types mix sliding and full attention (Gemma 3), whose masks are then given per
    layer type. Without layer_types a window applies to every layer (Mistral)."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is not None:
        return (window, True) if "sliding_attention" in types else (None, False)
    return window, False


class RowCache:
    """The KV cache of one rollout batch: row b holds episode b's keys and values at positions 0, 1, 2, ... for
    its whole game. A forward writes each row's new tokens at that row's own positions (`write`, (B, W)), so a
    turn appends at the row's end; at a turn boundary gather() drops the rows
    of finished episodes (and repeats the row of an episode copied mid-game: eval.certify branches its lines).
    The buffers are copied only when they grow (reserve) or lose or repeat rows (gather). Layers call update() as
    they call a transformers Cache's and attend the first `span` positions of every row, with a mask that shows
    each row its own. A short-convolution layer (LFM2, and the one in Qwen3.5's linear attention) keeps in `conv`
    each row's last kernel - 1 inputs (_row_conv), a linear-attention layer in `delta` its recurrent state
    (_row_delta)."""

    def __init__(self, dtype):
        self.dtype, self.capacity = dtype, 0
        self.keys, self.values = {}, {}  # layer -> (B, H, capacity, D); the last position takes padding's writes
        self.conv = {}  # layer -> (B, channels, kernel - 1): the row's last convolution inputs, oldest first
        self.delta = {}  # layer -> (B, heads, key dim, value dim): a linear-attention layer's recurrent state
        self.lengths = None  # (B,) tokens cached per row, on the model's device
        self.write, self.span = None, 0
        self.real = None  # (B, W) in a prefill: True on each row's new tokens (right-aligned); None when decoding
        # (B,) while decoding: False from a row's stop token on; a finished row keeps decoding with the others (fixed
        # shapes) but its convolution state must stay where its reply ended, as its keys and values do
        self.live = None

    def update(self, keys, values, layer, *args, **kwargs):  # (B, H, W, D) each
        B, H, W, D = keys.shape
        if layer not in self.keys:
            self.keys[layer], self.values[layer] = (keys.new_zeros((B, H, self.capacity, D), dtype=self.dtype) for _ in range(2))
        K, V = self.keys[layer][:B], self.values[layer][:B]
        rows = torch.arange(B, device=keys.device)[:, None]  # (B, 1) with write (B, W): one entry per token
        K[rows, :, self.write] = keys.transpose(1, 2).to(self.dtype)  # (B, W, H, D)
        V[rows, :, self.write] = values.transpose(1, 2).to(self.dtype)
        return K[:, :, :self.span], V[:, :, :self.span]

    def conv_state(self, layer, inputs, kernel):  # inputs (B, C, W) -> the rows' states (B, C, kernel - 1), zeros at first
        if layer not in self.conv:
            self.conv[layer] = inputs.new_zeros((inputs.shape[0], inputs.shape[1], kernel - 1))
        return self.conv[layer][:inputs.shape[0]]

    def delta_state(self, layer, like):  # like: a state (B, heads, key dim, value dim) -> the rows' states, zeros at first
        if layer not in self.delta:
            self.delta[layer] = torch.zeros_like(like)
        return self.delta[layer][:like.shape[0]]

    def snapshot(self):
        """What rewind() puts back: the row lengths, live rows and recurrent states (a warm-up decoding step moves
        them on)."""
        return (self.lengths.clone(), self.live.clone(),
                [{layer: state.clone() for layer, state in states.items()} for states in (self.conv, self.delta)])

    def rewind(self, saved):
        lengths, live, saved_states = saved
        self.lengths.copy_(lengths)
        self.live.copy_(live)
        for states, saved_ in zip((self.conv, self.delta), saved_states):
            for layer, state in saved_.items():
                states[layer].copy_(state)

    def gather(self, rows):
        """Row i of the next turn is row rows[i] of this one: one layer copied at a time."""
        buffers = [b for b in (self.keys, self.values, self.conv, self.delta) if b]
        if rows == list(range(len(rows))) or not buffers:
            return
        index = torch.tensor(rows, device=next(iter(buffers[0].values())).device)
        for buffers in buffers:
            for layer, buf in buffers.items():
                if len(rows) <= buf.shape[0]:
                    buf[:len(rows)] = buf[index]
                else:
                    buffers[layer] = buf[index]

    def reserve(self, rows, positions, room):
        """Room for `positions` per row (+ the padding slot) in the first `rows` rows; when it grows, `room` more."""
        if positions + 1 <= self.capacity:
            return
        old, self.capacity = self.capacity, positions + 1 + room
        for buffers in (self.keys, self.values):
            for layer, buf in buffers.items():  # one layer at a time: never two copies of the whole cache
                new = buf.new_zeros((rows, buf.shape[1], self.capacity, buf.shape[3]))
                new[:, :, :old - 1] = buf[:rows, :, :old - 1]
                buffers[layer] = new


@functools.cache
def _grouped_attention(decode_by_matmul):
    """Registers (once) and names an attention function for RowCache, each KV head's query heads stacked instead of
    copying the keys and values for every query head (transformers' SDPA path does that copy whenever a mask is
    given). SDPA with the row masks; with decode_by_matmul, a decoding step (one query per row) is instead two
    batched matrix products over the row's keys and values with fp32 scores: on a GPU, SDPA's kernel pads a KV
    head's few stacked queries to a tile of 64 and took half the decoding time (H100, Qwen3-0.6B shape, 256 rows);
    the products made a turn 8% faster. On a CPU they were no faster, and SDPA keeps its results as they were."""
    from transformers import AttentionInterface

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        B, Hq, W, D = query.shape  # key, value: (B, Hkv, span, D); mask: (B, 1, W, span), True where seen
        Hkv, span = key.shape[1], key.shape[2]
        G = Hq // Hkv
        if W == 1 and decode_by_matmul:
            q = query.to(key.dtype).reshape(B * Hkv, G, D)  # an fp32 q_norm weight leaves the queries in fp32
            scores = _scores(q, key.reshape(B * Hkv, span, D).transpose(1, 2)).view(B, Hkv, G, span)  # fp32
            scores = scores * (scaling if scaling is not None else D ** -0.5)
            probs = scores.masked_fill(~attention_mask, float("-inf")).softmax(-1).to(value.dtype)
            out = torch.bmm(probs.view(B * Hkv, G, span), value.reshape(B * Hkv, span, D))  # (B * Hkv, G, D)
            return out.view(B, 1, Hq, D), None  # (B, W, Hq, D)
        query = query.reshape(B, Hkv, G * W, D)
        mask = attention_mask[:, :, None].expand(B, 1, G, W, span).reshape(B, 1, G * W, span)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
        return out.reshape(B, Hq, W, D).transpose(1, 2).contiguous(), None  # (B, W, Hq, D)

    name = "rollout_rows_matmul" if decode_by_matmul else "rollout_rows"
    AttentionInterface.register(name, attention)
    return name


def _scores(q, k_t):
    """q @ k_t in fp32 (B, G, span): bf16 products accumulated and returned in fp32 on a GPU, without an fp32 copy
    of the keys (torch's bmm out_dtype; older torch: the copy)."""
    if q.dtype == torch.float32:
        return torch.bmm(q, k_t)
    try:
        return torch.bmm(q, k_t, out_dtype=torch.float32)
    except (TypeError, NotImplementedError):  # no out_dtype in this torch, or not on this device
        return torch.bmm(q.float(), k_t.float())


def _conv_window(cache, layer, inputs, kernel):
    """[state, new tokens] (B, C, kernel - 1 + W) of a short convolution's `inputs` (B, C, W) over a RowCache: each
    row's state, its last kernel - 1 inputs, right before that row's own new tokens. In a prefill they are
    right-aligned behind padding, so row b's p_b padding columns come first (copies of column 0, whose outputs are
    never used). The row's last kernel - 1 inputs become its state, but for a row that has finished its reply."""
    state = cache.conv_state(layer, inputs, kernel)  # (B, C, kernel - 1)
    seq = torch.cat([state, inputs], -1)  # (B, C, kernel - 1 + W)
    if cache.real is not None:  # a prefill
        pad = (~cache.real).sum(1, keepdim=True)  # (B, 1)
        t = torch.arange(seq.shape[-1], device=seq.device)  # column of the rearranged sequence
        source = torch.where(t >= pad + kernel - 1, t, torch.where(t >= pad, t - pad, 0))  # (B, kernel - 1 + W)
        seq = seq.gather(-1, source[:, None, :].expand(-1, seq.shape[1], -1))
        state.copy_(seq[:, :, -(kernel - 1):])  # in place: a CUDA graph of the decoding step keeps its buffers
    else:  # decoding: a finished row's state stays
        state.copy_(torch.where(cache.live[:, None, None], seq[:, :, -(kernel - 1):], state))
    return seq


def _row_conv(module, layer, hidden_states, attention_mask=None, **kwargs):
    """LFM2's short convolution (y = out_proj(C * conv(B * x))) over a RowCache: each row's state, its last kernel - 1
    inputs, goes right before that row's own new tokens (in a prefill they are right-aligned behind padding), and
    the row's last kernel - 1 inputs become its new state. The same arithmetic as transformers' Lfm2ShortConv."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    channels, kernel = module.conv.weight.shape[0], module.conv.weight.shape[-1]
    gate, c, x = module.in_proj(hidden_states).transpose(-1, -2).chunk(3, dim=-2)  # (B, C, W) each
    inputs = gate * x
    seq = _conv_window(cache, layer, inputs, kernel)  # (B, C, kernel - 1 + W)
    out = torch.nn.functional.conv1d(seq, module.conv.weight, module.conv.bias, groups=channels)  # (B, C, W)
    return module.out_proj((c * out).transpose(-1, -2).contiguous())


def _row_delta(module, layer, hidden_states, attention_mask=None, **kwargs):
    """Qwen3.5's linear attention (a short causal convolution, then the gated delta rule) over a RowCache: the
    convolution's state is placed as in _row_conv, and the recurrent state (B, heads, key dim, value dim) is the
    row's own. Padding in a prefill and a finished row's decoding steps leave the state as it was: there the decay
    is 1 (g = 0) and nothing is written (beta = 0). The same arithmetic as transformers' Qwen3_5GatedDeltaNet, with
    its kernels (its module's own: a hub kernel where transformers installed one)."""
    ops = sys.modules[type(module).__module__]
    cache = kwargs.get("cache", kwargs.get("past_key_values", kwargs.get("cache_params")))
    B, W, _ = hidden_states.shape
    mixed = module.in_proj_qkv(hidden_states).transpose(1, 2)  # (B, C, W)
    z = module.in_proj_z(hidden_states).reshape(B, W, -1, module.head_v_dim)
    beta = module.in_proj_b(hidden_states).sigmoid()  # (B, W, heads)
    g = -module.A_log.float().exp() * torch.nn.functional.softplus(module.in_proj_a(hidden_states).float() + module.dt_bias)
    channels, kernel = mixed.shape[1], module.conv1d.weight.shape[-1]
    seq = _conv_window(cache, layer, mixed, kernel)  # (B, C, kernel - 1 + W)
    keep = cache.real if cache.real is not None else cache.live[:, None]  # (B, W): tokens that move the state on
    mixed = torch.nn.functional.conv1d(seq.to(module.conv1d.weight.dtype), module.conv1d.weight, module.conv1d.bias, groups=channels)
    mixed = ops.ACT2FN[module.activation](mixed).to(hidden_states.dtype).transpose(1, 2)  # (B, W, C)
    query, key, value = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    value = value.reshape(B, W, -1, module.head_v_dim)
    # each query/key head serves num_v_heads / num_k_heads value heads (transformers 5.17 repeats them in the layer,
    # 5.24 in the kernel, which skips it when the counts are equal)
    repeat = module.num_v_heads // module.num_k_heads
    query, key = (x.reshape(B, W, -1, module.head_k_dim).repeat_interleave(repeat, dim=2) for x in (query, key))
    g, beta = g.masked_fill(~keep[..., None], 0.0), beta.masked_fill(~keep[..., None], 0.0)
    rule = ops.torch_recurrent_gated_delta_rule if W == 1 else ops.torch_chunk_gated_delta_rule
    state = cache.delta.get(layer)
    out, new_state = rule(query, key, value, g=g, beta=beta, initial_state=None if state is None else state[:B],
                          output_final_state=True, use_qk_l2norm_in_kernel=True)
    cache.delta_state(layer, new_state).copy_(new_state)  # in place: a CUDA graph of the decoding step keeps its buffers
    out = module.norm(out.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(out.reshape(B, W, -1))


class _RowLayers:
    """Within this context the model's attention layers use `implementation` (the config is read at every forward)
    and its layers with a recurrent state run _row_conv (LFM2) or _row_delta (Qwen3.5); with implementation None
    nothing changes."""

    def __init__(self, model, implementation, states):
        self.config, self.implementation = model.config, implementation
        self.states = states if implementation else {}

    def __enter__(self):
        self.saved = self.config._attn_implementation
        if self.implementation:
            self.config._attn_implementation = self.implementation
        for layer, (kind, module) in self.states.items():
            module.forward = functools.partial(_row_conv if kind == "conv" else _row_delta, module, layer)

    def __exit__(self, *exc):
        self.config._attn_implementation = self.saved
        for _, module in self.states.values():
            del module.forward  # the class's own forward again


# ----------------------------------------------------------------------------- policies


class NonFiniteLogits(RuntimeError):
    """The model's logits are NaN or inf (its weights are), so no reply can be sampled."""


class HFPolicy:
    """A Hugging Face causal LM as a policy, on its own decoding loop over the same model (see the module doc).

    Plain-attention models (Llama, Qwen3, Gemma 3, ...): each rollout batch of up to `batch_size` episodes keeps one
    RowCache for the whole game; a turn encodes only each row's new tokens (the previous reply's last token, the
    environment's message) and decodes from there, one forward and the sampling per token (on a GPU a CUDA graph of
    it, captured once a turn, unless cuda_graphs=False). LFM2 and Qwen3.5 too: their convolutions and linear
    attention keep their state in the rows. Other layer kinds re-encode the conversation every turn with the model's
    own cache (`reuse_cache` False does that for all)."""

    def __init__(self, model, tokenizer, system_prompt, temp=1.0, top_p=1.0, max_new_tokens=128, batch_size=256,
                 reuse_cache=True, min_new_tokens=0, seed=0, cuda_graphs=True, decode_by_matmul=None):
        self.model, self.tokenizer, self.seed = model, tokenizer, seed
        self.cache_kw = cache_kwarg(model)
        self.chat = ChatTokens(tokenizer, system_prompt)
        self.temp, self.top_p, self.max_new_tokens, self.batch_size = temp, top_p, max_new_tokens, batch_size
        self.min_new_tokens = min_new_tokens  # end-of-turn suppressed before this many tokens (bench.py's fixed replies)
        states = state_modules(model)
        self.reuse_cache = reuse_cache and row_cache_fits(model.config, states)
        self.states = states if self.reuse_cache else {}
        self.window, self.window_layers_only = sliding_window(model.config)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.chat.eot_id
        self.gen_tokens = 0  # sampled tokens, for throughput
        # on a GPU: sample under bf16 autocast, as the model trains (a trained model keeps fp32 weights, load_model),
        # and keep the KV cache in bf16
        self.autocast = model.device.type == "cuda"
        self.cuda_graphs = cuda_graphs and self.autocast
        self.decode_by_matmul = self.autocast if decode_by_matmul is None else decode_by_matmul  # _grouped_attention

    def __call__(self, episodes):
        for ep in episodes:  # bring each trajectory up to the generation prompt of this turn
            if "ids" not in ep:
                ids = self.chat.prompt_ids(ep["messages"])
                ep.update(ids=ids, mask=[0] * len(ids), logprobs=[0.0] * len(ids), kv_len=0)
            else:
                new = self.chat.turn_ids(ep["messages"][-1])
                ep["ids"] += new
                ep["mask"] += [0] * len(new)
                ep["logprobs"] += [0.0] * len(new)
        if self.reuse_cache:  # episodes go on in their rollout batch's cache; new ones start batches of batch_size
            groups = {}
            for ep in episodes:
                if "kv" in ep:
                    groups.setdefault(id(ep["kv"]), (ep["kv"], []))[1].append(ep)
            for cache, batch in groups.values():
                cache.gather([ep["kv_row"] for ep in batch])
            new = [ep for ep in episodes if "kv" not in ep]
            batches = list(groups.values()) + [(RowCache(torch.bfloat16 if self.autocast else self.model.dtype), new[i:i + self.batch_size])
                                               for i in range(0, len(new), self.batch_size)]
            for cache, batch in batches:
                for row, ep in enumerate(batch):
                    ep.update(kv=cache, kv_row=row)
        else:
            batches = [(None, episodes[i:i + self.batch_size]) for i in range(0, len(episodes), self.batch_size)]
        replies = {}
        for cache, batch in batches:
            replies.update(zip(map(id, batch), self._turn(batch, cache)))
        return [replies[id(ep)] for ep in episodes]

    @torch.no_grad()
    def _turn(self, episodes, cache):
        """One turn of a batch: encode what is new, sample every reply, append them to the trajectories."""
        device = self.model.device
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.autocast), \
                _RowLayers(self.model, _grouped_attention(self.decode_by_matmul) if cache else None, self.states):
            logits, step = self._continue(episodes, cache) if cache else self._reencode(episodes)
            if self.cuda_graphs and cache:
                step = self._graphed(step, cache)
            tokens, logprobs, n_sampled = self._sample_replies(logits, step, self._uniforms(episodes, device),
                                                               self._forced(episodes, device))
        tokens, logprobs, n_sampled = tokens.cpu(), logprobs.cpu(), n_sampled.tolist()
        if self.temp and not torch.isfinite(logprobs).all():  # checked once a turn: a check per token would stall the GPU
            raise NonFiniteLogits("the model's logits are not finite (NaN or inf weights), so its samples mean nothing")
        replies = []
        for b, ep in enumerate(episodes):
            toks, lps = tokens[b, :n_sampled[b]].tolist(), logprobs[b, :n_sampled[b]].tolist()
            stopped = toks[-1] in self.chat.stop_ids
            if cache:  # every sampled token but the last went into the cache
                ep["kv_len"] = len(ep["ids"]) + len(toks) - 1
            self.gen_tokens += len(toks)
            ep["ids"] += toks
            ep["mask"] += [1] * len(toks)
            ep["logprobs"] += lps
            if toks[-1] != self.chat.eot_id:  # cut off (or another eos): close the turn, not trained on
                ep["ids"].append(self.chat.eot_id)
                ep["mask"].append(0)
                ep["logprobs"].append(0.0)
            ep["truncated"] = ep.get("truncated", 0) + (not stopped)
            replies.append(self.tokenizer.decode(toks[:-1] if stopped else toks, skip_special_tokens=True))
        return replies

    def _continue(self, episodes, cache):
        """Prefill of a RowCache turn: each row's tokens not yet cached, right-aligned so that the last column holds
        every row's last token; padding columns write to the cache's spare last position and look at position 0.
        Returns the logits (B, V) of the first reply token and the decoding step."""
        device, B = self.model.device, len(episodes)
        ends = [len(ep["ids"]) for ep in episodes]
        span = -(-(max(ends) + self.max_new_tokens) // 64) * 64  # key positions a step attends: fixed for the turn
        cache.reserve(B, span, room=2 * (self.max_new_tokens + 64))  # grows about every other turn
        # new episodes with the same prompt (the rollouts of one example) are encoded once, their row then copied
        # for each: the prefill is the turn's biggest forward, and a group shares it
        first, source, unique = {}, [], []  # row b of the turn is row source[b] of the prefill
        for b, ep in enumerate(episodes):
            key = tuple(ep["ids"]) if ep["kv_len"] == 0 else b
            if key not in first:
                first[key] = len(unique)
                unique.append(ep)
            source.append(first[key])
        pending = [ep["ids"][ep["kv_len"]:] for ep in unique]
        U, W = len(unique), max(map(len, pending))
        ids = torch.full((U, W), self.pad_id, dtype=torch.long)  # (U, W)
        pos = torch.zeros((U, W), dtype=torch.long)
        write = torch.full((U, W), cache.capacity - 1, dtype=torch.long)
        real = torch.zeros((U, W), dtype=torch.bool)
        for u, (ep, new) in enumerate(zip(unique, pending)):
            ids[u, W - len(new):] = torch.tensor(new)
            pos[u, W - len(new):] = write[u, W - len(new):] = torch.arange(ep["kv_len"], len(ep["ids"]))
            real[u, W - len(new):] = True
        pos, real = pos.to(device), real.to(device)
        cache.write, cache.span, cache.real = write.to(device), span, real
        logits = self.model(input_ids=ids.to(device), position_ids=pos, attention_mask=self._masks(pos, real, span),
                            **{self.cache_kw: cache}, use_cache=True, logits_to_keep=1).logits[:, -1]  # (U, V)
        if U < B:
            cache.gather(source)
            logits = logits[torch.tensor(source, device=device)]  # (B, V)
        cache.lengths = torch.tensor(ends, device=device)
        token_in, real1 = torch.zeros((B, 1), dtype=torch.long, device=device), torch.ones((B, 1), dtype=torch.bool, device=device)
        cache.live, stops = torch.ones(B, dtype=torch.bool, device=device), torch.tensor(self.chat.stop_ids, device=device)

        def step(tokens):  # (B,) -> logits (B, V): one token per row at the row's end; no host sync, fixed shapes
            token_in.copy_(tokens[:, None])
            cache.live &= ~torch.isin(tokens, stops)  # the stop token itself is the next turn's first cached token
            pos = cache.lengths[:, None]  # (B, 1)
            cache.write, cache.real = pos, None
            out = self.model(input_ids=token_in, position_ids=pos, attention_mask=self._masks(pos, real1, span),
                             **{self.cache_kw: cache}, use_cache=True).logits[:, -1]
            cache.lengths += 1
            return out
        return logits, step

    def _masks(self, pos, real, span):
        """(B, 1, W, span) masks, True where query (b, w) at position pos[b, w] may look: its row's positions up to its
        own (within the sliding window for sliding layers); padding columns look at position 0 only (a row of no
        keys at all would be NaN). Given per layer type where the types mix: sliding and full attention (Gemma 3), or
        convolutions, which take none (LFM2)."""
        keys = torch.arange(span, device=pos.device)
        seen = (keys <= pos[..., None]) & real[..., None]  # (B, W, span)
        pad = (keys == 0) & ~real[..., None]
        full = (seen | pad)[:, None]
        if self.window is None:
            return {"full_attention": full, "conv": None, "linear_attention": None} if self.states else full
        near = (seen & (keys > pos[..., None] - self.window) | pad)[:, None]
        return {"full_attention": full, "sliding_attention": near} if self.window_layers_only else near

    def _reencode(self, episodes):
        """reuse_cache False, or layers the RowCache cannot hold: the whole conversation, left-padded, through the
        model's own cache, every turn. Returns the first logits (B, V) and the decoding step."""
        device, B = self.model.device, len(episodes)
        W = max(len(ep["ids"]) for ep in episodes)
        ids = torch.full((B, W), self.pad_id, dtype=torch.long)
        att = torch.zeros((B, W), dtype=torch.long)
        for b, ep in enumerate(episodes):
            ids[b, W - len(ep["ids"]):] = torch.tensor(ep["ids"])
            att[b, W - len(ep["ids"]):] = 1
        att = att.to(device)
        pos = (att.cumsum(1) - 1).clamp(min=0)
        out = self.model(input_ids=ids.to(device), attention_mask=att, position_ids=pos, use_cache=True, logits_to_keep=1)
        state = {"cache": returned_cache(out), "att": att, "pos": pos[:, -1:]}

        def step(tokens):  # (B,) -> logits (B, V)
            state["att"] = torch.cat([state["att"], state["att"].new_ones((B, 1))], 1)
            state["pos"] = state["pos"] + 1
            return self.model(input_ids=tokens[:, None], attention_mask=state["att"], position_ids=state["pos"],
                              **{self.cache_kw: state["cache"]}, use_cache=True).logits[:, -1]
        return out.logits[:, -1], step

    def _graphed(self, step, cache):
        """The decoding step captured as a CUDA graph for this turn's batch and span: one launch per token instead of
        a few hundred kernels. If capture fails the step runs as it is."""
        saved = cache.snapshot()
        tokens = torch.zeros_like(cache.lengths)
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step(tokens)  # warm-up outside the graph: kernels chosen, autocast's weight casts cached
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = step(tokens)
        except RuntimeError as e:
            print(f"CUDA graph capture failed ({str(e).splitlines()[0][:200]}); decoding without graphs")
            self.cuda_graphs = False
            cache.rewind(saved)
            return step
        cache.rewind(saved)  # the warm-up step counted a token per row and moved the recurrent states on

        def replay(new_tokens):
            tokens.copy_(new_tokens)
            graph.replay()
            return logits
        # the graph reads and writes buffers that only the eager step holds (its token input, its one-column mask):
        # freed with it, their memory would go to other tensors while the graph still writes there
        replay.eager_step = step
        return replay

    def _uniforms(self, episodes, device):
        """(B, max_new_tokens) uniform numbers in [0, 1), one per token this turn may sample: row b's are drawn from
        a generator seeded by (seed, episode index, rollout, turn). An episode's draws therefore do not depend on
        which other episodes share its batch: the same rollouts whatever --gen_batch, and whatever the number of
        ranks that split a step's episodes between them (rl.py under torchrun)."""
        if self.temp == 0:
            return torch.zeros((len(episodes), self.max_new_tokens), device=device)  # greedy: not used
        rows = [np.random.default_rng([self.seed, ep.get("index", 0), ep.get("rollout", 0), len(ep["messages"])]).random(self.max_new_tokens)
                for ep in episodes]
        return torch.tensor(np.stack(rows), dtype=torch.float32, device=device)

    def _forced(self, episodes, device):
        """(B, max_new_tokens) token ids of the replies the environment forces (sample.rollout: ep["force"], a text),
        -1 where the row samples: a forced reply is the tokenizer's encoding of its text and end-of-turn. None when
        no row is forced (nearly every turn): the decoding loop then pays nothing for it."""
        if all(ep.get("force") is None for ep in episodes):
            return None
        forced = torch.full((len(episodes), self.max_new_tokens), -1, dtype=torch.long)
        for b, ep in enumerate(episodes):
            if ep.get("force") is not None:
                ids = self.chat.reply_ids(ep["force"])[:self.max_new_tokens]
                forced[b, :len(ids)] = torch.tensor(ids)
        return forced.to(device)

    def _sample_replies(self, logits, step, uniforms, forced):
        """Sample up to max_new_tokens per row from the first logits (B, V), feeding each token back through step();
        token t of row b is drawn with uniforms[b, t], or is forced[b, t] where forced is given and that is not -1.
        Returns tokens (B, L), their logprobs under softmax(logits / temp) (temperature 1 when greedy), and the
        number of tokens of each reply (B,), its stop token included."""
        B, device = logits.shape[0], logits.device
        stop_ids = torch.tensor(self.chat.stop_ids, device=device)
        tokens = torch.zeros((B, self.max_new_tokens), dtype=torch.long, device=device)
        logprobs = torch.zeros((B, self.max_new_tokens), device=device)
        n_sampled = torch.full((B,), self.max_new_tokens, device=device)
        done = torch.zeros(B, dtype=torch.bool, device=device)
        check = 8 if device.type == "cuda" else 1  # all rows done? costs a host sync: on a GPU only every 8 tokens
        for t in range(self.max_new_tokens):
            token, logprob = self._sample(logits, uniforms[:, t], t < self.min_new_tokens, stop_ids,
                                          None if forced is None else forced[:, t])
            tokens[:, t], logprobs[:, t] = token, logprob
            stopped = torch.isin(token, stop_ids) & ~done
            n_sampled = torch.where(stopped, t + 1, n_sampled)
            done |= stopped
            if t + 1 == self.max_new_tokens or (t % check == check - 1 and bool(done.all())):
                break
            logits = step(token)
        return tokens[:, :t + 1], logprobs[:, :t + 1], n_sampled.long()

    def _sample(self, logits, uniform, suppress_stop, stop_ids, forced):
        """(token (B,), its logprob (B,)) from logits (B, V) and one uniform number per row (B,): inverse-CDF
        sampling, the first token whose cumulative probability exceeds the row's number, or the row's forced token
        (B,), if given, where that is not -1. The logprob is the model's at the sampling temperature, before any top-p or
        end-of-turn suppression."""
        logp = torch.log_softmax(logits.float() / (self.temp or 1.0), dim=-1)  # (B, V)
        choose = logp
        if suppress_stop:
            choose = logp.index_fill(1, stop_ids, float("-inf"))
        if self.temp == 0:
            token = choose.argmax(-1)
        else:
            probs = torch.softmax(choose, dim=-1)
            if self.top_p < 1.0:  # nucleus: the smallest set of most likely tokens whose probability reaches top_p
                sorted_probs, order = probs.sort(-1, descending=True)
                outside = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p
                probs = probs.scatter(1, order, sorted_probs.masked_fill(outside, 0.0))
            cdf = probs.cumsum(-1)  # (B, V)
            total = cdf[:, -1:].contiguous()  # (B, 1): 1 up to rounding
            token = torch.searchsorted(cdf, uniform[:, None] * total, right=True)  # (B, 1); a zero-probability token is never first past the number
            # a number that rounds up to the total would fall past the end: take the last token with probability instead
            token = torch.where(token >= cdf.shape[1], torch.searchsorted(cdf, total), token).squeeze(1)
            token = token.clamp(max=cdf.shape[1] - 1)  # NaN probabilities (non-finite weights) sort past the end too
        if forced is not None:
            token = torch.where(forced >= 0, forced, token)
        return token, logp.gather(1, token[:, None]).squeeze(1)


class APIError(RuntimeError):
    """The server refused a request, or stayed unreachable through every retry; the message says what to change."""


class APIPolicy:
    """Chat completions from an OpenAI-compatible server; the key comes from the variable named by key_env.

    Games through a server send text, not tokens: the server re-tokenizes the conversation every turn, so a reply
    whose sampled tokens are not the tokenizer's own encoding of its text is seen differently on the next turn.
    Servers with a reasoning parser return the <think> block in a separate field and strip it from the content;
    the reply is rebuilt as the model wrote it, so it is scored, shown and sent back with its reasoning."""
    RETRYABLE_STATUS = {408, 409, 429, 500, 502, 503, 504}
    REASONING_FIELDS = ("reasoning_content", "reasoning")  # transformers serve and vLLM; some hosted APIs

    def __init__(self, model, api_base, key_env="OPENAI_API_KEY", temp=1.0, max_new_tokens=1024, concurrency=16,
                 top_p=1.0, seed=0, send_seed=True, retries=6, timeout=120.0, backoff=1.0):
        import openai
        self.openai, self.model, self.temp, self.top_p, self.max_new_tokens = openai, model, temp, top_p, max_new_tokens
        self.client = openai.OpenAI(base_url=api_base, api_key=os.environ.get(key_env) or "EMPTY",
                                    max_retries=0, timeout=timeout)
        self.api_base, self.concurrency, self.retries, self.backoff = api_base, concurrency, retries, backoff
        self.seed, self.send_seed = seed, send_seed
        self.gen_tokens, self.lock = 0, threading.Lock()

    def __call__(self, episodes):
        with concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(lambda ep: self._one(ep["messages"], self._request_seed(ep)) if ep.get("force") is None
                                 else ep["force"], episodes))

    def _request_seed(self, ep):
        """A function of the run's seed, the episode and its turn: a rerun sends the same requests, whatever the order
        in which the server answers them."""
        turn = sum(m["role"] == "assistant" for m in ep["messages"])
        return random.Random(f"{self.seed}/{ep['index']}/{ep['rollout']}/{turn}").randrange(2**31)

    def _one(self, messages, seed):
        # a tool's result goes as a user message: an API's tool role needs the id of a structured tool call, and
        # the tool calls here are text in the reply
        sent = [{"role": "user", "content": m["content"]} if m["role"] == "tool" else m for m in messages]
        sampling = {"temperature": self.temp, "max_tokens": self.max_new_tokens}
        if self.top_p < 1.0:  # not sent at 1.0: some servers refuse top_p for some models
            sampling["top_p"] = self.top_p
        if self.send_seed:
            sampling["seed"] = seed
        for attempt in range(self.retries + 1):
            try:
                resp = self.client.chat.completions.create(model=self.model, messages=sent, **sampling)
                with self.lock:
                    self.gen_tokens += getattr(resp.usage, "completion_tokens", 0) or 0
                return self._as_written(resp.choices[0].message)
            except (self.openai.APITimeoutError, self.openai.APIConnectionError, self.openai.APIStatusError) as e:
                status = getattr(e, "status_code", None)
                if status is not None and status not in self.RETRYABLE_STATUS:
                    reason = server_reason(e)
                    raise APIError(f"API error {status} from {self.api_base} for model {self.model!r}: "
                                   f"{reason}. {self._what_to_change(reason, status)}") from e
                if attempt == self.retries:
                    raise APIError(f"API at {self.api_base} still failing after {self.retries + 1} attempts "
                                   f"({type(e).__name__}: {server_reason(e)}). Is the server up? Retry later; "
                                   "finished rollouts are kept (eval.py --resume continues).") from e
                time.sleep(min(self.backoff * 2 ** attempt, 30.0) * (0.5 + random.random()))

    def _as_written(self, message):
        """The reply as the model wrote it: a server's reasoning parser moves <think> to its own field, and a
        tool-call parser moves <tool_call> blocks to tool_calls (rebuilt in the Hermes/Qwen3 format)."""
        reasoning = next((r for r in (getattr(message, f, None) for f in self.REASONING_FIELDS) if r), None)
        calls = "".join(f'<tool_call>{{"name": {json.dumps(c.function.name)}, "arguments": {c.function.arguments}}}</tool_call>'
                        for c in (getattr(message, "tool_calls", None) or []))
        return (f"<think>{reasoning}</think>" if reasoning else "") + (message.content or "") + calls

    def _what_to_change(self, reason, status):
        reason = reason.lower()
        if "seed" in reason and self.send_seed:
            return "The server refuses the `seed` parameter: rerun with --no_api_seed (its games are then not reproducible)."
        if "top_p" in reason and self.top_p < 1.0:
            return "The server refuses the `top_p` parameter: rerun with --top_p 1 (it is then not sent)."
        if status in (401, 403):
            return "Check the key in the environment variable that --api_key_env names."
        return (f"--model must be the name the server serves (GET {self.api_base.rstrip('/')}/models lists them); "
                "check --api_base and the key in --api_key_env.")


def server_reason(e):
    """The server's own explanation of an error, on one line: the body's message or detail, else the exception's text."""
    body = getattr(e, "body", None)
    if isinstance(body, dict):
        body = body.get("error", body)
        if isinstance(body, dict):
            body = body.get("message") or body.get("detail") or json.dumps(body)
    text = body if isinstance(body, str) and body else str(e)
    return " ".join(text.split())[:400].rstrip(".")


def has_scripted_player(env, name):
    try:
        env.scripted_player(name)
        return True
    except (ValueError, AttributeError):
        return False


class ScriptedPolicy:
    def __init__(self, env, name, random_move_prob=0.0):
        try:
            self.player = env.scripted_player(name, random_move_prob)
        except ValueError as e:  # a player this environment does not have
            raise SystemExit(str(e)) from None
        self.gen_tokens = 0

    def __call__(self, episodes):
        return [self.player(ep["state"]) if ep.get("force") is None else ep["force"] for ep in episodes]


def make_policy(model, env, device="auto", temp=1.0, top_p=1.0, max_new_tokens=128, batch_size=256,
                api_base=None, api_key_env="OPENAI_API_KEY", concurrency=16, random_move_prob=0.0, seed=0, send_seed=True):
    """A policy from a --model string: a scripted player name, an API model (with api_base), or an HF model."""
    if model in ("random", "minimax", "oracle") or (not os.path.isdir(model) and has_scripted_player(env, model)):
        return ScriptedPolicy(env, model, random_move_prob)
    if api_base:
        return APIPolicy(model, api_base, api_key_env, temp, max_new_tokens, concurrency, top_p, seed, send_seed)
    lm, tokenizer = load_model(model, device)
    return HFPolicy(lm, tokenizer, env.system_prompt, temp, top_p, max_new_tokens, batch_size, seed=seed)


# ----------------------------------------------------------------------------- the rollout loop


def new_episode(env, example, index=0, rollout=0):
    state, first = env.reset(example)
    return {"example": example, "index": index, "rollout": rollout, "state": state,
            "messages": [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": first}]}


def branch(ep):
    """A copy of an episode that goes on apart from it (eval.certify branches its lines over the opponent's
    replies): its trajectory lists and environment state copied, anything else shared, the policy's KV cache
    included (HFPolicy gives the copy a row of its own at the next turn). The token lists are copied whole, not
    element by element as copy.deepcopy would (1.2 ms for an episode of 900 tokens on this 2-core CPU: 1.6 s for
    the 1,338 branches of a certificate that takes about 24 s)."""
    child = {k: list(v) if isinstance(v, list) else v for k, v in ep.items()}
    child["state"] = copy.deepcopy(ep["state"])
    return child


def advance(env, ep, reply):
    """Give one reply to the environment; True when the episode is over. The environment answers with a user
    message (a string), a message dict in the tool role (a tool's result), or None."""
    ep["messages"].append({"role": "assistant", "content": reply})
    msg = env.step(ep["state"], reply)
    if msg is not None:
        ep["messages"].append(msg if isinstance(msg, dict) else {"role": "user", "content": msg})
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
    pairs already done. An environment with a forced_reply(state, rollout) hook may play a turn's reply in the
    policy's place (a text, or None to let the policy sample): exploration, as tic-tac-toe's replay_explore tries
    other moves at a replayed mistake; HFPolicy records it as the model's tokens with the model's logprobs."""
    active = [new_episode(env, ex, start_index + i, r) for i, ex in enumerate(examples) for r in range(group)
              if (start_index + i, r) not in skip]
    done = []
    bar = tqdm(total=len(active), desc="episodes", unit="ep", disable=not progress, leave=False)
    for _ in range(env.max_turns):
        if not active:
            break
        if hasattr(env, "forced_reply"):  # an environment's exploration: replies it plays in the policy's place
            for ep in active:
                ep["force"] = env.forced_reply(ep["state"], ep["rollout"])
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
        tag = {"assistant": "model", "tool": "tool"}.get(m["role"], "env")
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
    p.add_argument("--batch_size", type=int, default=256, help="max episodes per rollout batch (bounds the KV cache's memory)")
    p.add_argument("--seed", type=int, default=0, help="seed for examples and sampling")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument("--api_base", default=None, help="OpenAI-compatible base URL; --model is then the served model name")
    p.add_argument("--api_key_env", default="OPENAI_API_KEY", help="name of the environment variable holding the API key")
    p.add_argument("--concurrency", type=int, default=16, help="max concurrent API requests")
    p.add_argument("--no_api_seed", action="store_true", help="API models: send no per-request seed (for a server that "
                   "refuses one; its sampled games are then not reproducible)")
    p.add_argument("--random_move_prob", type=float, default=0.0, help="--model minimax only: its own random-move probability")
    return p


POLICY_FLAG_RULES = {  # the flags of add_policy_args: (test, what the value must be), checked by check_flags
    "temp": (non_negative, "a finite number >= 0 (0: greedy)"),
    "top_p": (lambda x: 0 < x <= 1, "in (0, 1]"),
    "max_new_tokens": (at_least(1), ">= 1"),
    "batch_size": (at_least(1), ">= 1"),
    "concurrency": (at_least(1), ">= 1"),
    "random_move_prob": (lambda x: 0 <= x <= 1, "in [0, 1]"),
    "device": TRAIN_FLAG_RULES["device"],
}


def policy_from_args(args, env, temp=None):
    return make_policy(args.model, env, args.device, args.temp if temp is None else temp, args.top_p, args.max_new_tokens,
                       args.batch_size, args.api_base, args.api_key_env, args.concurrency, args.random_move_prob,
                       args.seed, not args.no_api_seed)


def main():
    p = add_policy_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("-n", type=int, default=4, help="number of episodes to play and print")
    p.add_argument("--play", action="store_true", help="play tic-tac-toe against the model in the terminal")
    p.add_argument("--out", default=None, help="also write the rollout records (JSONL) to this file")
    args = p.parse_args()
    check_flags(args, {**POLICY_FLAG_RULES, "n": (at_least(1), ">= 1"),
                       "out": (lambda f: f is None or can_write(f, directory=False), "a file you can write")})
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    env = load_env(args.env, args.env_args)
    policy = policy_from_args(args, env)
    if args.play:
        return play_human(args.env, args.env_args, policy)
    try:
        records = rollout(env, env.examples(args.n, args.seed), policy)
    except APIError as e:
        raise SystemExit(str(e)) from None
    for rec in records:
        print(show(rec, env) + "\n")
    if args.out:
        with open(args.out, "w") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
