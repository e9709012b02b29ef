"""
The fast rollout engine: a KV cache row per episode for the whole game, each turn's decoding one CUDA graph; and, at
the end, what makes the update fast on a GPU (gradient checkpointing, the decoder layers compiled).

sample.HFPolicy's turns run on sample.GenerateEngine (generate(), the reference) or this one (--engine fast; auto
picks it where it holds the layers), both through the policy's seeded draws: the same greedy tokens, logprobs equal to
float rounding (tests/test_engine.py). generate() takes one cache per call with the rows left-padded, so each turn
re-encodes the whole conversation, and it pays its Python and launch overhead at every token. Here a rollout batch
keeps ONE preallocated KV cache (RowCache) in which each episode has its own row for the whole game (a prompt shared
by a group's rollouts is encoded once, its row copied for each). A turn writes only each row's new tokens at that
row's end (the environment's message) and decodes from there; finished episodes leave at turn boundaries. A decoding
step is one forward of the HF model and the sampling, with fixed shapes for the whole turn and no host sync, so on a
GPU it is captured as a CUDA graph once a turn (bit for bit the eager step's tokens and logprobs on an H100,
`docs/gpu_check.py exact`): one launch per token. On an H100, one turn of 256 episodes x 64 tokens (Qwen3-0.6B
shape) took 0.88 s graphed, 2.04 s eager (with SDPA), 1.86 s through generate() with a static cache and 2.43 s with
its dynamic cache (docs/SPEED.md). Layers with a recurrent state keep it in the same row: LFM2's short convolutions
(each row's last inputs, placed before its new tokens), Qwen3.5's linear attention (that convolution, and the gated
delta rule's state, which padding and a finished row's decoding steps leave as it is).
"""
import contextlib
import functools
import sys

import torch

from common import GRAD_CKPT_AUTO_PARAMS, cache_kwarg, head_logprobs


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
    """The KV cache of one rollout batch: row b holds episode b's keys and values at positions 0, 1, 2, ... for its
    whole game. A forward writes each row's new tokens at the row's own positions (`write`, (B, W)); at a turn boundary
    gather() drops finished episodes' rows (and repeats a branched episode's). Buffers are copied only when they grow
    (reserve) or lose or repeat rows (gather). Layers call update() as a transformers Cache's and attend the first
    `span` positions of every row, masked to its own. A short convolution (LFM2, Qwen3.5) keeps in `conv` each row's
    last kernel - 1 inputs (_row_conv), a linear-attention layer in `delta` its recurrent state (_row_delta)."""

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
    """Registers (once) and names an attention function for RowCache: each KV head's query heads stacked, not the keys
    and values copied per query head (as transformers' SDPA path does with a mask). With decode_by_matmul a decoding
    step is two batched matrix products with fp32 scores: SDPA padded a KV head's few queries to a tile of 64, half
    the decoding time on an H100 (Qwen3-0.6B shape, 256 rows); a turn 8% faster. On a CPU SDPA is no slower."""
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


# ----------------------------------------------------------------------------- the engine


class FastEngine:
    """Turns of HFPolicy's episodes on RowCaches (see the module doc). Plain-attention models (Llama, Qwen3, Gemma 3,
    ...), LFM2 and Qwen3.5 (their convolutions and linear attention keep their state in the rows): `fits`. Each
    rollout batch of up to policy.batch_size episodes keeps one RowCache for the whole game; a turn encodes only each
    row's new tokens (the previous reply's last token, the environment's message) and decodes from there, one forward
    and the sampling per token (on a GPU a CUDA graph of it, captured once a turn, unless cuda_graphs=False)."""
    name = "fast"

    def __init__(self, model, cuda_graphs=True, decode_by_matmul=None):
        self.model, self.cache_kw = model, cache_kwarg(model)
        self.states = state_modules(model)
        self.window, self.window_layers_only = sliding_window(model.config)
        # on a GPU: sample under bf16 autocast, as the model trains (a trained model keeps fp32 weights, load_model),
        # and keep the KV cache in bf16
        self.autocast = model.device.type == "cuda"
        self.cuda_graphs = cuda_graphs and self.autocast
        self.decode_by_matmul = self.autocast if decode_by_matmul is None else decode_by_matmul  # _grouped_attention

    @staticmethod
    def fits(model):
        """Whether every layer of the model can keep its state in a RowCache row."""
        return row_cache_fits(model.config, state_modules(model))

    def turn(self, policy, episodes):
        """[(tokens, logprobs)] of each episode's reply this turn (policy.sample_replies): episodes go on in their
        rollout batch's cache, new ones start batches of policy.batch_size."""
        groups = {}
        for ep in episodes:
            if "kv" in ep:
                groups.setdefault(id(ep["kv"]), (ep["kv"], []))[1].append(ep)
        for cache, batch in groups.values():
            cache.gather([ep["kv_row"] for ep in batch])
        new = [ep for ep in episodes if "kv" not in ep]
        dtype = torch.bfloat16 if self.autocast else self.model.dtype
        batches = list(groups.values()) + [(RowCache(dtype), new[i:i + policy.batch_size])
                                           for i in range(0, len(new), policy.batch_size)]
        replies = {}
        for cache, batch in batches:
            for row, ep in enumerate(batch):
                ep.update(kv=cache, kv_row=row, kv_len=ep.get("kv_len", 0))
            with torch.no_grad(), torch.autocast(self.model.device.type, dtype=torch.bfloat16, enabled=self.autocast), \
                    _RowLayers(self.model, _grouped_attention(self.decode_by_matmul), self.states):
                logits, step = self._continue(policy, batch, cache)
                if self.cuda_graphs:
                    step = self._graphed(step, cache)
                out = policy.sample_replies(logits, step, batch)
            for ep, (toks, lps) in zip(batch, out):
                ep["kv_len"] = len(ep["ids"]) + len(toks) - 1  # every sampled token but the last went into the cache
                replies[id(ep)] = toks, lps
        return [replies[id(ep)] for ep in episodes]

    def _continue(self, policy, episodes, cache):
        """Prefill of a RowCache turn: each row's tokens not yet cached, right-aligned so that the last column holds
        every row's last token; padding columns write to the cache's spare last position and look at position 0.
        Returns the logits (B, V) of the first reply token and the decoding step."""
        device, B = self.model.device, len(episodes)
        ends = [len(ep["ids"]) for ep in episodes]
        span = -(-(max(ends) + policy.max_new_tokens) // 64) * 64  # key positions a step attends: fixed for the turn
        cache.reserve(B, span, room=2 * (policy.max_new_tokens + 64))  # grows about every other turn
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
        ids = torch.full((U, W), policy.pad_id, dtype=torch.long)  # (U, W)
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
        cache.live, stops = torch.ones(B, dtype=torch.bool, device=device), torch.tensor(policy.chat.stop_ids, device=device)

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


# ----------------------------------------------------------------------------- the update on a GPU: checkpointing, compiled layers


def enable_grad_ckpt(model, setting, device):
    """Gradient checkpointing as --grad_ckpt says (auto: on for a model of GRAD_CKPT_AUTO_PARAMS+ parameters on a
    GPU); returns whether it is on."""
    big = sum(p.numel() for p in model.parameters()) >= GRAD_CKPT_AUTO_PARAMS
    on = setting == "on" or (setting == "auto" and device.startswith("cuda") and big)
    if on:  # transformers 5.2x renamed gradient_checkpointing_enable; 5.17 has only the old name
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    return on


def compile_layers(model, setting, device, backend="inductor"):
    """Prepare the decoder layers to run through torch.compile inside compiled_layers(); returns whether on (auto: on a
    GPU for GRAD_CKPT_AUTO_PARAMS+ parameters, where it was measured). With fp32 weights under bf16 autocast the layers'
    elementwise work (fp32 RMSNorm, rotary, the MLP's gate, casts) ran as hundreds of unfused kernels, over half an
    H100's update time for a Qwen3-0.6B shape (the matrix products 17%); compiled, it fuses, one compilation for every
    layer and micro-batch shape. The LM head's log-softmax is compiled too (each unfused fp32 pass over a (2048, 152k)
    chunk reads and writes 1.2 GB)."""
    big = sum(p.numel() for p in model.parameters()) >= GRAD_CKPT_AUTO_PARAMS
    on = setting == "on" or (setting == "auto" and device.startswith("cuda") and big)
    if on:
        for layer in model.get_decoder().layers:
            layer.compiled_call = torch.compile(layer._call_impl, dynamic=True, backend=backend)
        model.compiled_head_logprobs = torch.compile(head_logprobs, dynamic=True, backend=backend)
    return on


@contextlib.contextmanager
def compiled_layers(model):
    """Within: the layers that compile_layers prepared run compiled, so enter it around the forward *and* the
    backward (gradient checkpointing recomputes the forward there); outside: eager, as the rollouts need (they
    patch the layers' attention and capture their own CUDA graphs). The compiled LM-head piece needs no context:
    only token_logprobs, a training forward, uses it. A compiler that fails on the layers stops the run with one line."""
    layers = [layer for layer in model.get_decoder().layers if hasattr(layer, "compiled_call")]
    for layer in layers:
        layer._compiled_call_impl = layer.compiled_call  # what nn.Module.compile() sets; __call__ uses it
    try:
        yield
    except torch._dynamo.exc.TorchDynamoException as e:  # no compiler for this GPU, a layer it cannot trace, ...
        raise SystemExit(f"torch.compile failed on the update's layers: run with TORCH_COMPILE_DISABLE=1 (PyTorch's "
                         f"switch).\n  ({type(e).__name__}: {str(e).strip().splitlines()[0][:300]})") from e
    finally:
        for layer in layers:
            layer._compiled_call_impl = None
