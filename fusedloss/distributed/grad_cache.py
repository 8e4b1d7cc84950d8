"""Gradient Cache: one training step over a batch far larger than one pass of the encoders fits.

    loss = grad_cache_step([image_encoder, text_encoder], [images, texts],
                           lambda i, t: fusedloss.clip_loss(i, t, logit_scale.exp()),
                           micro_batch_size=256)
    optimizer.step()

A contrastive loss couples every sample with every other, so the batch cannot simply be split
into accumulated micro-steps; but it depends on the encoders only through the features. GradCache
(Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup";
Inf-CL trains its encoders the same way) splits the step at the features:

1. encode: every tower k runs on its inputs micro-batch by micro-batch without grad; the
   features are concatenated, F_k (b_k, c_k). Each micro-batch's RNG state is saved first.
2. loss: L = loss_fn(F_1, F_2, ...) on leaves that require grad, backpropagated: the cache
   G_k = ∂L/∂F_k. Parameters used inside ``loss_fn`` (a learnable logit_scale) get their
   gradients here, as in a plain step.
3. re-encode: every micro-batch j runs again, with grad and with its saved RNG state (dropout
   draws the same masks), and ``torch.autograd.backward(f_kj, G_k[rows of j])`` adds
   ∂L/∂f_kj · ∂f_kj/∂θ to the parameters' ``.grad``; summed over j that is ∂L/∂θ.

The parameters' gradients are those of one plain step on the whole batch (up to the order of
float additions). Memory, per rank: the features and their cached gradients, 2·Σ_k b_k·c_k
elements; the activations of one micro-batch (one tower's graph at a time); and the loss's own
memory (fusedloss's losses: O(b·c), no b×b matrix). Compute: every tower runs its forward twice,
about 4/3 of a plain step.

Over several processes, each rank runs the step on its local batch with a ring loss of
``fusedloss.distributed`` as ``loss_fn``: the features never leave their rank, every rank's
features receive W·∂L/∂f (W: the world size, L: the global loss; see ``contrastive.py``), so
the towers' gradients averaged over the ranks are ∂L/∂θ. DDP: pass each
``DistributedDataParallel`` module itself as a tower (not a function reaching into its
``.module``). All but the last re-encode pass of each DDP module run inside its ``no_sync()``
(forward and backward), so it all-reduces (averages) its accumulated gradients once per step,
in its last backward, as with gradient accumulation; a module used by several towers (SimCLR's
two views) syncs once, after its last pass. Every rank must then run the same number of
micro-batches per tower (the same local batch sizes), since DDP's all-reduce, and its buffer
broadcast at each forward (``broadcast_buffers=True``), are collectives. The loss's own
parameters (logit_scale) are not a DDP tower's: each rank holds its share of W·∂L/∂s; keep them
outside the DDP modules and average their gradients over the ranks yourself
(``dist.all_reduce(s.grad); s.grad /= W``). FSDP's gradient sync is not managed here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

Tower = Callable[..., torch.Tensor]
TowerInput = torch.Tensor | Sequence[Any] | Mapping[str, Any]
Device = torch.device | str | int | None


def grad_cache_step(
    towers: Sequence[Tower],
    inputs: Sequence[TowerInput],
    loss_fn: Callable[..., torch.Tensor],
    *,
    micro_batch_size: int | Sequence[int],
    device: Device = None,
) -> torch.Tensor:
    """One Gradient Cache step: the loss of the whole batch, and its gradients in ``.grad``.

    Accumulates into every parameter's ``.grad`` what ``loss_fn(*(tower(x) for ...)).backward()``
    on the whole batch would, while holding only one micro-batch's activations (module doc).
    Call ``optimizer.zero_grad()`` before and ``optimizer.step()`` after, as for a plain step.

    Args:
        towers: one callable (usually an ``nn.Module``) per tower, e.g. ``[image_encoder,
            text_encoder]`` for CLIP; the same module may appear twice (SimCLR's two views).
            ``towers[k]`` maps a micro-batch of ``inputs[k]`` (m rows) to features (m, ...):
            a tensor whose first dimension is the batch. It must compute the same function in
            both passes given the same RNG state (no state updated by the first pass that
            changes the second, e.g. BatchNorm's running statistics are updated twice).
        inputs: one entry per tower: a tensor (b_k, ...), called as ``tower(x)``; a tuple or
            list, called as ``tower(*x)``; or a dict, called as ``tower(**x)``. The tensors of
            one entry share their first (batch) dimension b_k and are sliced along it; other
            values (flags, strings) are passed to every call as they are. Inputs are data: they
            should not require grad.
        loss_fn: ``loss_fn(F_1, ..., F_K)`` with ``F_k`` (b_k, ...) the concatenated features of
            tower k, returns a one-element tensor (e.g. ``lambda i, t:
            fusedloss.clip_loss(i, t, scale)``); its parameters get their gradients as usual.
            It is called once per step.
        micro_batch_size: rows per micro-batch (≥ 1; the last one may be smaller), one int for
            every tower or one per tower.
        device: None runs each micro-batch where its tensors are; otherwise each micro-batch's
            tensors are moved there as it is used (``non_blocking`` from pinned memory), so the
            whole batch may stay on the CPU. Each micro-batch is moved twice (both passes).

    Returns:
        The loss, detached (the value ``loss_fn`` returned).

    The step runs its own backward passes, so it is the training loop, not something to
    compile: compile the towers (and the loss) it calls instead.

    Features that the loss does not depend on (no gradient reaches them) skip their re-encode
    pass, and re-encoded features that do not require grad (a frozen tower) skip its backward:
    those parameters keep ``.grad`` as a plain step would leave it. Dropout and other random ops
    see the same random numbers in both passes: the CPU RNG state and those of the CUDA devices
    in use (``device``'s, the inputs', the current one) are saved before each micro-batch's
    first pass and restored for its second; afterwards the RNG is where the first passes left
    it. DDP towers sync once per step (module doc).
    """
    towers = _check_towers(towers)
    batches = _check_inputs(inputs, len(towers))
    sizes = _check_micro_batch_size(micro_batch_size, len(towers))
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    device = _check_device(device)
    rng_devices = _cuda_devices(device, batches)

    # 1. encode without grad; each micro-batch's RNG state is saved for its second pass
    features, states = [], []
    with torch.no_grad():
        for k, (tower, batch, m) in enumerate(zip(towers, batches, sizes, strict=True)):
            parts = []
            for start, stop in _spans(batch.rows, m):
                states.append(_RngState(rng_devices))
                args, kwargs = batch.micro_batch(start, stop, device)
                parts.append(_check_features(tower(*args, **kwargs), k, stop - start))
            features.append(torch.cat(parts) if len(parts) > 1 else parts[0])
            del parts

    # 2. the loss on leaves; its backward caches dL/dF (and fills the loss's own parameters)
    with torch.enable_grad():
        leaves = [f.detach().requires_grad_() for f in features]
        del features
        loss = _check_loss(loss_fn(*leaves))
        loss.backward()
    cached = [leaf.grad for leaf in leaves]
    del leaves

    # 3. re-encode with grad and the same RNG; backpropagate each micro-batch's slice of G_k.
    # A DDP module syncs in its last pass only: the last micro-batch of the last tower using it.
    last_use = {id(t): k for k, t in enumerate(towers) if cached[k] is not None}
    state_iter = iter(states)
    with torch.enable_grad():
        for k, (tower, batch, m) in enumerate(zip(towers, batches, sizes, strict=True)):
            spans = list(_spans(batch.rows, m))
            tower_states = [next(state_iter) for _ in spans]
            if cached[k] is None:
                continue
            for j, ((start, stop), state) in enumerate(zip(spans, tower_states, strict=True)):
                sync = last_use[id(tower)] == k and j == len(spans) - 1
                no_sync = (tower.no_sync() if isinstance(tower, DistributedDataParallel)
                           and not sync else contextlib.nullcontext())
                grad = cached[k][start:stop]
                with no_sync, state.replay():
                    args, kwargs = batch.micro_batch(start, stop, device)
                    out = _check_features(tower(*args, **kwargs), k, stop - start)
                    if out.shape != grad.shape:
                        raise RuntimeError(
                            f"towers[{k}] returned features of shape {tuple(out.shape)} when "
                            f"re-encoding rows {start}:{stop}, but {tuple(grad.shape)} in the "
                            f"no-grad pass; a tower must compute the same function in both")
                    if out.requires_grad:
                        torch.autograd.backward(out, grad)
                    del out, args, kwargs
    return loss.detach()


class GradCache:
    """:func:`grad_cache_step` with its towers, loss and options fixed, called with the inputs.

        step = GradCache([model.visual, model.text], loss_fn, micro_batch_size=256)
        for images, texts in loader:
            optimizer.zero_grad()
            loss = step(images, texts)   # one input per tower
            optimizer.step()

    The arguments are checked here once and again at each call (as :func:`grad_cache_step`).
    """

    def __init__(
        self,
        towers: Sequence[Tower],
        loss_fn: Callable[..., torch.Tensor],
        *,
        micro_batch_size: int | Sequence[int],
        device: Device = None,
    ):
        self.towers = _check_towers(towers)
        _check_micro_batch_size(micro_batch_size, len(self.towers))
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        self.loss_fn, self.micro_batch_size = loss_fn, micro_batch_size
        self.device = _check_device(device)

    def __call__(self, *inputs: TowerInput) -> torch.Tensor:
        """``inputs[k]`` for ``towers[k]``; returns the detached loss (gradients in ``.grad``)."""
        return grad_cache_step(self.towers, inputs, self.loss_fn,
                               micro_batch_size=self.micro_batch_size, device=self.device)


# ---------------------------------------------------------------------------------------------
# micro-batches and RNG states


class _Batch:
    """One tower's input: its batch size and how to call the tower on rows [start, stop)."""

    def __init__(self, value: TowerInput, k: int):
        name = f"inputs[{k}]"
        if isinstance(value, torch.Tensor):
            self.kind, items = "tensor", [(name, value)]
        elif isinstance(value, (tuple, list)):
            self.kind, items = "sequence", [(f"{name}[{i}]", v) for i, v in enumerate(value)]
        elif isinstance(value, Mapping):
            if not all(isinstance(key, str) for key in value):
                raise TypeError(f"{name} is a dict passed as keyword arguments: its keys must "
                                f"be strings")
            self.kind, items = "mapping", [(f"{name}[{key!r}]", v) for key, v in value.items()]
        else:
            raise TypeError(f"{name} must be a tensor, a tuple or list of tensors, or a dict of "
                            f"tensors; got {type(value).__name__}")
        self.value, rows, first = value, None, None
        for item_name, v in items:
            if not isinstance(v, torch.Tensor):
                continue
            if v.dim() == 0:
                raise ValueError(f"{item_name} is a 0-dim tensor; the tensors of an input need "
                                 f"a first (batch) dimension")
            if rows is None:
                rows, first = v.shape[0], item_name
            elif v.shape[0] != rows:
                raise ValueError(f"{item_name} has batch size {v.shape[0]} but {first} has "
                                 f"{rows}: the tensors of one tower's input must share their "
                                 f"first (batch) dimension")
        if rows is None:
            raise ValueError(f"{name} holds no tensor: there is no batch to split")
        if rows == 0:
            raise ValueError(f"{name} has an empty batch (0 rows)")
        self.rows: int = rows
        self.tensors = [v for _, v in items if isinstance(v, torch.Tensor)]

    def micro_batch(self, start: int, stop: int, device: torch.device | None):
        """(args, kwargs) for rows [start, stop), moved to ``device`` when given."""
        def cut(v):
            return _to(v[start:stop], device) if isinstance(v, torch.Tensor) else v

        if self.kind == "tensor":
            return (cut(self.value),), {}
        if self.kind == "sequence":
            return tuple(cut(v) for v in self.value), {}
        return (), {key: cut(v) for key, v in self.value.items()}


def _to(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    if device is None:
        return t
    return t.to(device, non_blocking=t.device.type == "cpu" and t.is_pinned())


def _spans(rows: int, m: int) -> Iterator[tuple[int, int]]:
    for start in range(0, rows, m):
        yield start, min(start + m, rows)


class _RngState:
    """The CPU RNG state and those of some CUDA devices, to replay a micro-batch's randomness
    (GradCache's ``RandContext``)."""

    def __init__(self, cuda_devices: list[int]):
        self.cpu = torch.get_rng_state()
        self.cuda_devices = cuda_devices
        self.cuda = [torch.cuda.get_rng_state(d) for d in cuda_devices]

    @contextlib.contextmanager
    def replay(self):
        """Run the block from the saved states; the RNG is restored afterwards."""
        with torch.random.fork_rng(devices=self.cuda_devices):
            torch.set_rng_state(self.cpu)
            for d, state in zip(self.cuda_devices, self.cuda, strict=True):
                torch.cuda.set_rng_state(state, d)
            yield


def _cuda_devices(device: torch.device | None, batches: list[_Batch]) -> list[int]:
    """The CUDA devices whose RNG a tower may use: ``device``'s, the inputs', the current one."""
    found = set()
    candidates = [device] if device is not None else []
    candidates += [t.device for b in batches for t in b.tensors]
    for d in candidates:
        if d.type == "cuda":
            found.add(d.index if d.index is not None else torch.cuda.current_device())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        found.add(torch.cuda.current_device())
    return sorted(found)


# ---------------------------------------------------------------------------------------------
# argument checks: clear errors that name the argument


def _check_towers(towers) -> list:
    if isinstance(towers, nn.Module) and not isinstance(towers, nn.ModuleList):
        raise TypeError(f"towers must be a list or tuple with one module or callable per tower, "
                        f"got a single {type(towers).__name__}; pass [module] for one tower")
    if not isinstance(towers, (list, tuple, nn.ModuleList)):
        raise TypeError(f"towers must be a list or tuple with one module or callable per tower, "
                        f"got {type(towers).__name__}")
    if len(towers) == 0:
        raise ValueError("towers is empty: pass at least one tower")
    for k, tower in enumerate(towers):
        if not callable(tower):
            raise TypeError(f"towers[{k}] must be a module or callable, got "
                            f"{type(tower).__name__}")
    return list(towers)


def _check_inputs(inputs, n_towers: int) -> list[_Batch]:
    if not isinstance(inputs, (list, tuple)):
        raise TypeError(f"inputs must be a list or tuple with one entry per tower, got "
                        f"{type(inputs).__name__}")
    if len(inputs) != n_towers:
        raise ValueError(f"inputs has {len(inputs)} entries but towers has {n_towers}: pass "
                         f"one input per tower (a tower taking several tensors gets a tuple or "
                         f"dict of them)")
    return [_Batch(value, k) for k, value in enumerate(inputs)]


def _check_micro_batch_size(micro_batch_size, n_towers: int) -> list[int]:
    if isinstance(micro_batch_size, (list, tuple)):
        if len(micro_batch_size) != n_towers:
            raise ValueError(f"micro_batch_size has {len(micro_batch_size)} entries but towers "
                             f"has {n_towers}: pass one int, or one per tower")
        sizes = list(micro_batch_size)
    else:
        sizes = [micro_batch_size] * n_towers
    for m in sizes:
        if isinstance(m, bool) or not isinstance(m, int):
            raise TypeError(f"micro_batch_size must be an int or a list of ints, got "
                            f"{micro_batch_size!r}")
        if m < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size!r}")
    return sizes


def _check_device(device) -> torch.device | None:
    if device is None:
        return None
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be None or a torch.device, str or int, got "
                         f"{device!r}: {e}") from None


def _check_features(out, k: int, rows: int) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"towers[{k}] must return a tensor of features (micro-batch, ...), got "
                        f"{type(out).__name__}")
    if out.dim() == 0 or out.shape[0] != rows:
        raise ValueError(f"towers[{k}] returned features of shape {tuple(out.shape)} for a "
                         f"micro-batch of {rows} rows; their first dimension must be the batch")
    return out


def _check_loss(loss) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(f"loss_fn must return a scalar tensor, got shape {tuple(loss.shape)} "
                         f"(reduce it, e.g. reduction='mean')")
    if not loss.requires_grad:
        raise ValueError("loss_fn returned a loss that does not require grad: it must be "
                         "computed from the features it is given (not detached copies)")
    return loss
