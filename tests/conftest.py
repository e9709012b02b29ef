"""Shared fixtures: a tiny offline model for the rollout-engine, evaluator and trainer tests, a timed
subprocess runner for the environment tests, and `run_main`, which runs a script's command line in the test process.

Everything is offline and CPU-only: the model is a tiny random-init Llama built by `sft.build_scratch` (a BPE
tokenizer trained on scripted tic-tac-toe transcripts, ChatML template), saved with save_pretrained and loaded
back with `common.load_model` -- the same code path as a hub model.

Slow tests (throughput measurements) are marked `@pytest.mark.slow` and only run with `--runslow` (so do the compiled
updates of Qwen3.5 and Gemma 3, test_engine).
"""
import os
import shutil
import sys
from pathlib import Path

# No network, ever: set before transformers / huggingface_hub are imported by any test module.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
for _var in ("NO_PROXY", "no_proxy"):  # the local fake API server must never be reached through a proxy
    os.environ[_var] = ",".join(filter(None, [os.environ.get(_var, ""), "127.0.0.1", "localhost"]))

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# A Qwen3-style chat template: ChatML, except that assistant turns BEFORE the last user message are rendered
# without their reasoning (only the text after the last '</think>', leading newlines stripped), as Qwen3's
# template does. Re-rendering a multi-turn conversation with it therefore changes earlier turns.
QWEN3_STYLE_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

# Random init (std 0.02) makes the tiny model's greedy decoding degenerate: every reply is the same run of
# newlines whatever the context, so a padding or position bug could not change a single token. Multiplying
# every weight matrix by this factor makes the logits context-dependent (diverse replies, some ending in the
# end-of-turn token) while keeping top-1/top-2 gaps far above float noise.
SHARPEN = 20.0

# fp32 logprobs of the same tokens by two computations (another blocking, SDPA against matrix products, a cache
# against a re-encoding): each logit is about ten sums deep, each of <= 64 products rounded at 6e-8, their
# magnitudes summing to < 10 even in the sharpened models: within 10 * 64 * 6e-8 * 10 = 4e-4; a logprob (a logit
# minus a log-sum-exp) twice that. A wrong position, mask or temperature moves one by >= 1e-2.
FP32_LOGPROB_ATOL = 1e-3
# Other comparisons, each argued beside it: bf16 against exact arithmetic (rounding.py); runs summed in another
# order (float64 bounds in test_distributed, test_rl, test_sample); two formulas of a loss or a gradient
# (test_losses, test_learning). Where a test keeps pytest.approx's default (rel 1e-6) or torch.allclose's
# (rtol 1e-5, atol 1e-8), both sides are a closed form and the code's few operations on the same numbers (a
# weighted sum of rewards, a mean, a schedule): each within a few roundings (2^-53 in Python floats, 2^-24 in
# float32) of the exact value, far inside the default, while a wrong term or weight moves it by >= 1e-3.


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked @pytest.mark.slow")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a slow measurement (e.g. throughput); skipped unless --runslow")
    config.addinivalue_line("markers", "distributed: tests of torchrun's ranks (jobs of 2 gloo processes, "
                            "about 90 s in all); -m 'not distributed' leaves them out")
    # transformers 5.24 renamed the cache argument and drops the old name in 5.40: passing it fails a test here
    # rather than a user's run later (common.cache_kwarg)
    config.addinivalue_line("filterwarnings", "error:`past_key_values` is deprecated:FutureWarning")
    # pytest-xdist would hand out the files by their number of tests, which put the quick speedruns (few tests,
    # the longest file) last: in LONGEST_FIRST's order instead
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# the longest test files first: on two processes (-n 2 --dist loadfile), one left for the end keeps the other idle
LONGEST_FIRST = ["test_speedrun.py", "test_env_verifiers_v1.py", "test_engine.py", "test_env_verifiers.py",
                 "test_distributed.py", "test_rl.py", "test_guard.py", "test_sft.py"]


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: LONGEST_FIRST.index(item.path.name) if item.path.name in LONGEST_FIRST else len(LONGEST_FIRST))
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def run_main(script, argv, env_dir=None):
    """`python SCRIPT.py ARGV...` inside this test process, on one thread, with env_dir's env_*.py files found
    first; returns what it printed. Starting python with torch and transformers costs about 7-9 s of this CPU a
    run, paid here once per test process (the command lines themselves are tested in subprocesses: test_speedrun,
    test_distributed, test_sample). A failing run raises, as its process would exit non-zero."""
    import contextlib
    import importlib
    import io

    import torch
    module = importlib.import_module(script)
    saved_argv, saved_path, threads, out = sys.argv, list(sys.path), torch.get_num_threads(), io.StringIO()
    sys.argv = [f"{script}.py", *argv]
    if env_dir:
        sys.path.insert(0, env_dir)
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out):
            module.main()
    except BaseException:  # a run that stops (SystemExit, a signal) still shows what it printed
        print(out.getvalue(), end="")
        raise
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        torch.set_num_threads(threads)
        if env_dir:  # the next run's env_dir may hold another file of the same name
            for name, mod in list(sys.modules.items()):
                if name.startswith("env_") and str(getattr(mod, "__file__", "")).startswith(env_dir):
                    del sys.modules[name]
    return out.getvalue()


def play(env, example, replies):
    """(what the environment said: its first message, then after each reply; rewards, metrics) of one episode given
    its replies (the ones left after its end are not given)."""
    state, first = env.reset(example)
    said = [first]
    for reply in replies:
        said.append(env.step(state, reply))
        if said[-1] is None:
            break
    return said, env.rewards(state), env.metrics(state)


def uv_venv(venv, distribution, version):
    """The interpreter of `venv` with distribution==version installed: the venv made with uv (requirements-test.txt)
    the first time, then reused; a lock keeps two test processes from making it at once. CalledProcessError where
    uv cannot install it."""
    import fcntl
    import subprocess
    import tempfile
    python = venv / "bin" / "python"
    check = f"import importlib.metadata as m; assert m.version({distribution!r}) == {version!r}"
    with open(os.path.join(tempfile.gettempdir(), f"rlenvs-{venv.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (python.exists() and subprocess.run([str(python), "-c", check], capture_output=True).returncode == 0):
            uv = [sys.executable, "-m", "uv"]
            subprocess.run(uv + ["venv", "-q", "--allow-existing", str(venv)], check=True)
            subprocess.run(uv + ["pip", "install", "-q", "--python", str(python), f"{distribution}=={version}"],
                           check=True)
    return str(python)


def poison_loss(monkeypatch, module, name, clean_calls):
    """module.name, a function returning (loss, ...), returns a NaN loss after its first
    clean_calls calls: the trainer's non-finite update, planted."""
    real, calls = getattr(module, name), []

    def poisoned(*a, **kw):
        loss, *rest = real(*a, **kw)
        calls.append(1)
        return (loss * (float("nan") if len(calls) > clean_calls else 1.0), *rest)
    monkeypatch.setattr(module, name, poisoned)


@pytest.fixture
def torch_single_thread():
    """One intra-op thread for the duration of a test: the tiny model is latency-bound, and with 2+ threads
    on a shared 2-core machine every small matmul waits on a thread barrier (10-50x slower). Restored after."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def ttt_env():
    import common
    return common.load_env("tictactoe")


@pytest.fixture(scope="session")
def short_env():
    """Tic-tac-toe cut off after 3 model turns: keeps trajectories of a random model (invalid moves) short."""
    import common
    return common.load_env("tictactoe", {"max_turns": 3})


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny scratch model (vocab 300, d_model 32, 2 layers) saved with save_pretrained; returns its path."""
    import common
    import sft
    out = str(tmp_path_factory.mktemp("tiny_model"))
    env = common.load_env("tictactoe")
    sft.build_scratch(out, env, vocab_size=300, d_model=32, n_layers=2, n_heads=2, n_games=200)
    return out


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    """(model, tokenizer) loaded back from tiny_model_dir with common.load_model, on CPU."""
    import common
    return common.load_model(tiny_model_dir, device="cpu")


def _saved_variant(src, out, change):
    """Load the model in `src`, apply change(model, tokenizer) in place, save both to `out` like any model."""
    import common
    model, tok = common.load_model(src, device="cpu")
    change(model, tok)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="session")
def sharp_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with every weight matrix multiplied by SHARPEN (see above), saved like any model."""
    import torch

    def sharpen(model, tok):
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.mul_(SHARPEN)
    return _saved_variant(tiny_model_dir, tmp_path_factory.mktemp("sharp_model"), sharpen)


@pytest.fixture(scope="session")
def sharp_model(sharp_model_dir):
    import common
    return common.load_model(sharp_model_dir, device="cpu")


@pytest.fixture(scope="session")
def f64_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model in float64, which it keeps when loaded (common.weights_dtype): runs that sum
    in another order (ranks against one process, batch shapes) differ by float64's rounding."""
    def widen(model, tok):
        model.double()
    return _saved_variant(tiny_model_dir, tmp_path_factory.mktemp("f64_model"), widen)


@pytest.fixture(scope="session")
def qwen3_model_dir(tiny_model_dir, tmp_path_factory):
    """Same weights and tokenizer as tiny_model_dir, chat template replaced by QWEN3_STYLE_TEMPLATE."""
    def use_qwen3_template(model, tok):
        tok.chat_template = QWEN3_STYLE_TEMPLATE
    return _saved_variant(tiny_model_dir, tmp_path_factory.mktemp("qwen3_style_model"), use_qwen3_template)


@pytest.fixture(scope="session")
def qwen3_model(qwen3_model_dir):
    import common
    return common.load_model(qwen3_model_dir, device="cpu")


@pytest.fixture
def no_template_model_dir(tiny_model_dir, tmp_path):
    """A copy of tiny_model_dir whose tokenizer has no chat template at all."""
    import json
    out = tmp_path / "no_template"
    shutil.copytree(tiny_model_dir, out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    (out / "chat_template.json").unlink(missing_ok=True)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    return str(out)


@pytest.fixture
def run_python_within():
    """run(script, seconds, what): run `script` in a fresh interpreter (repo root as argv[1]); fail the test,
    naming `what`, if it takes longer than `seconds` or exits non-zero; return the finished process."""
    import subprocess

    def run(script, seconds, what):
        try:
            proc = subprocess.run([sys.executable, "-c", script, str(ROOT)], capture_output=True, text=True, timeout=seconds)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{what} took over {seconds} s")
        assert proc.returncode == 0, proc.stderr
        return proc
    return run


@pytest.fixture(scope="session")
def vf04_python():
    """The interpreter of a venv with verifiers 0.4.0, for v1 environments (the two generations cannot share one
    installation): .venv-vf04, made once (tests/test_env_verifiers_v1.py, test_real_server.py)."""
    return uv_venv(ROOT / ".venv-vf04", "verifiers", "0.4.0")
