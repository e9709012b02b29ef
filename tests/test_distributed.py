"""torchrun on this CPU: two processes on the gloo backend against one process, same global batch; data parallel
(every rank holds the whole model) and --fsdp (each rank holds half of every weight, its gradient and AdamW moments).

Each rank rolls out its share of a step's groups and the gradients are summed over the ranks, so two ranks must
train the same weights as one process (up to float rounding: the sums are split differently), log the same
metrics, resume from a checkpoint written by any number of ranks, and leave only rank 0's files (and, with
--fsdp, one optimizer part per rank)."""
import json
import os
import shutil
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


# How two runs are compared. Where they follow the same schedule (the same ranks, the same
# resumes), exactly. Where one splits a step's sums over two ranks and the other does not, over
# ONE step from the same checkpoint, in float64 (f64_model_dir), within STEP_ATOL; never over
# several: AdamW divides by sqrt(v) + eps, so a rounding difference in a near-zero gradient grows
# by up to lr/eps a step (float64's 1e-16 became 6e-7 over 30 steps here), and no bound on it
# stays small.
#
# STEP_ATOL, derived. From identical weights, optimizer state and sampled tokens, the two
# gradients are the same products summed in another order. In float64 (unit roundoff 1.1e-16)
# a sum of n terms moves by at most n * 1.1e-16 * sum|terms|: with n < 1e4 products per weight
# here and sum|terms| of the order of the gradient norm (< 10), by < 1.1e-11. AdamW's update
# lr * m_hat / (sqrt(v_hat) + eps) moves by at most 2 * lr / eps times that (its derivative in
# the gradient, from the same m and v): 2 * 1e-2 / 1e-8 * 1.1e-11 = 2.2e-5. So 5e-5. One rank's
# gradient dropped once (planted by hand) moves the weights by about lr = 1e-2.
STEP_ATOL = 5e-5
# The logged numbers of that step: float64 sums in another order (rel 1e-9, for the same reason,
# with no AdamW in between), and the sampler's logprobs, kept in float32 (abs 1e-6: one float32
# rounding of a logprob of magnitude < 8 is 2 ** -23 * 8 < 1e-6).
STEP_REL, STEP_ABS = 1e-9, 1e-6


def assert_same_run(a, b, exact=True):
    """The runs in directories a and b logged the same steps and metrics and ended with the same
    weights: exactly, or (exact=False) for runs one step apart in schedule, within the bounds above."""
    rows_a, rows_b = train_lines(a), train_lines(b)
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b]
    for ra, rb in zip(rows_a, rows_b):
        assert ra.keys() == rb.keys()
        assert ra == rb if exact else ra == pytest.approx(rb, rel=STEP_REL, abs=STEP_ABS), ra["step"]
    wa, wb = weights(a), weights(b)
    for k in wa:
        if exact:
            assert torch.equal(wa[k], wb[k]), k
        else:
            torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=STEP_ATOL)


def one_step_each_way(checkpoint, flags, ranks, tmp_path, name, env_dir=None):
    """From `checkpoint` (a run's directory, at step S), step S + 1 by one process and by `ranks`
    torchrun processes (flags(out, steps, ranks): the command line), each from its own copy;
    asserts they agree (the bounds above); returns the two directories (one process's, the
    ranks') and what the ranks printed."""
    one, many = str(tmp_path / f"{name}_one"), str(tmp_path / f"{name}_ranks")
    step = torch.load(os.path.join(checkpoint, "trainer_state.pt"), weights_only=False)["step"]
    for out, n in ((one, 0), (many, ranks)):
        shutil.copytree(checkpoint, out)
        said = run(flags(out, step + 1, n) + ["--resume"], n, env_dir)
    assert_same_run(one, many, exact=False)
    return one, many, said


def certificates(out):
    return [{k: v for k, v in r.items() if k != "exploit_s"} for r in map(json.loads, open(os.path.join(out, "metrics.jsonl")))
            if "exploit_lines_lost" in r]


def test_rl_two_ranks_sharded_then_data_parallel_train_as_one_process(f64_model_dir, tmp_path):
    """One process's checkpoint resumed for a step by two --fsdp ranks, theirs by two data-parallel
    ranks, each against one process from the same checkpoint. With what touches the weights outside
    the update too: the no-grad pass of the reference model (--beta, sharded too), gradient
    checkpointing, micro-batches of a small --token_budget (episodes of advantage 0 are left out,
    so a rank may have fewer: it runs empty ones), evaluation on rank 0 (on the gathered weights,
    through generate(), which must not wait for the other ranks after each token). The FSDP
    checkpoint is an ordinary one, its optimizer state in one part per rank. The other tests' runs
    use the fast engine."""
    from transformers import AutoModelForCausalLM
    (tmp_path / "env_digits.py").write_text(DIGITS_ENV)
    env_dir = str(tmp_path)
    base = RL + ["--model", f64_model_dir, "--beta", "0.1", "--grad_ckpt", "on", "--token_budget", "40",
                 "--eval_every", "2", "--engine", "hf"]
    flags = lambda out, steps, ranks: base + ["--steps", str(steps), "--out", out]
    start = str(tmp_path / "start")
    run(flags(start, 1, 0), 0, env_dir)
    one, sharded, said = one_step_each_way(
        start, lambda out, steps, ranks: flags(out, steps, ranks) + ["--fsdp"] * bool(ranks), 2, tmp_path, "fsdp",
        env_dir)
    assert said.count("step 2 | reward") == 1 and said.count("step 2 | eval_") == 1, "only rank 0 prints"
    assert "held per rank: " in said and "(50% of the model's;" in said
    assert all(r["grad_norm"] > 0 for r in train_lines(one)), "a step without a gradient"
    assert sorted(os.listdir(sharded)) == sorted(os.listdir(one) + ["optimizer.rank0.pt", "optimizer.rank1.pt"])
    AutoModelForCausalLM.from_pretrained(sharded)  # an ordinary checkpoint, for one process
    one, parallel, _ = one_step_each_way(sharded, flags, 2, tmp_path, "dp", env_dir)
    assert sorted(os.listdir(one)) == sorted(os.listdir(parallel)), "only rank 0 wrote, as one process"


def test_fsdp_needs_torchrun(tiny_model_dir, tmp_path):
    with pytest.raises(SystemExit, match="--fsdp shards the model over torchrun's ranks"):
        run(RL + ["--model", tiny_model_dir, "--env", "tictactoe", "--fsdp", "--out", str(tmp_path)], 0)


def test_rl_exploiter_under_two_ranks_and_one_process_resumed_into_two(f64_model_dir, tmp_path):
    """A one-process checkpoint resumed by two ranks with --fsdp (each takes its half of the
    optimizer state) for a step that certifies (rank 0 certifies the greedy policy, every rank
    replays its lines), against one process from the same checkpoint. The tiny random model scores
    every episode of this game alike (each has an invalid move): no gradient, so the weights stay
    as they were; the gradients' sums over ranks are the test above's and the SFT test's."""
    base = RL + ["--model", f64_model_dir] + EXPLOIT
    flags = lambda out, steps, ranks: base + ["--steps", str(steps), "--out", out] + ["--fsdp"] * bool(ranks)
    start = str(tmp_path / "start")
    run(flags(start, 2, 0), 0)  # certificates at steps 0 and 2; step 3 replays step 2's lines
    one, crossed, _ = one_step_each_way(start, flags, 2, tmp_path, "crossed")
    # one process certified at steps 0 and 2 (the 2-step run's final certificate gave the resumed
    # step its replays: not run again), rank 0 at step 3, the run's end: the same policy's verdict
    assert [c["step"] for c in certificates(crossed)] == [0, 2, 3]
    assert certificates(one) == certificates(crossed)
    assert sorted(os.listdir(one + "_best")) == sorted(os.listdir(crossed + "_best"))
    assert json.load(open(one + "_best/exploit.json")) == json.load(open(crossed + "_best/exploit.json"))


def test_sft_two_ranks_train_as_one_process(f64_model_dir, tmp_path):
    """--batch 5 over 2 ranks (3 + 2 conversations): the loss is divided by the whole batch's tokens on every rank.
    With --fsdp, and micro-batches of a small --token_budget: a rank with fewer runs empty ones. One step of
    each from the same checkpoint."""
    start = str(tmp_path / "start")
    flags = lambda out, steps, ranks: SFT + ["--model", f64_model_dir, "--max_steps", str(steps), "--out", out,
                                             "--token_budget", "1500"] + ["--fsdp"] * bool(ranks)
    run(flags(start, 2, 0), 0)
    one, two = str(tmp_path / "one"), str(tmp_path / "ranks")
    for out, n in ((one, 0), (two, 2)):
        shutil.copytree(start, out)
        said = run(flags(out, 3, n) + ["--resume"], n)
    assert said.count("step 3 | loss") == 1
    rows = [[{k: v for k, v in r.items() if k not in ("tokens_per_s", "step_time")} for r in map(json.loads, open(os.path.join(d, "metrics.jsonl")))]
            for d in (one, two)]
    assert [r["step"] for r in rows[0]] == [r["step"] for r in rows[1]] and rows[0][-1]["step"] == 3
    for ra, rb in zip(*rows):
        assert ra == pytest.approx(rb, rel=STEP_REL, abs=STEP_ABS)
    for k, w in weights(one).items():
        torch.testing.assert_close(w, weights(two)[k], rtol=0, atol=STEP_ATOL)
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


# rank 0 sends SIGTERM to torchrun (its parent) from inside step 1's rollouts: the step in flight
# is always step 1, whatever the machine's speed
SIGTERM_ENV = DIGITS_ENV.replace("    def examples(self, n, seed=0):\n", """    def examples(self, n, seed=0):
        import os, signal
        if os.environ.get("RANK") == "0" and not getattr(self, "signalled", False):
            self.signalled = True
            os.kill(os.getppid(), signal.SIGTERM)
""")


def test_sigterm_to_torchrun_saves_the_step_in_flight_and_one_process_resumes(f64_model_dir, tmp_path):
    """SIGTERM to torchrun (what SLURM or Kubernetes send before SIGKILL) reaches every rank; each
    finishes the step it is in, the checkpoint is saved (--fsdp: gathered, each rank's optimizer
    part beside it), the job exits 143; one process resumes it. The checkpoint against one
    process's run of the same step (the bounds above)."""
    (tmp_path / "env_digits.py").write_text(SIGTERM_ENV)
    env_dir = str(tmp_path)
    base = RL + ["--model", f64_model_dir, "--save_every", "0", "--beta", "0.1"]
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    res = launch(base + ["--steps", "30", "--out", two, "--fsdp"], 2, env_dir)
    said = res.stdout + res.stderr
    assert res.returncode != 0 and "stopped by SIGTERM: the checkpoint of step 1" in said, said[-3000:]
    assert torch.load(os.path.join(two, "trainer_state.pt"), weights_only=False)["step"] == 1
    assert {"optimizer.rank0.pt", "optimizer.rank1.pt"} <= set(os.listdir(two))
    (tmp_path / "env_digits.py").write_text(DIGITS_ENV)
    run(base + ["--steps", "1", "--out", one], 0, env_dir)
    assert_same_run(one, two, exact=False)
    run(base + ["--steps", "2", "--out", two, "--resume"], 0, env_dir)
    assert [r["step"] for r in train_lines(two)] == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "gemma3", "lfm2", "qwen3_5"])
def test_fsdp_on_each_architecture(name, tiny_model_dir, tmp_path):
    """Two --fsdp ranks against one process on each architecture's tiny model (sliding windows, convolutions,
    linear attention; tied and untied heads), in float64: the same metrics and weights after a step from the same
    checkpoint (--runslow)."""
    from test_engine import save_arch_model
    model_dir = str(tmp_path / name)
    save_arch_model(name, tiny_model_dir, model_dir, sharpen=False, dtype=torch.float64)
    (tmp_path / "env_digits.py").write_text(DIGITS_ENV)
    start = str(tmp_path / "start")
    run(RL + ["--model", model_dir, "--steps", "1", "--save_every", "1", "--out", start], 0, str(tmp_path))
    one_step_each_way(start, lambda out, steps, ranks: RL + ["--model", model_dir, "--steps", str(steps), "--out", out]
                      + ["--fsdp"] * bool(ranks), 2, tmp_path, "arch", str(tmp_path))
