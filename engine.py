"""
The fast rollout engine (HFPolicy's --engine fast; auto picks it where it holds the layers) and, at
the end, what makes the update fast on a GPU (gradient checkpointing, compiled layers).

generate() (sample.GenerateEngine, the reference) re-encodes the whole conversation each turn and
pays Python and launch overhead per token. Here a rollout batch keeps ONE KV cache (RowCache), a row
per episode for the whole game: a group's shared prompt is encoded once, a turn writes only each
row's new tokens, and a decoding step has fixed shapes and no host sync, so on a GPU it is one CUDA
graph launch per token (docs/SPEED.md). LFM2's and Qwen3.5's recurrent states live in the rows too.
Greedy tokens match generate()'s, logprobs to float rounding (tests/test_engine.py).
"""
import contextlib
import functools
import sys

import torch

from common import GRAD_CKPT_AUTO_PARAMS, Scorer, cache_kwarg, head_logprobs, on_device
from ranks import held_per_rank, shard


# what _row_delta uses of a Qwen3.5 linear-attention module: a model lacking one does not `fit`
DELTA_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "conv1d", "A_log", "dt_bias",
               "norm", "out_proj", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim",
               "key_dim", "value_dim", "activation")


def row_cache_fits(config, states):
    """True when every layer's state can live in a RowCache row: softmax attention (full or in a
    sliding window), or `states` (state_modules) with the parts that _row_conv / _row_delta use."""
    types = getattr(config, "layer_types", None) or ["full_attention"]
    return (set(types) <= {"full_attention", "sliding_attention", "conv", "linear_attention"}
            and all((isinstance(getattr(m, "conv", None), torch.nn.Conv1d) and hasattr(m, "in_proj")
                     and hasattr(m, "out_proj")) if t == "conv"
                    else all(hasattr(m, part) for part in DELTA_PARTS) for t, m in states.values()))


def state_modules(model):
    """{layer index: (layer type, module)} of the layers with a state besides keys and values."""
    types = getattr(model.config, "layer_types", None) or []
    layers = model.get_decoder().layers
    attribute = {"conv": "conv", "linear_attention": "linear_attn"}
    return {i: (t, getattr(layers[i], attribute[t], None))
            for i, t in enumerate(types) if t in attribute}


def sliding_window(config):
    """(window, only some layers): the attention's sliding window (or None); only some layers when
    layer_types mix sliding and full attention (Gemma 3: masks per type), else all (Mistral)."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is not None:
        return (window, True) if "sliding_attention" in types else (None, False)
    return window, False


class RowCache:
    """The KV cache of one rollout batch: row b holds episode b's keys and values at positions 0,
    1, 2, ... for its whole game, a forward writing a row's new tokens at its positions (`write`).
    At a turn boundary gather() drops finished episodes' rows (and repeats a branched episode's):
    buffers are copied only then or when they grow (reserve). Recurrent states: `conv`, `delta`."""

    def __init__(self, dtype):
        self.dtype, self.capacity = dtype, 0
        self.keys, self.values = {}, {}  # layer -> (B, H, capacity, D), the last slot for padding
        self.conv = {}  # layer -> (B, C, kernel - 1): a row's last convolution inputs, oldest first
        self.delta = {}  # layer -> (B, heads, key dim, value dim): linear attention's state
        self.lengths = None  # (B,) tokens cached per row, on the model's device
        self.write, self.span = None, 0
        self.real = None  # (B, W) in a prefill: True on the rows' new tokens; None when decoding
        # (B,) while decoding: False from a row's stop token on; a finished row keeps decoding
        # (fixed shapes), but its recurrent states, like its keys and values, stay where it ended
        self.live = None

    def update(self, keys, values, layer, *args, **kwargs):  # (B, H, W, D) each
        B, H, W, D = keys.shape
        if layer not in self.keys:
            self.keys[layer], self.values[layer] = (
                keys.new_zeros((B, H, self.capacity, D), dtype=self.dtype) for _ in range(2))
        K, V = self.keys[layer][:B], self.values[layer][:B]
        rows = torch.arange(B, device=keys.device)[:, None]  # (B, 1) with write (B, W): per token
        K[rows, :, self.write] = keys.transpose(1, 2).to(self.dtype)  # (B, W, H, D)
        V[rows, :, self.write] = values.transpose(1, 2).to(self.dtype)
        return K[:, :, :self.span], V[:, :, :self.span]

    def conv_state(self, layer, inputs, kernel):  # inputs (B, C, W) -> (B, C, kernel - 1)
        if layer not in self.conv:
            self.conv[layer] = inputs.new_zeros((inputs.shape[0], inputs.shape[1], kernel - 1))
        return self.conv[layer][:inputs.shape[0]]

    def delta_state(self, layer, like):  # like: a state (B, heads, key dim, value dim)
        if layer not in self.delta:
            self.delta[layer] = torch.zeros_like(like)
        return self.delta[layer][:like.shape[0]]

    def snapshot(self):
        """What rewind() puts back (a warm-up decoding step moves it on)."""
        return (self.lengths.clone(), self.live.clone(),
                [{layer: state.clone() for layer, state in states.items()}
                 for states in (self.conv, self.delta)])

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
        """Room for `positions` (+ a padding slot) in `rows` rows, with `room` more if it grows."""
        if positions + 1 <= self.capacity:
            return
        old, self.capacity = self.capacity, positions + 1 + room
        for buffers in (self.keys, self.values):
            for layer, buf in buffers.items():  # one layer at a time: never two copies of the cache
                new = buf.new_zeros((rows, buf.shape[1], self.capacity, buf.shape[3]))
                new[:, :, :old - 1] = buf[:rows, :, :old - 1]
                buffers[layer] = new


@functools.cache
def _grouped_attention(decode_by_matmul):
    """Registers (once) and names an attention function for RowCache: each KV head's query heads
    stacked, not its keys and values copied per query head. With decode_by_matmul a decoding step is
    two batched matmuls, fp32 scores (on a GPU, SDPA pads a KV head's few queries to 64 rows)."""
    from transformers import AttentionInterface

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        B, Hq, W, D = query.shape  # key, value: (B, Hkv, span, D); mask (B, 1, W, span), True: seen
        Hkv, span = key.shape[1], key.shape[2]
        G = Hq // Hkv
        if W == 1 and decode_by_matmul:
            q = query.to(key.dtype).reshape(B * Hkv, G, D)  # an fp32 q_norm leaves queries in fp32
            scores = _scores(q, key.reshape(B * Hkv, span, D).transpose(1, 2))  # fp32
            scores = scores.view(B, Hkv, G, span) * (scaling if scaling is not None else D ** -0.5)
            probs = scores.masked_fill(~attention_mask, float("-inf")).softmax(-1).to(value.dtype)
            out = torch.bmm(probs.view(B * Hkv, G, span), value.reshape(B * Hkv, span, D))
            return out.view(B, 1, Hq, D), None  # (B * Hkv, G, D) -> (B, W, Hq, D)
        query = query.reshape(B, Hkv, G * W, D)
        mask = attention_mask[:, :, None].expand(B, 1, G, W, span).reshape(B, 1, G * W, span)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                               scale=scaling)
        return out.reshape(B, Hq, W, D).transpose(1, 2).contiguous(), None  # (B, W, Hq, D)

    name = "rollout_rows_matmul" if decode_by_matmul else "rollout_rows"
    AttentionInterface.register(name, attention)
    return name


def _scores(q, k_t):
    """q @ k_t (B, G, span) in fp32, from bf16 without an fp32 copy of the keys (bmm out_dtype)."""
    if q.dtype in (torch.float32, torch.float64):
        return torch.bmm(q, k_t)
    try:
        return torch.bmm(q, k_t, out_dtype=torch.float32)
    except (TypeError, NotImplementedError):  # no out_dtype in this torch, or not on this device
        return torch.bmm(q.float(), k_t.float())


def _conv_window(cache, layer, inputs, kernel):
    """[state, new tokens] (B, C, kernel - 1 + W) of a short convolution's `inputs` (B, C, W): each
    row's state (its last kernel - 1 inputs) right before its new tokens, which in a prefill sit
    behind its padding. Its last kernel - 1 inputs become its state, unless the row has finished."""
    state = cache.conv_state(layer, inputs, kernel)  # (B, C, kernel - 1)
    seq = torch.cat([state, inputs], -1)  # (B, C, kernel - 1 + W)
    if cache.real is not None:  # a prefill
        pad = (~cache.real).sum(1, keepdim=True)  # (B, 1)
        t = torch.arange(seq.shape[-1], device=seq.device)  # column of the rearranged sequence
        # source (B, kernel - 1 + W): p_b copies of column 0 (outputs unused), state, new tokens
        source = torch.where(t >= pad + kernel - 1, t, torch.where(t >= pad, t - pad, 0))
        seq = seq.gather(-1, source[:, None, :].expand(-1, seq.shape[1], -1))
        state.copy_(seq[:, :, -(kernel - 1):])  # in place: a CUDA graph keeps these buffers
    else:  # decoding: a finished row's state stays
        state.copy_(torch.where(cache.live[:, None, None], seq[:, :, -(kernel - 1):], state))
    return seq


def _row_conv(module, layer, hidden_states, attention_mask=None, **kwargs):
    """LFM2's short convolution over a RowCache, as transformers' Lfm2ShortConv computes it."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    channels, kernel = module.conv.weight.shape[0], module.conv.weight.shape[-1]
    gate, c, x = module.in_proj(hidden_states).transpose(-1, -2).chunk(3, dim=-2)  # (B, C, W) each
    inputs = gate * x
    seq = _conv_window(cache, layer, inputs, kernel)  # (B, C, kernel - 1 + W)
    out = torch.nn.functional.conv1d(seq, module.conv.weight, module.conv.bias, groups=channels)
    return module.out_proj((c * out).transpose(-1, -2).contiguous())  # out: (B, C, W)


def _row_delta(module, layer, hidden_states, attention_mask=None, **kwargs):
    """Qwen3.5's linear attention (a short convolution, then the gated delta rule) over a RowCache,
    as transformers' Qwen3_5GatedDeltaNet computes it with its module's own kernels. Padding and a
    finished row's steps leave its state as it was: decay 1 (g = 0), no write (beta = 0)."""
    ops = sys.modules[type(module).__module__]
    cache = kwargs.get("cache", kwargs.get("past_key_values", kwargs.get("cache_params")))
    B, W, _ = hidden_states.shape
    mixed = module.in_proj_qkv(hidden_states).transpose(1, 2)  # (B, C, W)
    z = module.in_proj_z(hidden_states).reshape(B, W, -1, module.head_v_dim)
    beta = module.in_proj_b(hidden_states).sigmoid()  # (B, W, heads)
    g = -module.A_log.float().exp() * torch.nn.functional.softplus(
        module.in_proj_a(hidden_states).float() + module.dt_bias)
    channels, kernel = mixed.shape[1], module.conv1d.weight.shape[-1]
    seq = _conv_window(cache, layer, mixed, kernel)  # (B, C, kernel - 1 + W)
    keep = cache.real if cache.real is not None else cache.live[:, None]  # (B, W) real/live tokens
    mixed = torch.nn.functional.conv1d(seq.to(module.conv1d.weight.dtype), module.conv1d.weight,
                                       module.conv1d.bias, groups=channels)
    act = ops.ACT2FN[module.activation]
    mixed = act(mixed).to(hidden_states.dtype).transpose(1, 2)  # (B, W, C)
    query, key, value = mixed.split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
    value = value.reshape(B, W, -1, module.head_v_dim)
    # query/key heads repeated per value head here, as 5.17's layer does (5.24's kernel then won't)
    repeat = module.num_v_heads // module.num_k_heads
    query, key = (x.reshape(B, W, -1, module.head_k_dim).repeat_interleave(repeat, dim=2)
                  for x in (query, key))
    g, beta = g.masked_fill(~keep[..., None], 0.0), beta.masked_fill(~keep[..., None], 0.0)
    rule = ops.torch_recurrent_gated_delta_rule if W == 1 else ops.torch_chunk_gated_delta_rule
    state = cache.delta.get(layer)
    out, new_state = rule(query, key, value, g=g, beta=beta,
                          initial_state=None if state is None else state[:B],
                          output_final_state=True, use_qk_l2norm_in_kernel=True)
    cache.delta_state(layer, new_state).copy_(new_state)  # in place: the CUDA graph's buffer
    out = module.norm(out.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(out.reshape(B, W, -1))


class _RowLayers:
    """Within: the attention layers use `implementation` (the config is read at every forward), the
    recurrent-state layers _row_conv / _row_delta; with implementation None nothing changes."""

    def __init__(self, model, implementation, states):
        self.config, self.implementation = model.config, implementation
        self.states = states if implementation else {}

    def __enter__(self):
        self.saved = self.config._attn_implementation
        if self.implementation:
            self.config._attn_implementation = self.implementation
        for layer, (kind, module) in self.states.items():
            module.forward = functools.partial(_row_conv if kind == "conv" else _row_delta,
                                               module, layer)

    def __exit__(self, *exc):
        self.config._attn_implementation = self.saved
        for _, module in self.states.values():
            del module.forward  # the class's own forward again


# ----------------------------------------------------------------------------- the engine
class FastEngine:
    """Turns of HFPolicy's episodes on RowCaches, one per rollout batch, for the models that `fits`
    (plain attention: Llama, Qwen3, Gemma 3, ...; LFM2, Qwen3.5); on a GPU with CUDA graphs."""
    name = "fast"

    def __init__(self, model, cuda_graphs=True, decode_by_matmul=None):
        self.model, self.cache_kw = model, cache_kwarg(model)
        self.states = state_modules(model)
        self.window, self.window_layers_only = sliding_window(model.config)
        # on a GPU: bf16 autocast and KV cache, as the model trains (weights stay fp32, load_model)
        self.autocast = model.device.type == "cuda"
        self.cuda_graphs = cuda_graphs and self.autocast
        self.decode_by_matmul = self.autocast if decode_by_matmul is None else decode_by_matmul

    @staticmethod
    def fits(model):
        """Whether every layer of the model can keep its state in a RowCache row."""
        return row_cache_fits(model.config, state_modules(model))

    def turn(self, policy, episodes):
        """[(tokens, logprobs)]: each episode's reply, on its batch's cache or on a new batch's."""
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
            with (torch.no_grad(), torch.autocast(self.model.device.type, dtype=torch.bfloat16,
                                                  enabled=self.autocast),
                  _RowLayers(self.model, _grouped_attention(self.decode_by_matmul), self.states)):
                logits, step = self._continue(policy, batch, cache)
                if self.cuda_graphs:
                    step = self._graphed(step, cache)
                out = policy.sample_replies(logits, step, batch)
            for ep, (toks, lps) in zip(batch, out):
                ep["kv_len"] = len(ep["ids"]) + len(toks) - 1  # the last token is not cached yet
                replies[id(ep)] = toks, lps
        return [replies[id(ep)] for ep in episodes]

    def _continue(self, policy, episodes, cache):
        """Prefill of a turn, each row's uncached tokens right-aligned (padding writes to the spare
        last position); returns the first reply token's logits (B, V) and the decoding step."""
        device, B = self.model.device, len(episodes)
        ends = [len(ep["ids"]) for ep in episodes]
        span = -(-(max(ends) + policy.max_new_tokens) // 64) * 64  # key positions a step attends
        cache.reserve(B, span, room=2 * (policy.max_new_tokens + 64))  # grows ~every other turn
        # a group's new episodes share their prompt's prefill (the turn's biggest forward)
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
            pos[u, W - len(new):] = write[u, W - len(new):] = torch.arange(
                ep["kv_len"], len(ep["ids"]))
            real[u, W - len(new):] = True
        pos, real = pos.to(device), real.to(device)
        cache.write, cache.span, cache.real = write.to(device), span, real
        logits = self.model(input_ids=ids.to(device), position_ids=pos,
                            attention_mask=self._masks(pos, real, span), **{self.cache_kw: cache},
                            use_cache=True, logits_to_keep=1).logits[:, -1]  # (U, V)
        if U < B:
            cache.gather(source)
            logits = logits[torch.tensor(source, device=device)]  # (B, V)
        cache.lengths = torch.tensor(ends, device=device)
        token_in = torch.zeros((B, 1), dtype=torch.long, device=device)
        real1 = torch.ones((B, 1), dtype=torch.bool, device=device)
        cache.live = torch.ones(B, dtype=torch.bool, device=device)
        stops = torch.tensor(policy.chat.stop_ids, device=device)

        def step(tokens):  # (B,) -> logits (B, V) at each row's end; fixed shapes, no host sync
            token_in.copy_(tokens[:, None])
            cache.live &= ~torch.isin(tokens, stops)  # stop token: next turn's first cached token
            pos = cache.lengths[:, None]  # (B, 1)
            cache.write, cache.real = pos, None
            out = self.model(input_ids=token_in, position_ids=pos,
                             attention_mask=self._masks(pos, real1, span), **{self.cache_kw: cache},
                             use_cache=True).logits[:, -1]
            cache.lengths += 1
            return out
        return logits, step

    def _masks(self, pos, real, span):
        """(B, 1, W, span) masks: query (b, w) sees its row's positions up to pos[b, w] (within the
        window for sliding layers), padding, position 0 only (no keys at all would give NaN). Per
        layer type where types mix (Gemma 3), None for convolutions and linear attention."""
        keys = torch.arange(span, device=pos.device)
        seen = (keys <= pos[..., None]) & real[..., None]  # (B, W, span)
        pad = (keys == 0) & ~real[..., None]
        full = (seen | pad)[:, None]
        if self.window is None:
            return ({"full_attention": full, "conv": None, "linear_attention": None} if self.states
                    else full)
        near = (seen & (keys > pos[..., None] - self.window) | pad)[:, None]
        return ({"full_attention": full, "sliding_attention": near} if self.window_layers_only
                else near)

    def _graphed(self, step, cache):
        """The turn's decoding step as a CUDA graph (a launch per token); as is if capture fails."""
        saved = cache.snapshot()
        tokens = torch.zeros_like(cache.lengths)
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step(tokens)  # off-graph warm-up: kernels chosen, autocast's weight casts cached
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = step(tokens)
        except RuntimeError as e:
            print(f"CUDA graph capture failed ({str(e).splitlines()[0][:200]}); "
                  "decoding without graphs")
            self.cuda_graphs = False
            cache.rewind(saved)
            return step
        cache.rewind(saved)  # the warm-up counted a token per row and moved the recurrent states on

        def replay(new_tokens):
            tokens.copy_(new_tokens)
            graph.replay()
            return logits
        # the graph reads and writes buffers that only the eager step holds (its token input, its
        # one-column mask): freed, their memory could go to tensors that the graph then overwrites
        replay.eager_step = step
        return replay


# ---------------------------------------------- the update on a GPU: checkpointing, compiled layers
def enable_grad_ckpt(model, setting, device):
    """Gradient checkpointing per --grad_ckpt (auto: on a GPU for GRAD_CKPT_AUTO_PARAMS+ params)."""
    big = sum(p.numel() for p in model.parameters()) >= GRAD_CKPT_AUTO_PARAMS
    on = setting == "on" or (setting == "auto" and device.startswith("cuda") and big)
    if on:  # transformers 5.2x renamed gradient_checkpointing_enable; 5.17 has only the old name
        (getattr(model, "activation_checkpointing_enable", None)
         or model.gradient_checkpointing_enable)()
    return on


def scorer_to_train(model, args, device):
    """The common.Scorer that training calls, the model's layers checkpointed per --grad_ckpt and,
    under --fsdp, sharded over the ranks (ranks.shard; the model loaded on the CPU, so that no GPU
    holds it whole). Prints what each rank holds."""
    enable_grad_ckpt(model, args.grad_ckpt, device)
    scorer = Scorer(model)
    if args.fsdp:
        if not torch.distributed.is_initialized():
            raise SystemExit("--fsdp shards the model over torchrun's ranks: run under torchrun "
                             "(torchrun --nproc_per_node N ...), or leave --fsdp out")
        scorer = on_device(shard(scorer, device), device)
    if any(p.requires_grad for p in model.parameters()):  # not the frozen reference of --beta
        print(held_per_rank(model))
    return scorer


def compile_layers(model, setting, device, backend="inductor"):
    """Prepare the decoder layers (run compiled in compiled_layers()) and the LM head's log-softmax
    for torch.compile; returns whether on (auto: on a GPU for GRAD_CKPT_AUTO_PARAMS+ parameters).
    Under bf16 autocast their elementwise work on fp32 weights is otherwise many unfused kernels."""
    big = sum(p.numel() for p in model.parameters()) >= GRAD_CKPT_AUTO_PARAMS
    on = setting == "on" or (setting == "auto" and device.startswith("cuda") and big)
    if on:
        for layer in model.get_decoder().layers:
            layer.compiled_call = torch.compile(layer._call_impl, dynamic=True, backend=backend)
        model.compiled_head_logprobs = torch.compile(head_logprobs, dynamic=True, backend=backend)
    return on


@contextlib.contextmanager
def compiled_layers(model):
    """Within: compile_layers' layers run compiled (enter it around the forward *and* the backward,
    where checkpointing recomputes the forward); outside: eager, as rollouts need (they patch
    attention, capture CUDA graphs). The compiled LM head needs none; a failing compiler exits."""
    layers = [layer for layer in model.get_decoder().layers if hasattr(layer, "compiled_call")]
    for layer in layers:
        layer._compiled_call_impl = layer.compiled_call  # as nn.Module.compile(): __call__ uses it
    try:
        yield
    except torch._dynamo.exc.TorchDynamoException as e:  # no GPU compiler, untraceable layer, ...
        raise SystemExit("torch.compile failed on the update's layers: run with "
                         "TORCH_COMPILE_DISABLE=1 (PyTorch's switch).\n  "
                         f"({type(e).__name__}: {str(e).strip().splitlines()[0][:300]})") from e
    finally:
        for layer in layers:
            layer._compiled_call_impl = None
