"""
Several processes (torchrun) for sft.py and rl.py: one process per GPU, each holding the whole model and optimizer and
working on its share of each step's batch, the gradients summed over the ranks before an identical optimizer step
everywhere (docs/DISTRIBUTED.md). Launched without torchrun there is no process group, and each function does nothing.
"""
import contextlib
import os

import torch

# under torchrun: seconds a rank waits for the others (at a gradient all-reduce, or while rank 0 evaluates, saves or plays
# teacher games) before it stops with an error instead of hanging
DIST_TIMEOUT_S = float(os.environ.get("DIST_TIMEOUT", 1800))


def start_ranks(device, timeout_s=DIST_TIMEOUT_S):
    """(rank, world size, device) of this process. Under torchrun: join the process group (NCCL on GPUs, gloo on
    CPU) and take the GPU of LOCAL_RANK; alone: (0, 1, device)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1, device
    import datetime
    import torch.distributed as dist
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if device.startswith("cuda"):
        if ":" in device:
            raise SystemExit(f"--device {device}: under torchrun each rank takes the GPU of its LOCAL_RANK; use --device auto or cuda")
        if local >= torch.cuda.device_count():
            raise SystemExit(f"rank {rank} (LOCAL_RANK {local}) has no GPU: this node has {torch.cuda.device_count()}; "
                             "start at most that many processes per node (torchrun --nproc_per_node)")
        device = f"cuda:{local}"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world, device


def my_share(n_examples, group, rank, world):
    """(first, end): the step's examples this rank rolls out, whole groups, the same number on every rank."""
    if n_examples % world:
        raise SystemExit(f"--batch {n_examples * group} is {n_examples} examples x --group {group}: that cannot be split "
                         f"evenly over {world} ranks in whole groups; make --batch a multiple of {world} x {group} = {world * group}")
    return rank * n_examples // world, (rank + 1) * n_examples // world


def stop_ranks():
    """The end of a run: every rank waits for rank 0's last evaluation and save, then leaves the process group
    together (a rank that left while another still used the group could abort it)."""
    if _distributed():
        wait_for_rank0("end of the run")
        torch.distributed.destroy_process_group()


def _distributed():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@contextlib.contextmanager
def _together(what):
    """A collective call: a rank that died or fell more than DIST_TIMEOUT seconds behind ends it with one clear line."""
    try:
        yield
    except (RuntimeError, torch.distributed.DistError) as e:
        raise SystemExit(f"rank {torch.distributed.get_rank()}: another rank stopped, or did not reach the {what} within "
                         f"DIST_TIMEOUT ({DIST_TIMEOUT_S:g} s): stopping too (the first error above, from the rank that failed, "
                         f"says why; raise the environment variable DIST_TIMEOUT if rank 0 was only busy evaluating or saving).\n  ({str(e).splitlines()[0][:300]})") from None


def sum_over_ranks(values):
    """[sum over the ranks of each number in `values`] (the values themselves when alone)."""
    if not _distributed():
        return list(values)
    nccl = torch.distributed.get_backend() == "nccl"
    t = torch.tensor(values, dtype=torch.float64, device=f"cuda:{torch.cuda.current_device()}" if nccl else "cpu")
    with _together("sum of step statistics"):
        torch.distributed.all_reduce(t)
    return t.tolist()


def sum_gradients(model):
    """Sum every parameter's gradient over the ranks, in place. Each rank's loss was already divided by the whole
    batch's normaliser, so the sum is the gradient of the whole batch, the one a single process computes. (An
    explicit all-reduce rather than DistributedDataParallel: the model is also the rollouts' sampler, which must
    see it unwrapped, and an RL step spends its time in the rollouts, not here.)"""
    if not _distributed():
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:  # a rank with no trained episode this step: it adds zeros
            p.grad = torch.zeros_like(p)
    with _together("gradient all-reduce"):
        for p in params:
            torch.distributed.all_reduce(p.grad)


def gather_from_ranks(obj):
    """[obj of rank 0, obj of rank 1, ...] on every rank ([obj] alone): small Python objects only."""
    if not _distributed():
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    with _together("gathering of the step's results"):
        torch.distributed.all_gather_object(out, obj)
    return out


def from_rank0(obj):
    """Rank 0's obj, on every rank (obj itself alone)."""
    if not _distributed():
        return obj
    box = [obj]
    with _together("message from rank 0"):
        torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def check_ranks_agree(model):
    """Stop, on every rank, if the ranks' weights are not all the same (which summed gradients and identical optimizer
    steps guarantee, so a difference means a bug or a non-deterministic kernel; a checkpoint would hold rank 0's)."""
    if not _distributed():
        return
    fingerprint = [sum(float(p.detach().double().abs().sum()) for p in model.parameters()),
                   sum(float(p.detach().double().sum()) for p in model.parameters())]
    prints = gather_from_ranks(fingerprint)
    if any(f != prints[0] for f in prints):
        raise SystemExit(f"the ranks' weights differ (fingerprints {prints}): a rank's update was not the others'")


def wait_for_rank0(what):
    """Every rank waits here until rank 0 has done `what` (e.g. written the files the others read next)."""
    if _distributed():
        with _together(what):
            torch.distributed.barrier()
