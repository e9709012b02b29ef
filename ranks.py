"""Several processes (torchrun) for sft.py and rl.py, one per GPU, each with the whole model and
optimizer and its share of each step's batch, the gradients summed over the ranks before identical
optimizer steps everywhere (docs/DISTRIBUTED.md). Without torchrun each function does nothing."""
import contextlib
import os

import torch

# seconds a rank waits for the others (e.g. rank 0 evaluating or saving) before it fails, not hangs
DIST_TIMEOUT_S = float(os.environ.get("DIST_TIMEOUT", 1800))


def start_ranks(device, timeout_s=DIST_TIMEOUT_S):
    """(rank, world size, device); under torchrun, in the process group, on LOCAL_RANK's GPU."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1, device
    import datetime
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if device.startswith("cuda"):
        if ":" in device:
            raise SystemExit(f"--device {device}: under torchrun each rank takes the GPU of its "
                             "LOCAL_RANK; use --device auto or cuda")
        if local >= torch.cuda.device_count():
            raise SystemExit(f"rank {rank} (LOCAL_RANK {local}) has no GPU: this node has "
                             f"{torch.cuda.device_count()}; start at most that many processes "
                             "per node (torchrun --nproc_per_node)")
        device = f"cuda:{local}"
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                                         timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world, device


def my_share(n_examples, group, rank, world):
    """(first, end): the step's examples this rank rolls out, whole groups, as many per rank."""
    if n_examples % world:
        raise SystemExit(f"--batch {n_examples * group} is {n_examples} examples x --group "
                         f"{group}: that cannot be split evenly over {world} ranks in whole "
                         f"groups; make --batch a multiple of {world} x {group} = {world * group}")
    return rank * n_examples // world, (rank + 1) * n_examples // world


def stop_ranks():
    """End of a run: all ranks wait for rank 0's last save (leaving a group in use can abort it)."""
    if _distributed():
        wait_for_rank0("end of the run")
        torch.distributed.destroy_process_group()


def _distributed():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@contextlib.contextmanager
def _together(what):
    try:
        yield
    except (RuntimeError, torch.distributed.DistError) as e:
        raise SystemExit(
            f"rank {torch.distributed.get_rank()}: another rank stopped, or did not reach the "
            f"{what} within DIST_TIMEOUT ({DIST_TIMEOUT_S:g} s): stopping too (the first error "
            "above, from the rank that failed, says why; raise the environment variable "
            "DIST_TIMEOUT if rank 0 was only busy evaluating or saving).\n  "
            f"({str(e).splitlines()[0][:300]})") from None


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
    """Sum each gradient over the ranks in place (each loss used the whole batch's normaliser)."""
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
    """[obj of rank 0, obj of rank 1, ...] on every rank ([obj] alone): small Python objects."""
    if not _distributed():
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    with _together("gathering of the step's results"):
        torch.distributed.all_gather_object(out, obj)
    return out


def from_rank0(obj):
    if not _distributed():
        return obj
    box = [obj]
    with _together("message from rank 0"):
        torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def check_ranks_agree(model):
    """Stop on every rank if the ranks' weights differ: a bug or a non-deterministic kernel."""
    if not _distributed():
        return
    fingerprint = [sum(float(p.detach().double().abs().sum()) for p in model.parameters()),
                   sum(float(p.detach().double().sum()) for p in model.parameters())]
    prints = gather_from_ranks(fingerprint)
    if any(f != prints[0] for f in prints):
        raise SystemExit(f"the ranks' weights differ (fingerprints {prints}): a rank's update was not the others'")


def wait_for_rank0(what):
    """Every rank waits here until rank 0 has done `what` (e.g. written what the others read)."""
    if _distributed():
        with _together(what):
            torch.distributed.barrier()
