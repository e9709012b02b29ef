"""torchrun on this CPU: two processes on the gloo backend against one process, same global batch; data parallel
(every rank holds the whole model) and --fsdp (each rank holds half of every weight, its gradient and AdamW moments).

Each rank rolls out its share of a step's groups and the gradients are summed over the ranks, so two ranks must
train the same weights as one process (up to float rounding: the sums are split differently), log the same
metrics, resume from a checkpoint written by any number of ranks, and leave only rank 0's files (and, with
--fsdp, one optimizer part per rank)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import run_main
from test_rl import DIGITS_ENV, train_lines

# torchrun jobs, each bounded twice: DIST_TIMEOUT for a rank left waiting, a subprocess timeout for the job
pytestmark = pytest.mark.distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# rl.py on an environment where a tiny random model gets varied rewards (so every step has a gradient), 4 groups of 4
RL = ["rl.py", "--env", "digits", "--batch", "16", "--group", "4", "--max_new_tokens", "6", "--lr", "1e-2", "--warmup", "1",
      "--eval_every", "0", "--eval_n", "2", "--save_every", "2", "--temp", "1.5", "--device", "cpu"]
# and on tic-tac-toe with the exploiter: rank 0 certifies the greedy policy, every rank replays its lines
EXPLOIT = ["--env", "tictactoe", "--env_args", '{"max_turns": 3, "show_cells": true}', "--exploit", "2"]
SFT = ["sft.py", "--model", "scratch", "--n_games", "40", "--vocab_size", "300", "--d_model", "32", "--n_layers", "2",
       "--n_heads", "2", "--max_steps", "4", "--batch", "5", "--eval_every", "0", "--eval_n", "2", "--save_every", "2",
       "--device", "cpu"]


def launch(argv, ranks, env_dir=None, timeout=300, dist_timeout=120):
    """`python SCRIPT ...` (ranks 0) or `torchrun --nproc_per_node RANKS SCRIPT ...`; returns the finished process."""
    if ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), *argv]
    else:
        cmd = [sys.executable, *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": env_dir or "", "DIST_TIMEOUT": str(dist_timeout)}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)


def run(argv, ranks, env_dir=None):
    """`torchrun` with RANKS processes, or for 0 ranks SCRIPT's main() in this test process: one process, no
    process group."""
    if not ranks:
        return run_main(argv[0].removesuffix(".py"), argv[1:], env_dir)
    res = launch(argv, ranks, env_dir)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def weights(out):
    from safetensors.torch import load_file
    return load_file(os.path.join(out, "model.safetensors"))


def assert_same_run(a, b, exact=False, atol=1e-5):
    """The runs in directories a and b logged the same steps and metrics and ended with the same weights."""
    rows_a, rows_b = train_lines(a), train_lines(b)
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b]
    for ra, rb in zip(rows_a, rows_b):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-4, abs=1e-6), (ra["step"], k)
    wa, wb = weights(a), weights(b)
    for k in wa:
        if exact:
            assert torch.equal(wa[k], wb[k]), k
        else:
            torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=atol)


def certificates(out):
    return [{k: v for k, v in r.items() if k != "exploit_s"} for r in map(json.loads, open(os.path.join(out, "metrics.jsonl")))
            if "exploit_lines_lost" in r]


def test_rl_two_ranks_sharded_then_data_parallel_train_as_one_process(tiny_model_dir, tmp_path):
    """Two --fsdp ranks for two steps, resumed by two data-parallel ranks for two more: the run of one process.
    With what touches the weights outside the update too: the no-grad pass of --ppo_epochs 2, gradient
    checkpointing, micro-batches of a small --token_budget (episodes of advantage 0 are left out, so a rank may
    have fewer: it runs empty ones), evaluation on rank 0 (on the gathered weights, through generate(), which
    must not wait for the other ranks after each token). The FSDP checkpoint is an ordinary one, its optimizer
    state in one part per rank; one process resumes one in the SIGTERM test below, with the reference model
    (--beta) sharded too. The other tests' runs use the fast engine."""
    from transformers import AutoModelForCausalLM
    (tmp_path / "env_digits.py").write_text(DIGITS_ENV)
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    base = RL + ["--model", tiny_model_dir, "--ppo_epochs", "2", "--grad_ckpt", "on", "--token_budget", "40",
                 "--eval_every", "2", "--engine", "hf"]
    run(base + ["--steps", "4", "--out", one], 0, str(tmp_path))  # the reference: one process
    assert all(r["grad_norm"] > 0 for r in train_lines(one)[1:]), "the reference run has steps without a gradient"
    out = run(base + ["--steps", "2", "--out", two, "--fsdp"], 2, str(tmp_path))
    assert out.count("step 2 | reward") == 1, "only rank 0 prints"
    assert "held per rank: " in out and "(50% of the model's;" in out
    assert sorted(os.listdir(two)) == sorted(os.listdir(one) + ["optimizer.rank0.pt", "optimizer.rank1.pt"])
    assert [r["step"] for r in train_lines(two)] == [1, 2]
    AutoModelForCausalLM.from_pretrained(two)  # an ordinary checkpoint, for one process
    run(base + ["--steps", "4", "--out", two, "--resume"], 2, str(tmp_path))
    assert_same_run(one, two)
    assert sorted(os.listdir(one)) == sorted(os.listdir(two)), "only rank 0 wrote, as one process"


def test_fsdp_needs_torchrun(tiny_model_dir, tmp_path):
    with pytest.raises(SystemExit, match="--fsdp shards the model over torchrun's ranks"):
        run(RL + ["--model", tiny_model_dir, "--env", "tictactoe", "--fsdp", "--out", str(tmp_path)], 0)


def test_rl_exploiter_under_two_ranks_and_one_process_resumed_into_two(tiny_model_dir, tmp_path):
    """The one-process checkpoint resumed by two ranks with --fsdp: each takes its half of the optimizer state."""
    one, crossed = str(tmp_path / "one"), str(tmp_path / "crossed")
    base = RL + ["--model", tiny_model_dir] + EXPLOIT
    run(base + ["--steps", "4", "--out", one], 0)
    run(base + ["--steps", "2", "--out", crossed], 0)
    run(base + ["--steps", "4", "--out", crossed, "--resume", "--fsdp"], 2)
    assert_same_run(one, crossed)
    # rank 0 certified the same policies at steps 0, 2, 4 (the 2-step run's final certificate, at step 2, gave the
    # resumed run its replays: not run again)
    assert [c["step"] for c in certificates(crossed)] == [0, 2, 4]
    assert certificates(one) == certificates(crossed)
    assert sorted(os.listdir(one + "_best")) == sorted(os.listdir(crossed + "_best"))
    assert json.load(open(one + "_best/exploit.json")) == json.load(open(crossed + "_best/exploit.json"))


def test_sft_two_ranks_train_as_one_process(tmp_path):
    """--batch 5 over 2 ranks (3 + 2 conversations): the loss is divided by the whole batch's tokens on every rank.
    With --fsdp, and micro-batches of a small --token_budget: a rank with fewer runs empty ones."""
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    run(SFT + ["--out", one, "--token_budget", "1500"], 0)
    out = run(SFT + ["--out", two, "--token_budget", "1500", "--fsdp"], 2)
    assert out.count("step 4 | loss") == 1
    rows = [[{k: v for k, v in r.items() if k not in ("tokens_per_s", "step_time")} for r in map(json.loads, open(os.path.join(d, "metrics.jsonl")))]
            for d in (one, two)]
    assert [r["step"] for r in rows[0]] == [r["step"] for r in rows[1]]
    for ra, rb in zip(*rows):
        assert ra == pytest.approx(rb, rel=1e-5)
    for k, w in weights(one).items():
        torch.testing.assert_close(w, weights(two)[k], rtol=0, atol=1e-5)
    assert sorted(os.listdir(two)) == sorted(os.listdir(one) + ["optimizer.rank0.pt", "optimizer.rank1.pt"])


HANGING_ENV = DIGITS_ENV.replace("    def examples(self, n, seed=0):\n", """    def examples(self, n, seed=0):
        import os, signal, time
        if os.environ.get("RANK") == "1":  # a rank that stops answering, as if stuck in C code: torchrun's
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # SIGTERM, once rank 0 has failed, ends it at once
            time.sleep(600)
""")


def test_a_rank_that_stops_answering_stops_the_others(tiny_model_dir, tmp_path):
    (tmp_path / "env_digits.py").write_text(HANGING_ENV)
    argv = ["rl.py", "--model", tiny_model_dir, "--env", "digits", "--batch", "8", "--group", "4", "--steps", "2",
            "--max_new_tokens", "4", "--device", "cpu", "--out", str(tmp_path / "o")]
    t0 = time.time()
    res = launch(argv, 2, str(tmp_path), timeout=120, dist_timeout=5)
    assert res.returncode != 0
    assert "rank 0: another rank stopped, or did not reach the" in res.stderr and "DIST_TIMEOUT (5 s)" in res.stderr
    assert time.time() - t0 < 90


def test_the_batch_must_split_into_whole_groups_per_rank():
    import ranks
    assert ranks.my_share(8, 4, 1, 2) == (4, 8)
    with pytest.raises(SystemExit, match=r"make --batch a multiple of 2 x 4 = 8"):
        ranks.my_share(3, 4, 0, 2)


def test_alone_there_is_no_process_group():
    import ranks
    assert ranks.start_ranks("cpu", 10) == (0, 1, "cpu")
    assert not torch.distributed.is_initialized()
    assert ranks.sum_over_ranks([1.5, 2]) == [1.5, 2] and ranks.gather_from_ranks("x") == ["x"] and ranks.from_rank0(3) == 3


def test_sigterm_to_torchrun_saves_the_step_in_flight_and_one_process_resumes(tiny_model_dir, tmp_path):
    """SIGTERM to torchrun (what SLURM or Kubernetes send before SIGKILL) reaches every rank; each
    finishes the step it is in, the checkpoint is saved (--fsdp: gathered, each rank's optimizer
    part beside it), the job exits 143; one process resumes exactly."""
    (tmp_path / "env_digits.py").write_text(DIGITS_ENV)
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    base = RL + ["--model", tiny_model_dir, "--steps", "30", "--save_every", "0", "--beta", "0.1"]
    env_dir = str(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           *base, "--out", two, "--fsdp"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": env_dir, "DIST_TIMEOUT": "120"}
    job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    metrics, deadline = os.path.join(two, "metrics.jsonl"), time.time() + 240
    while not (os.path.exists(metrics) and '"step": 2' in open(metrics).read()):
        assert job.poll() is None and time.time() < deadline, job.stdout.read()[-3000:]
        time.sleep(0.2)
    job.send_signal(signal.SIGTERM)
    said = job.communicate(timeout=120)[0]
    assert job.returncode != 0 and "stopped by SIGTERM: the checkpoint of step" in said, said[-3000:]
    step = torch.load(os.path.join(two, "trainer_state.pt"), weights_only=False)["step"]
    assert 2 <= step < 30 and [r["step"] for r in train_lines(two)] == list(range(1, step + 1))
    run(base + ["--out", one], 0, env_dir)
    run(base + ["--out", two, "--resume"], 0, env_dir)
    # two ranks' gradient sums against one process's: the weights differ by rounding, up to 1.03e-5 on
    # an AMD EPYC (its kernels round otherwise than the CPU this bound was first set on)
    assert_same_run(one, two, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "gemma3", "lfm2", "qwen3_5"])
def test_fsdp_on_each_architecture(name, tiny_model_dir, tmp_path):
    """Two --fsdp ranks against one process on each architecture's tiny model (sliding windows, convolutions,
    linear attention; tied and untied heads): the same metrics and weights after two steps (--runslow)."""
    from test_engine import save_arch_model
    model_dir = str(tmp_path / name)
    save_arch_model(name, tiny_model_dir, model_dir, sharpen=False)
    (tmp_path / "env_digits.py").write_text(DIGITS_ENV)
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    base = RL + ["--model", model_dir, "--steps", "2", "--save_every", "0"]
    run(base + ["--out", one], 0, str(tmp_path))
    run(base + ["--out", two, "--fsdp"], 2, str(tmp_path))
    assert_same_run(one, two, atol=5e-5)  # lr 1e-2: the sums' rounding, split over ranks, moves weights more
