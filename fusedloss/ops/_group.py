"""What the distributed losses (the vocabulary-parallel head, the ring) need from
torch.distributed: the group's layout, one exchange of per-rank facts that also checks the
ranks agree, and the ring's neighbour-to-neighbour shifts.

Every check here raises the same error on every rank (each rank sees every rank's facts), so a
disagreement never leaves some ranks waiting for the others. A rank that dies mid-call leaves
the others blocked in a transfer until the group's timeout (``init_process_group(timeout=…)``)
expires; torch.distributed raises there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Codes for the facts that must agree across ranks (their order is part of the exchange).
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEVICE_TYPES = ("cpu", "cuda")
MAX_FACTS = 16  # every rank sends this many fact codes (padded), whatever it could check


@dataclass(frozen=True)
class Layout:
    """The group seen from this rank: its position, its neighbours on the ring, and each rank's
    row and column counts (rows are this rank's queries / images, columns the blocks that travel:
    texts, keys, or the same rows for NT-Xent)."""

    group: dist.ProcessGroup | None
    rank: int  # in the group
    world: int
    rows: tuple[int, ...]  # per rank
    cols: tuple[int, ...]  # per rank
    # Global ranks of the neighbours, (rank ± 1) mod world (the other way round on a
    # ``reversed`` layout):
    next_peer: int  # rank + 1: where blocks go
    prev_peer: int  # rank − 1: where blocks come from

    def col_offset(self, r: int) -> int:
        return sum(self.cols[:r])

    def row_offset(self, r: int) -> int:
        return sum(self.rows[:r])

    def block_at(self, step: int) -> int:
        """The rank whose column block this rank holds at ``step`` of the forward's tour (0 = its
        own; the backward tours the other way, ``ring.backward``)."""
        return (self.rank - step) % self.world

    def reversed(self) -> Layout:
        """The same group with the ring's direction reversed: a ``Shift`` on it sends to rank − 1
        and receives from rank + 1."""
        return dataclasses.replace(self, next_peer=self.prev_peer, prev_peer=self.next_peer)


def group_rank_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fusedloss.distributed needs an initialized process group "
            "(torch.distributed.init_process_group); on one process use fusedloss.* instead"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def exchange(group: dist.ProcessGroup | None, rows: int, cols: int,
             facts: dict[str, tuple[int, str]], device: torch.device, *,
             error: Exception | None = None, extra: tuple[int, ...] = ()) -> tuple[Layout, list]:
    """All-gathers (rows, cols, facts…, extra…) from every rank and checks that the facts agree.

    ``facts`` maps an argument's name to (a code of its value, the value as the user would read
    it); a rank whose code differs from rank 0's makes every rank raise a ValueError naming the
    argument and each rank's code. ``error``: this rank's own argument error, found before the
    exchange; it is raised here, after the exchange, and the other ranks raise too, naming this
    rank, so that no rank waits for one that has left. ``extra``: per-rank integers the caller
    needs from every rank (returned, one tuple per rank): the same count on every rank. One
    small all-gather; for an NCCL group of up to ``STORE_EXCHANGE_MAX_WORLD`` ranks through
    the process group's store (``_store_all_gather``), so that it does not wait for the GPU.

    While a CUDA graph is being captured on ``device`` the host cannot read the all-gather's
    result: the caller then gets what the last eager exchange on this rank with the same
    arguments (group, rows, cols, facts, extra) found, without communicating (that call checked
    them across the ranks, and a graph replays the same shapes); without one, it raises.
    """
    rank, world = group_rank_world(group)
    names = list(facts)
    if len(names) > MAX_FACTS:
        raise ValueError(f"at most {MAX_FACTS} facts per exchange")
    codes = [facts[k][0] for k in names] if error is None else []
    # The same length on every rank, also where an error left no facts to send.
    codes += [0] * (MAX_FACTS - len(codes))
    key = (group if group is not None else dist.group.WORLD, rows, cols, tuple(codes),
           tuple(extra))
    if capturing(device):
        return _captured(key, error)
    local = torch.tensor([int(error is not None), rows, cols, *codes, *extra],
                         dtype=torch.int64)
    if dist.get_backend(group) != "nccl":
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local, group=group)
        table = torch.stack(gathered).tolist()
    elif world <= STORE_EXCHANGE_MAX_WORLD:
        table = _store_all_gather(local, group, world)
    else:  # NCCL moves CUDA tensors only
        table = _gather_on_side_stream(local, world, group, device)
    if error is not None:
        raise error
    failed = [r for r, row in enumerate(table) if row[0]]
    if failed:
        raise RuntimeError(
            f"rank(s) {failed} of the group raised an error on their arguments (see their "
            f"messages); no rank computes the loss"
        )
    for j, name in enumerate(names, start=3):
        column = [row[j] for row in table]
        if any(code != column[0] for code in column):
            raise ValueError(
                f"the ranks disagree on {name}: every rank of the group must pass the same; "
                f"this rank ({rank}) has {facts[name][1]}, the ranks' codes are {column}"
            )
    peer = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    layout = Layout(
        group=group, rank=rank, world=world,
        rows=tuple(row[1] for row in table), cols=tuple(row[2] for row in table),
        next_peer=peer((rank + 1) % world), prev_peer=peer((rank - 1) % world),
    )
    first_extra = 3 + MAX_FACTS
    found = layout, [tuple(row[first_extra:]) for row in table]
    _EAGER_EXCHANGES.pop(key, None)  # re-inserted last: the dict keeps the most recent ones
    _EAGER_EXCHANGES[key] = found
    while len(_EAGER_EXCHANGES) > _EAGER_EXCHANGES_KEPT:
        del _EAGER_EXCHANGES[next(iter(_EAGER_EXCHANGES))]
    return found


# What the last eager exchanges found, by their arguments, for calls made during a CUDA graph
# capture (``exchange``); the most recent last.
_EAGER_EXCHANGES: dict[tuple, tuple[Layout, list]] = {}
_EAGER_EXCHANGES_KEPT = 64


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _captured(key: tuple, error: Exception | None) -> tuple[Layout, list]:
    if error is not None:
        raise error
    found = _EAGER_EXCHANGES.get(key)
    if found is None:
        raise RuntimeError(
            "called while a CUDA graph is being captured, with arguments (group, shapes, "
            "dtypes, options) that no eager call on this rank has had: make one eager call with "
            "the same arguments on every rank first; it checks them across the ranks, and the "
            "capture reuses what it found"
        )
    return found


# The largest NCCL group whose exchange goes through the store: every rank reads every rank's
# key, world² reads a call from the one store server, cheap for a node's GPUs; larger groups
# all-gather through NCCL (``_gather_on_side_stream``), where the previous step's transfers
# delay the exchange but W blocks a step dwarf that.
STORE_EXCHANGE_MAX_WORLD = 8

# Exchanges made so far through each store, per tuple of global ranks (``_store_all_gather``;
# a new process group brings a new store, and the count starts again).
_STORE_ROUNDS: dict[tuple[dist.Store, tuple[int, ...]], int] = {}


def _store_all_gather(local: torch.Tensor, group: dist.ProcessGroup | None,
                      world: int) -> list[list[int]]:
    """Every rank's row of ``local`` (int64, host) through the store that
    ``init_process_group`` made (a TCPStore under torchrun), not through NCCL.

    NCCL moves CUDA tensors only, and on one communicator its operations run in order: an
    all-gather through the ring's group would wait for the previous step's ring transfers,
    which wait for that step's kernels, so that reading its result synchronized the host with
    the GPU once a step (a 2-GPU ring step host-paced at 5.99 ms against 5.48 of kernels).
    Through the store the exchange waits for the other ranks' hosts alone.

    Each rank sets one key a round and reads the group's keys of that round (the store's reads
    wait for a key until its timeout); the ranks of a group make the same exchanges in the same
    order, so a count of the rounds per tuple of ranks names them alike everywhere. A rank
    deletes its key of two rounds before: every rank has read it by then (each has set its key
    of the round before, so it has finished reading that one's predecessor).
    """
    ranks = tuple(dist.get_global_rank(group, r) if group is not None else r
                  for r in range(world))
    store = dist.distributed_c10d._get_default_store()
    n = _STORE_ROUNDS.get((store, ranks), 0)
    _STORE_ROUNDS[store, ranks] = n + 1
    tag = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:16]
    key = f"fusedloss/exchange/{tag}/{{}}/{{}}".format
    me = dist.get_rank()
    values = local.tolist()
    store.set(key(n, me), struct.pack(f"<{len(values)}q", *values))
    rows = store.multi_get([key(n, r) for r in ranks])
    if n >= 2:
        store.delete_key(key(n - 2, me))
    return [list(struct.unpack(f"<{len(values)}q", bytes(row))) for row in rows]


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _gather_on_side_stream(local: torch.Tensor, world: int, group: dist.ProcessGroup | None,
                           device: torch.device) -> list[list[int]]:
    """Every rank's row of ``local`` (int64, host), all-gathered through NCCL on a stream of its
    own: the host waits for this exchange alone, not for the work already queued on the current
    stream (the previous step's backward, the optimizer), so that the host keeps its lead over
    the GPU; pinned host buffers keep the copies from syncing the device."""
    index = device.index if device.type == "cuda" else None
    index = torch.cuda.current_device() if index is None else index
    side = _SIDE_STREAMS.get(index)
    if side is None:
        side = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    with torch.cuda.device(index), torch.cuda.stream(side):
        sent = local.pin_memory().to(index, non_blocking=True)
        table = torch.empty(world * local.numel(), dtype=local.dtype, device=index)
        dist.all_gather_into_tensor(table, sent, group=group)
        host = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
        host.copy_(table, non_blocking=True)
        side.synchronize()
    return host.view(world, -1).tolist()


def float_code(x: float | None) -> int:
    """An option's value as an int64 code (its float64 bits; None is −1)."""
    return -1 if x is None else struct.unpack("<q", struct.pack("<d", float(x)))[0]


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPES.index(dtype) if dtype in DTYPES else len(DTYPES)


def device_code(device: torch.device) -> int:
    return DEVICE_TYPES.index(device.type) if device.type in DEVICE_TYPES else len(DEVICE_TYPES)


class Shift:
    """Sends tensors to the next rank and receives the previous rank's, without waiting.

    ``Shift(layout, send, recv)`` posts the transfers (``batch_isend_irecv``) and returns;
    ``wait()`` blocks until they are done. Empty tensors are not sent (both ends know the
    shapes, so both skip them). The i-th tensor goes with tag ``tag + i``: shifts in flight
    at the same time take different tags.
    """

    def __init__(self, layout: Layout, send: list[torch.Tensor], recv: list[torch.Tensor],
                 tag: int = 0):
        ops = []
        for i, t in enumerate(send):
            if t.numel():
                ops.append(dist.P2POp(dist.isend, t.contiguous(), layout.next_peer,
                                      group=layout.group, tag=tag + i))
        for i, t in enumerate(recv):
            if t.numel():
                ops.append(dist.P2POp(dist.irecv, t, layout.prev_peer, group=layout.group,
                                      tag=tag + i))
        self._ops = ops  # keeps the tensors alive while they are in flight
        self._requests = dist.batch_isend_irecv(ops) if ops and layout.world > 1 else []

    def wait(self) -> None:
        for request in self._requests:
            request.wait()
        self._requests, self._ops = [], []


class _SumGradOverRanks(torch.autograd.Function):
    """Identity forward; the backward all-reduces the gradient (sum) and divides it."""

    @staticmethod
    def forward(ctx, t, group, divide):
        ctx.group, ctx.divide = group, divide
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad / ctx.divide, None, None


def sum_grad_over_ranks(t: torch.Tensor, group: dist.ProcessGroup | None,
                        divide: float = 1.0) -> torch.Tensor:
    """``t``, whose gradient becomes the sum over the group's ranks of theirs, ÷ ``divide``
    (a collective in the backward: every rank must run it)."""
    return _SumGradOverRanks.apply(t, group, divide)


def mean_over_ranks(value: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The mean over the group's ranks of a scalar, as a value without gradient."""
    total = value.detach().clone()
    dist.all_reduce(total, group=group)
    return total / dist.get_world_size(group)
