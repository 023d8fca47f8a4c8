"""Data parallelism for the learner: N ranks over torch.distributed, each computing its share of every minibatch.

Owns: joining the ranks' process group (gloo on CPU, NCCL for models on a GPU; every collective bounded by the
group's timeout), which rows of a batch and of each minibatch this rank computes, summing gradients across ranks
(`ddp`: every rank holds the whole model) or sharding parameters, gradients and optimizer state (`fsdp2`: torch's
`fully_shard`), the global gradient norm, summing metrics, and gathering or scattering whole weights and optimizer
states (checkpoints, weight export). With one rank every method is the plain single-process operation. Why N ranks
give the one-rank update on the same batch, and why not `DistributedDataParallel`: `DataParallel`'s docstring.
Does not own: the update's math or the order of its steps (`learner.learner`), starting the ranks or choosing the
rendezvous address (`cluster/fleet/learner_group.py`).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from learner.passes.device import pick_device
from learner.passes.micro_batches import MicroBatching
from learner.passes.sequences import SequenceBatch

GRADIENT_BUCKET_BYTES = 64 * 2**20  # gradients are all-reduced in flat buckets of about this size
STRATEGIES = ("ddp", "fsdp2")


class DataParallel:
    """One rank's view of the learner's process group; the identity when `world_size` is 1.

    Why N ranks give the update of one rank on the same batch:
    - every rank receives the whole TrainBatch and draws the same minibatch shuffle (same seed, same generator
      state), so minibatches, advantages and their batch-wide statistics (group baselines, whitening) are the same on
      every rank; the forward passes that produce `old_logprobs` and values are split by rows and summed back
      (`compute_rows`), so no rank repeats another's work;
    - each rank takes a contiguous share of every minibatch and weighs each of its micro-batches by
      `micro_batch_weight` against the GLOBAL minibatch (a rank's share is one more row partition, which that weight
      makes exact), so the sum of every rank's gradient is the one-rank gradient: ranks SUM gradients, never average;
    - the gradient norm is the global one (clipping sees summed, or for fsdp2 all shards of, the gradients), and
      metrics are sums of the same weighted terms, all-reduced before the skip decision: every rank sees the same
      numbers, so all ranks skip a non-finite update together.
    Only float summation order differs (gradients add up per rank, then across ranks): about 1e-7 relative in float32.

    `ddp` sums gradients with an explicit bucketed all-reduce after a minibatch's last micro-batch, rather than
    `DistributedDataParallel`: ranks may run different numbers of micro-batches (DDP needs one synced backward per
    rank and divides by N), the policy and the value model share one reduction, and DDP's overlap of communication
    with backward would help only the last micro-batch of each accumulated minibatch."""

    def __init__(self, rank: int = 0, world_size: int = 1, strategy: str = "ddp"):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown data-parallel strategy {strategy!r}; choose one of {list(STRATEGIES)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a group of {world_size} ranks")
        self.rank = rank
        self.world_size = world_size
        self.strategy = strategy
        self.mesh: Any = None  # fsdp2's DeviceMesh, once joined
        self._store: dist.TCPStore | None = None  # the rendezvous, on rank 0 once it `listen`s

    @property
    def sharded(self) -> bool:
        """Parameters are split across ranks (fsdp2 with more than one rank): whole weights need a gather."""
        return self.world_size > 1 and self.strategy == "fsdp2"

    @property
    def is_writer(self) -> bool:
        """Rank 0 writes checkpoints and serves the whole weights for sync."""
        return self.rank == 0

    def listen(self, host: str, timeout_s: float) -> int:
        """Rank 0 only, before `join`: open the group's rendezvous store on `host` at a port the OS assigns, and return
        that port for the other ranks. The store listens from now on, so no other process can take the port between
        choosing it and joining (a port probed free and bound later can be, and was, taken meanwhile)."""
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank} cannot host the group's rendezvous: rank 0 does")
        self._store = dist.TCPStore(host, 0, self.world_size, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        return self._store.port

    def join(self, host: str, port: int, timeout_s: float, device: torch.device | None = None) -> None:
        """Join the group whose rank 0 listens on `host:port` (every rank calls this at about the same time; rank 0
        after `listen`, which chose the port).

        `timeout_s` bounds the rendezvous and, afterwards, every collective: a dead or stalled rank makes the others
        fail within it instead of hanging. The group is the process's default one (fully_shard and DTensor use it);
        a weight-sync group between rank 0 and the engines must be created as a separate, non-default group."""
        if self.world_size == 1:
            return
        device = device or pick_device()  # the models' device: NCCL needs their tensors on the GPU
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if self.rank > 0:
            store = dist.TCPStore(host, port, self.world_size, is_master=False, timeout=timeout)
        elif self._store is None:
            raise RuntimeError("rank 0 hosts the group's rendezvous: call listen(host, timeout_s) before join")
        else:
            store = self._store
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)
        if self.strategy == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(device.type, (self.world_size,))

    def _check_joined(self) -> None:
        if self.world_size > 1 and not dist.is_initialized():
            raise RuntimeError(f"rank {self.rank} of {self.world_size} has not joined its process group: call "
                               "join_process_group on every rank first")

    def distribute(self, module: torch.nn.Module) -> None:
        """Make `module` data-parallel: shard it (fsdp2: each transformer block, then the rest, as torch's FSDP2
        examples do), or start every replica from rank 0's weights (ddp). Build optimizers after this: fully_shard
        replaces the parameters."""
        if self.world_size == 1:
            return
        self._check_joined()
        if self.strategy == "ddp":
            with torch.no_grad():
                for tensor in _unique(chain(module.parameters(), module.buffers())):
                    dist.broadcast(tensor.data, src=0)
            return
        from torch.distributed.fsdp import FSDPModule, fully_shard

        blocks = set(getattr(module, "_no_split_modules", None) or ())  # transformers names its blocks' classes
        for child in module.modules():
            if child is not module and type(child).__name__ in blocks:
                fully_shard(child, mesh=self.mesh)
        fully_shard(module, mesh=self.mesh)
        for child in module.modules():
            if isinstance(child, FSDPModule):
                # Sum, never average: each rank's gradient already carries its share of the global normaliser. SUM is
                # also the one reduction gloo has (FSDP2's default averaging uses AVG / PREMUL_SUM).
                child.set_gradient_divide_factor(1.0)
                child.set_force_sum_reduction_for_comms(True)

    def share(self, rows: Tensor) -> Tensor:
        """This rank's share of `rows` (global row indices): a contiguous slice, sizes differing by at most one."""
        return rows if self.world_size == 1 else rows.tensor_split(self.world_size)[self.rank]

    def micro_batches(self, rows: Tensor, lengths: Tensor, batching: MicroBatching) -> list[tuple[Tensor, bool]]:
        """This rank's passes over `rows` (global row indices, one minibatch or the batch; `lengths` [B]: every row's
        tokens, indexed by those), each with whether it is live: `batching` cuts this rank's share. Every rank gets
        the same number (each rank can count every share's passes: all hold the whole batch): a rank with fewer adds
        dead passes (the first row, weighted 0), because under fsdp2 each forward and backward is a collective every
        rank must join. One rank: exactly `batching.split` of the rows."""
        if self.world_size == 1:
            return [(rows[part], True) for part in batching.split(lengths[rows])]
        shares = rows.tensor_split(self.world_size)  # contiguous, sizes differ by at most one
        passes = [batching.split(lengths[share]) for share in shares]
        mine = [(shares[self.rank][part], True) for part in passes[self.rank]]
        return mine + [(rows[:1], False)] * (max(map(len, passes)) - len(mine))

    def compute_rows(self, batch: SequenceBatch, compute: Callable[[SequenceBatch], Tensor],
                     batching: MicroBatching, lengths: Tensor | None = None) -> Tensor:
        """`compute(part)` -> [B_part, L_part-1] per pass of this rank's share of the rows, assembled into the
        whole batch's [B, L-1] float32 on every rank, on the batch's device (zeros past each sequence). Every other
        rank's rows are 0 here, so the all-reduce sum places each value exactly. `lengths` [B]: the tokens a pass
        runs per row, which the budget counts (default: whole rows; each row's own when prompts are shared)."""
        self._check_joined()
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=batch.device)
        for mb_idx, live in self.micro_batches(torch.arange(len(batch), device=batch.device),
                                               batch.lengths if lengths is None else lengths, batching):
            part = batch.select(mb_idx)
            values = compute(part)
            if live:
                out[mb_idx, : values.shape[1]] = values.float()
        return self.all_reduce(out)

    def all_reduce(self, tensor: Tensor) -> Tensor:
        """Sum `tensor` over ranks, in place; returns it."""
        if self.world_size == 1:
            return tensor
        if dist.get_backend() == "nccl" and not tensor.is_cuda:  # NCCL reduces GPU memory only
            on_gpu = tensor.cuda()
            dist.all_reduce(on_gpu, op=dist.ReduceOp.SUM)
            return tensor.copy_(on_gpu)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def sum_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        """Sum each metric over ranks (float64); every rank must pass the same keys."""
        if self.world_size == 1:
            return totals
        names = sorted(totals)
        summed = self.all_reduce(torch.tensor([totals[name] for name in names], dtype=torch.float64, device="cpu"))
        return dict(zip(names, summed.tolist()))

    def reduce_gradients(self, modules: Iterable[torch.nn.Module]) -> None:
        """ddp: sum every gradient over ranks (flat buckets). A parameter without a gradient on every rank keeps none
        (AdamW then skips it, as one rank would); one that has a gradient on some rank gets zeros elsewhere first.
        fsdp2 has reduce-scattered each micro-batch's gradients in its backward already."""
        if self.world_size == 1 or self.sharded:
            return
        params = [p for p in _unique(chain.from_iterable(m.parameters() for m in modules)) if p.requires_grad]
        has_grad = self.all_reduce(torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device="cpu"))
        grads = []
        for param, count in zip(params, has_grad.tolist()):
            if count and param.grad is None:
                param.grad = torch.zeros_like(param)
            if count:
                grads.append(param.grad)
        for bucket in _buckets(grads, GRADIENT_BUCKET_BYTES):
            flat = self.all_reduce(torch.cat([g.reshape(-1) for g in bucket]))
            for grad, part in zip(bucket, flat.split([g.numel() for g in bucket])):
                grad.copy_(part.view_as(grad))

    def gather_weights(self, module: torch.nn.Module) -> dict[str, Tensor] | None:
        """fsdp2: the whole weights by `state_dict` name, on CPU, on rank 0 ({} on the others; every rank must call:
        each tensor is all-gathered); tied names share one tensor, as in `module.state_dict()`. None when the module
        is not sharded: it holds its whole weights itself."""
        if not self.sharded:
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.is_writer:
            return {}
        for name, canonical in tied_names(module).items():
            if canonical in state:
                state[name] = state[canonical]
        return state

    def load_weights(self, module: torch.nn.Module, state: dict[str, Tensor]) -> None:
        """Copy whole weights (every rank passes the same `state`, e.g. read from a checkpoint) into `module`, which
        may be sharded. Names absent from `state` (a tied head saved once) are left as they are."""
        if not self.sharded:
            module.load_state_dict(state, strict=False)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # set_model_state_dict replaces the dict's values with shards: hand it a copy.
        set_model_state_dict(module, dict(state), options=StateDictOptions(full_state_dict=True, strict=False))

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """`optimizer.state_dict()` with whole tensors (the layout one rank writes), on rank 0; every rank must call
        it under fsdp2 (each sharded state tensor is all-gathered; only rank 0 keeps a CPU copy)."""
        state = optimizer.state_dict()
        if not self.sharded:
            return state
        from torch.distributed.tensor import DTensor

        full: dict[int, dict[str, Any]] = {}
        for index, values in state["state"].items():
            full[index] = {}
            for key, value in values.items():
                if isinstance(value, DTensor):
                    value = value.full_tensor()
                full[index][key] = value.cpu() if isinstance(value, Tensor) else value
        return {"state": full, "param_groups": state["param_groups"]} if self.is_writer else {}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load a whole-tensor optimizer state (as `full_optimizer_state` returns, or one rank saved) into
        `optimizer`; under fsdp2 each rank keeps its shard of every state tensor shaped like its parameter."""
        if not self.sharded:
            optimizer.load_state_dict(state)
            return
        from torch.distributed.tensor import DTensor, distribute_tensor

        params = [p for group in optimizer.param_groups for p in group["params"]]
        sharded: dict[int, dict[str, Any]] = {}
        for index, values in state["state"].items():
            param = params[int(index)]
            sharded[index] = {
                key: distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                                       src_data_rank=None)  # every rank holds the whole value: cut, no traffic
                if isinstance(param, DTensor) and isinstance(value, Tensor) and value.shape == param.shape else value
                for key, value in values.items()}
        optimizer.load_state_dict({"state": sharded, "param_groups": state["param_groups"]})


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """`torch.nn.utils.clip_grad_norm_` returning the global norm as a float, also when gradients are fsdp2 shards
    (the norm over all shards: every rank gets the same value)."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    if hasattr(norm, "full_tensor"):  # a DTensor: the partial norms of the shards, reduced here
        norm = norm.full_tensor()
    return float(norm)


def tied_names(module: torch.nn.Module) -> dict[str, str]:
    """Each parameter or buffer name that is the same tensor as an earlier one (a tied output head), mapped to that
    earlier name; by object identity, so it holds for sharded modules too."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, tensor in chain(module.named_parameters(remove_duplicate=False),
                              module.named_buffers(remove_duplicate=False)):
        canonical = first.setdefault(id(tensor), name)
        if canonical != name:
            tied[name] = canonical
    return tied


def _unique(tensors: Iterable[Tensor]) -> list[Tensor]:
    seen: set[int] = set()
    return [t for t in tensors if not (id(t) in seen or seen.add(id(t)))]


def _buckets(tensors: list[Tensor], bucket_bytes: int) -> list[list[Tensor]]:
    """Consecutive tensors of one dtype, about `bucket_bytes` per bucket (a larger tensor goes alone)."""
    buckets: list[list[Tensor]] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if not buckets or buckets[-1][0].dtype != tensor.dtype or (size and size + nbytes > bucket_bytes):
            buckets.append([])
            size = 0
        buckets[-1].append(tensor)
        size += nbytes
    return buckets
