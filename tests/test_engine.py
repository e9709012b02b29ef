"""The two rollout engines on tiny random models of the real architectures our users train: Llama, Qwen3, Gemma 3
(sliding window on alternate layers), LFM2 (short convolutions) and Qwen3.5 (linear attention), each built offline
from transformers' config classes, saved with save_pretrained and a chat template of its family, and loaded back
with common.load_model like a hub model.

Each must be token-exact (greedy tokens are the argmax of an unpadded forward over the whole trajectory) and
logprob-exact (at the sampling temperature) on both engines; all five run on the fast engine's RowCache (LFM2's and
Qwen3.5's recurrent states in its rows too), whose rollouts must be generate()'s (the reference engine's).
"""
import contextlib

import pytest
import torch

import common
import engine
from engine import FastEngine
from env_tictactoe import branch
from sample import HFPolicy, new_episode, rollout
from sft import CHATML
from conftest import FP32_LOGPROB_ATOL, QWEN3_STYLE_TEMPLATE, SHARPEN
from test_sample import check_layout, replay_logits

pytestmark = pytest.mark.usefixtures("torch_single_thread")

NL = "{{ '\\n' }}"
CHATML_LFM2 = ("{{ '<|startoftext|>' }}{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
               "'<|im_end|>\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")
GEMMA3 = ("{%- set ns = namespace(system='') -%}{{ '<bos>' }}"
          "{%- for m in messages -%}"
          "{%- if m['role'] == 'system' -%}{%- set ns.system = m['content'] + '\\n\\n' -%}"
          "{%- else -%}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\\n' + ns.system + "
          "m['content'] + '<end_of_turn>\\n' }}{%- set ns.system = '' -%}{%- endif -%}"
          "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}")

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
# name: (model_type, config, chat template, tokens the template adds, runs on the RowCache, factor on the weight
# matrices that makes greedy replies depend on the context: conftest.SHARPEN where it does, less where SHARPEN
# saturates the model into repeating one token)
ARCHS = {
    "llama": ("llama", dict(head_dim=8), CHATML, [], True, SHARPEN),
    "qwen3": ("qwen3", dict(head_dim=8), QWEN3_STYLE_TEMPLATE, [], True, SHARPEN),
    "gemma3": ("gemma3_text", dict(head_dim=8, sliding_window=8, query_pre_attn_scalar=8,
                                   layer_types=["sliding_attention", "full_attention"] * 2),
               GEMMA3, ["<bos>", "<start_of_turn>", "<end_of_turn>"], True, 5.0),
    "lfm2": ("lfm2", dict(full_attn_idxs=[1, 3], block_auto_adjust_ff_dim=False), CHATML_LFM2, ["<|startoftext|>"], True,
             SHARPEN),
    "qwen3_5": ("qwen3_5_text", dict(head_dim=8, layer_types=["linear_attention", "full_attention"] * 2,
                                     linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                                     linear_num_value_heads=4), QWEN3_STYLE_TEMPLATE, [], True, 5.0),
}


def save_arch_model(name, tiny_model_dir, out, sharpen=True, dtype=torch.float32):
    """A tiny random model of architecture NAME (ARCHS) with tiny_model_dir's tokenizer and the family's chat
    template, saved like a hub model in `out` (in `dtype`); sharpen: its weight matrices scaled by ARCHS' factor."""
    from transformers import AutoConfig, AutoModelForCausalLM
    model_type, kw, template, added, _, factor = ARCHS[name]
    _, tok = common.load_model(tiny_model_dir, device="cpu")
    if added:
        tok.add_special_tokens({"additional_special_tokens": added})
    tok.chat_template = template
    config = AutoConfig.for_model(model_type, **SMALL, **kw, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                  eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if sharpen:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.mul_(factor)
    model.to(dtype).save_pretrained(out)
    tok.save_pretrained(out)


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request, tiny_model_dir, tmp_path_factory):
    """(name, model, tokenizer): a tiny random model of the architecture, its weight matrices scaled so that greedy
    replies depend on the context, saved and loaded back like a hub model."""
    out = tmp_path_factory.mktemp(request.param)
    save_arch_model(request.param, tiny_model_dir, out)
    model, tok = common.load_model(str(out), device="cpu")
    return request.param, model, tok


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_greedy_rollout_is_token_exact(arch, short_env, engine):
    """Multi-turn greedy rollouts in batches of different lengths: every sampled token is the argmax of one
    unpadded forward over the whole trajectory, its logprob that forward's (the recurrent layers' chunked and
    step-by-step kernels differ by ~1e-4 in float32)."""
    name, model, tok = arch
    policy = HFPolicy(model, tok, short_env.system_prompt, temp=0.0, max_new_tokens=16, batch_size=4, engine=engine)
    assert FastEngine.fits(model) == ARCHS[name][4] and policy.engine.name == engine
    recs = rollout(short_env, short_env.examples(6, seed=1), policy, progress=False)
    replies = {tuple(t for t, m in zip(r["ids"], r["mask"]) if m) for r in recs}
    assert len(replies) >= 2, "the replies depend on the context"
    sampled = 0
    for rec in recs:
        check_layout(rec, policy.chat, tok, 16)
        logits = replay_logits(model, rec["ids"])
        logp = torch.log_softmax(logits, -1)
        for t in range(1, len(rec["ids"])):
            if rec["mask"][t]:
                sampled += 1
                pred = int(logits[t - 1].argmax())
                assert pred == rec["ids"][t] or logits[t - 1, pred] - logits[t - 1, rec["ids"][t]] < 1e-3, (name, t)
                assert abs(rec["logprobs"][t] - float(logp[t - 1, rec["ids"][t]])) < 5e-4, (name, t)
    assert sampled > 100


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_decoding_by_matmul_is_decoding_by_sdpa(arch, short_env, temp):
    """The decoding step's attention as two matrix products (a GPU's default) gives SDPA's tokens and logprobs."""
    name, model, tok = arch
    runs = {}
    for by_matmul in (False, True):
        policy = HFPolicy(model, tok, short_env.system_prompt, temp=temp, max_new_tokens=16, batch_size=4,
                          decode_by_matmul=by_matmul)
        runs[by_matmul] = rollout(short_env, short_env.examples(6, seed=2), policy, progress=False)
    for a, b in zip(runs[False], runs[True]):
        assert a["ids"] == b["ids"] and a["mask"] == b["mask"], name
        torch.testing.assert_close(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]),
                                   atol=FP32_LOGPROB_ATOL, rtol=0)


def test_compiled_update_gives_eager_gradients(arch, request):
    """The compiled update (engine.compile_layers) on every architecture the engine serves: the update's forward and backward through the compiled
    layers (inductor's decompositions and partitioner without its code generation, which would take minutes
    here), checkpointing on, give eager's logprobs and gradients. Qwen3.5's and Gemma 3's only with --runslow
    (45 s and 25 s of a 2-core CPU; Qwen3.5's linear attention is a chunked loop to trace): the compiled layer
    is Qwen3's and LFM2's otherwise, and Gemma 3's sliding window is in the mask, built outside the layers."""
    import copy
    from torch._dynamo.backends.debugging import aot_eager_decomp_partition
    name, model, _ = arch
    if name in ("qwen3_5", "gemma3") and not request.config.getoption("--runslow"):
        pytest.skip(f"slow: {name}'s compiled update takes 25-45 s to compile on a CPU; run with --runslow")
    model = copy.deepcopy(model).train()
    engine.enable_grad_ckpt(model, "on", "cpu")
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (3, 24))
    mask = torch.ones_like(ids)
    mask[:, :6] = 0

    def forward_backward(model):
        model.zero_grad()
        with engine.compiled_layers(model):
            logp, _ = common.token_logprobs(model, ids, mask, 0.8)
            logp.sum().backward()
        return [logp.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]
    truth = forward_backward(copy.deepcopy(model).double())  # eager, float64: rounding aside
    eager = forward_backward(model)
    engine.compile_layers(model, "on", "cpu", backend=aot_eager_decomp_partition)
    for t, a, b in zip(truth, eager, forward_backward(model), strict=True):
        # fp32 summed in another order: as near float64's as eager fp32 is (the two differ from
        # each other by up to twice that, 1e-5 of the largest value; compiled/eager at most 1.6)
        eager_err, compiled_err = (a - t).abs().max(), (b - t).abs().max()
        assert compiled_err <= 2 * eager_err + 1e-6 * t.abs().max().clamp(min=1), \
            (name, t.shape, float(eager_err), float(compiled_err))


def test_the_fast_engine_gives_the_reference_engines_rollouts(arch, short_env):
    """--engine fast (the RowCache, each turn encoding only what is new) gives the greedy tokens and the recorded
    logprobs of --engine hf (generate() over each trajectory, left-padded, every turn)."""
    name, model, tok = arch
    runs = {}
    for engine in ("fast", "hf"):
        policy = HFPolicy(model, tok, short_env.system_prompt, temp=0.0, max_new_tokens=16, batch_size=4, engine=engine)
        assert policy.engine.name == engine
        runs[engine] = rollout(short_env, short_env.examples(6, seed=4), policy, progress=False)
    assert [r["ids"] for r in runs["fast"]] == [r["ids"] for r in runs["hf"]], name
    assert [r["mask"] for r in runs["fast"]] == [r["mask"] for r in runs["hf"]], name
    for a, b in zip(runs["fast"], runs["hf"]):
        torch.testing.assert_close(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]),
                                   atol=FP32_LOGPROB_ATOL, rtol=0)


def reply_lengths(rec):
    """The number of tokens sampled in each turn of a trajectory (its runs of mask 1)."""
    runs = "".join(map(str, rec["mask"])).split("0")
    return [len(r) for r in runs if r]


def test_rows_that_stop_early_keep_their_state(arch, short_env):
    """A row whose reply ends before the others' keeps decoding with them (fixed shapes), and what that feeds must
    not reach its next turn: the same tokens and logprobs as generate() re-encoding every turn, with replies of different lengths in one
    turn. The tiny models end no reply on their own before the token limit, so the end of turn gets a bias in
    the LM head, the smallest of a few that gives such a turn."""
    name, model, tok = arch
    head = model.get_output_embeddings()
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
    model.set_output_embeddings(biased)
    try:
        for bias in (1.0, 2.0, 3.0, 5.0, 7.0, 9.0):
            with torch.no_grad():
                biased.bias[HFPolicy(model, tok, short_env.system_prompt).chat.eot_id] = bias
            runs = {}
            for engine in ("fast", "hf"):
                policy = HFPolicy(model, tok, short_env.system_prompt, temp=0.0, max_new_tokens=24, batch_size=6, engine=engine)
                runs[engine] = rollout(short_env, short_env.examples(6, seed=4), policy, progress=False)
            turns = [reply_lengths(r)[:-1] for r in runs["fast"]]  # tokens sampled each turn that another turn follows
            if any(len({t[i] for t in turns if len(t) > i}) > 1 for i in range(2)):
                break
        else:
            pytest.fail(f"no bias gave replies of different lengths in one turn: {turns}")
    finally:
        model.set_output_embeddings(head)
    assert [r["ids"] for r in runs["fast"]] == [r["ids"] for r in runs["hf"]]
    for a, b in zip(runs["fast"], runs["hf"]):
        torch.testing.assert_close(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]),
                                   atol=FP32_LOGPROB_ATOL, rtol=0)


def test_sampled_logprobs_are_the_tempered_model(arch, short_env):
    """At temperature 1.3 the recorded logprob of every sampled token is log softmax(logits / 1.3) of the replay.
    Three rollouts of each example in batches of 4: on the RowCache a batch encodes each prompt once and copies its
    row, and the copies must go on as episodes of their own."""
    name, model, tok = arch
    torch.manual_seed(0)
    policy = HFPolicy(model, tok, short_env.system_prompt, temp=1.3, max_new_tokens=12, batch_size=4)
    recs = rollout(short_env, short_env.examples(4, seed=6), policy, group=3, progress=False)
    replies = lambda rec: [t for t, m in zip(rec["ids"], rec["mask"]) if m]
    assert any(len({tuple(replies(r)) for r in recs[i:i + 3]}) > 1 for i in range(0, 12, 3)), "the rollouts differ"
    for rec in recs:
        want = torch.log_softmax(replay_logits(model, rec["ids"]) / 1.3, -1)
        pos = torch.tensor([t for t, m in enumerate(rec["mask"]) if m])
        got = torch.tensor(rec["logprobs"])[pos]
        torch.testing.assert_close(got, want[pos - 1, torch.tensor(rec["ids"])[pos]], atol=FP32_LOGPROB_ATOL, rtol=0)


@pytest.fixture
def cpu_streams(monkeypatch):
    """Stand-ins on this CPU for torch.cuda's streams (a graph's capture and warm-up run on side streams)."""
    class Stream:
        def wait_stream(self, other):
            pass
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())


def test_cuda_graph_keeps_the_buffers_it_reads(sharp_model, short_env, monkeypatch, cpu_streams):
    """A CUDA graph of the decoding step reads and writes, at every replay, the tensors the eager step holds (its
    token input, its mask): those must live as long as the graph, else their memory goes to other tensors while the
    graph still writes there. On this CPU the CUDA calls are stand-ins: capture runs the step once, and each replay
    checks (after a garbage collection) that every tensor of the captured step is still alive."""
    import gc
    import weakref
    model, tok = sharp_model
    captured, replays = [], []

    class Graph:
        def replay(self):
            gc.collect()
            replays.append(all(ref() is not None for ref in captured))

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: contextlib.nullcontext())
    graphed = FastEngine._graphed

    def spy(self, step, cache):
        captured[:] = [weakref.ref(c.cell_contents) for c in step.__closure__ if isinstance(c.cell_contents, torch.Tensor)]
        return graphed(self, step, cache)
    monkeypatch.setattr(FastEngine, "_graphed", spy)
    # what this process held before the engine existed is left out of the collections (each one
    # would walk the whole test process's heap); the engine and everything it makes is scanned
    gc.freeze()
    try:
        policy = HFPolicy(model, tok, short_env.system_prompt, temp=1.0, max_new_tokens=6, batch_size=4,
                          engine="fast")
        policy.engine.cuda_graphs = True  # on this CPU, with the stand-ins above
        rollout(short_env, short_env.examples(2, seed=0), policy, group=2, progress=False)
    finally:
        gc.unfreeze()
    assert len(captured) >= 2 and replays and all(replays), "a graph replayed after the eager step's buffers were freed"


def test_graphed_decoding_gives_the_eager_rollouts(arch, short_env, monkeypatch, cpu_streams):
    """The graph path around the decoding step (a warm-up step, the capture, replays into the captured output) leaves
    the rollouts exactly as the eager step gives them: the warm-up's writes are rewound (row lengths, LFM2's
    convolution states). On this CPU a stand-in graph runs the step at capture, as a real capture records it, and
    again at each replay into the captured output, as a real replay recomputes it."""
    name, model, tok = arch
    capturing = []

    class Graph:
        def replay(self):
            self.output.copy_(self.step(self.tokens))

    @contextlib.contextmanager
    def graph(g):
        capturing.append(g)
        yield
        capturing.pop()
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    graphed = FastEngine._graphed

    def recording(self, step, cache):
        def recorded(tokens):
            output = step(tokens)
            if capturing:
                capturing[-1].step, capturing[-1].tokens, capturing[-1].output = step, tokens, output
            return output
        return graphed(self, recorded, cache)
    monkeypatch.setattr(FastEngine, "_graphed", recording)
    runs = []
    for graphs in (False, True):
        policy = HFPolicy(model, tok, short_env.system_prompt, temp=1.3, max_new_tokens=12, batch_size=4, engine="fast")
        policy.engine.cuda_graphs = graphs  # on this CPU, with the stand-ins above
        runs.append(rollout(short_env, short_env.examples(4, seed=6), policy, group=3, progress=False))
    assert [(r["ids"], r["logprobs"]) for r in runs[0]] == [(r["ids"], r["logprobs"]) for r in runs[1]]


def test_copied_episodes_go_on_from_their_row(arch, short_env):
    """An episode branched mid-game (env_tictactoe.branch: the certificate branches every line over the opponent's replies)
    continues from its parent's cache row (its keys and values, and LFM2's convolution state): the same tokens and
    logprobs as generate() re-encoding every turn; the parent's trajectory is left as it was."""
    name, model, tok = arch
    runs = {}
    for engine in ("fast", "hf"):
        policy = HFPolicy(model, tok, short_env.system_prompt, temp=0.0, max_new_tokens=10, engine=engine)
        episodes = [new_episode(short_env, ex) for ex in short_env.examples(3, seed=8)]
        for _ in range(2):  # each turn, every episode branches in two: a copy gets a different message
            replies = policy(episodes)
            children = []
            for ep, reply in zip(episodes, replies):
                for k in range(2):
                    child = branch(ep)
                    child["messages"].append({"role": "assistant", "content": reply})
                    child["messages"].append({"role": "user", "content": f"branch {k}: your move"})
                    children.append(child)
            parents, episodes = episodes, children
        kept = [(len(ep["ids"]), len(ep["messages"])) for ep in parents]
        policy(episodes)
        assert [(len(ep["ids"]), len(ep["messages"])) for ep in parents] == kept
        runs[engine] = episodes
        if engine == "fast":
            assert len({id(ep["kv"]) for ep in episodes}) == 1
    assert [ep["ids"] for ep in runs["fast"]] == [ep["ids"] for ep in runs["hf"]]
    assert len({tuple(ep["ids"]) for ep in runs["fast"]}) > 6, "the branches went different ways"
    for a, b in zip(runs["fast"], runs["hf"]):
        torch.testing.assert_close(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]),
                                   atol=FP32_LOGPROB_ATOL, rtol=0)
