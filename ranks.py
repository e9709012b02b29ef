"""Several processes (torchrun) for sft.py and rl.py, one per GPU, each with its share of each
step's batch. Data parallel by default: every rank holds the whole model and optimizer, the
gradients are summed over the ranks before identical optimizer steps everywhere. --fsdp (shard)
splits the weights, gradients and optimizer state over the ranks instead (docs/DISTRIBUTED.md).
Without torchrun each function does nothing."""
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
    if not _distributed() or is_sharded(model):  # --fsdp's backward summed them already
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
    if not _distributed() or is_sharded(model):  # --fsdp: each rank holds its own part
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


# ----------------------------------------------------------------------------- --fsdp
def shard(scorer, device):
    """--fsdp with FSDP2: each decoder layer, then the rest (embeddings, final norm, head) under
    `scorer` (common.Scorer, the module training calls), split over the ranks along dim 0, so a
    rank keeps 1/N of each weight, its gradient and its AdamW moments. A forward gathers a layer's
    weights just before it runs and frees them after; the backward gathers them again, then
    reduce-scatters the gradients, summed, as each rank's loss has the whole batch's normaliser.
    On a GPU weights are gathered in bf16 and gradients summed in fp32 (the shards stay fp32)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device.split(":")[0], (torch.distributed.get_world_size(),))
    bf16 = device.startswith("cuda")
    mp = MixedPrecisionPolicy(torch.bfloat16 if bf16 else None, torch.float32 if bf16 else None)
    for layer in scorer.model.get_decoder().layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(scorer, mesh=mesh, mp_policy=mp)
    for unit in _units(scorer):  # a sum, in sum-only collectives (gloo has no other)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    with torch.no_grad():  # a first forward through the root, which FSDP requires before any other
        _one_token(scorer)
    return scorer


def _one_token(scorer):
    """The scorer's logprob (1,) of one token after another, through every weight of the model."""
    device = next(scorer.parameters()).device
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    return scorer(ids, torch.ones_like(ids), 1.0)[0]


def passes_behind(scorer, passes):
    """--fsdp: every forward and backward gathers and scatters weights with the other ranks, so a
    rank with fewer passes this optimizer step than another adds empty ones: how many (0 without
    --fsdp). Every rank calls it before its passes."""
    return max(gather_from_ranks(passes)) - passes if is_sharded(scorer) else 0


def empty_passes(scorer, n, amp):
    """n forward-backward passes of a zero loss through every weight (see passes_behind)."""
    for _ in range(n):
        with amp:
            loss = _one_token(scorer).sum() * 0
        loss.backward()


def _units(module):
    from torch.distributed.fsdp import FSDPModule
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def held_per_rank(model):
    """A line: the bytes of weights, gradients and AdamW moments (fp32, 4 + 4 + 8 bytes a parameter)
    this rank holds, and what share of the model's that is."""
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    share = held / sum(p.numel() for p in model.parameters())
    return (f"held per rank: {16 * held / 2**20:.4g} MiB of weights, gradients and AdamW moments "
            f"({share:.0%} of the model's; activations and the rollouts' gathered weights apart)")


def is_sharded(model):
    return any(hasattr(p, "device_mesh") for p in model.parameters())  # DTensor shards


@contextlib.contextmanager
def gathered(scorer):
    """--fsdp: within, every rank holds the whole model (bf16 on a GPU: 2 bytes a parameter), so
    rollouts, evaluation and no-grad passes run on each rank alone, in any number of forwards."""
    units = _units(scorer) if scorer is not None else []
    with _together("gathering of the weights"):
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
    try:
        yield
    finally:  # resharded, and FSDP's record of these forwards (which the backward reads) cleared
        if units:
            scorer.reset_iter_state()
        for unit in units:  # FSDP's own default: the root keeps its few weights until the backward
            unit.set_reshard_after_forward(unit is not scorer, recurse=False)


def full_weights(model):
    """--fsdp: the whole fp32 state dict, gathered one tensor at a time to rank 0's CPU (every
    rank calls this; the others get {}). Tied weights once, as save_pretrained writes them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    with _together("gathering of the weights to save"):
        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                       cpu_offload=True))
    tied = ({name for name, _ in model.named_parameters(remove_duplicate=False)}
            - {name for name, _ in model.named_parameters()})
    return {k: v for k, v in weights.items() if k not in tied}


def local_optimizer_state(opt):
    """opt.state_dict() with every --fsdp shard as a plain tensor: this rank's part of each."""
    sd = opt.state_dict()
    local = lambda v: v.to_local().cpu() if hasattr(v, "to_local") else v
    return {**sd, "state": {i: {k: local(v) for k, v in s.items()} for i, s in sd["state"].items()}}


def load_optimizer_state(opt, state, shards=()):
    """Load an optimizer state saved by any number of ranks, into this run's: `state` is rank 0's
    (the whole state, without --fsdp), `shards` the other ranks' parts (--fsdp), which join rank
    0's along dim 0; a sharded parameter then takes its own part of each whole tensor."""
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, s in state["state"].items():
        for k, v in s.items():
            if v.dim():  # the moments; "step" is a number, the same on every rank
                v = torch.cat([v] + [shard["state"][i][k] for shard in shards])
                if hasattr(params[i], "device_mesh"):
                    from torch.distributed.tensor import distribute_tensor
                    v = distribute_tensor(v.to(params[i].device), params[i].device_mesh,
                                          params[i].placements, src_data_rank=None)
                s[k] = v
    opt.load_state_dict(state)
