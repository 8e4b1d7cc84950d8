"""Implementations compared by the benchmarks: ours and the peers', behind one interface.

A provider's ``build`` returns the loss function (mean reduction) the suite times, or raises
:class:`Unavailable` (package or API missing; the suite skips it with that note). LM-head
functions take ``(E, C, y)`` and the case's logit soft-cap; contrastive ones the loss's own
arguments (:data:`CONTRASTIVE_SIGNATURES`). Peers install as wheels without dependencies::

    pip install cut-cross-entropy==25.1.1 liger-kernel==0.8.5 inf-cl==1.2.1 --no-deps
"""

from __future__ import annotations

import functools
import importlib
import inspect
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.common import package_version

LossFn = Callable[[Tensor, Tensor, Tensor], Tensor]  # (E (N, D), C (V, D), y (N,)) -> loss
ContrastiveFn = Callable[..., Tensor]

CLIP, NT_XENT, SIGLIP = "clip", "nt-xent", "siglip"
CONTRASTIVE_LOSSES = (CLIP, NT_XENT, SIGLIP)
# What a contrastive provider's loss function takes (all features (rows, c), same dtype):
CONTRASTIVE_SIGNATURES = {
    CLIP: "loss(image, text, logit_scale)",  # logit_scale: 0-dim fp32 tensor (gets a gradient)
    NT_XENT: "loss(features, temperature)",  # features (2B, c): two views stacked; τ a float
    SIGLIP: "loss(image, text, logit_scale, logit_bias)",  # both 0-dim fp32 tensors
}


class Unavailable(Exception):
    """The provider cannot run here (package or API missing); the message says why."""


@dataclass(eq=False)
class Provider:
    """``key``: command-line name; ``label``: column title; ``builder(provider, device, arg)``
    makes the loss function (``arg``: the LM head's soft-cap, or the contrastive loss);
    ``call``: the exact call measured (``s``: the head's soft-cap), a dict by loss for
    contrastive providers; ``install_hint`` marks a peer (third party: its absence is "not
    installed"), whose display name is ``versioned`` with ``{v}`` → " <version>"."""

    key: str = ""
    label: str = ""
    builder: Callable[..., Callable[..., Tensor]] | None = None
    call: str | dict[str, str] = ""
    distribution: str | None = None
    install_hint: str = ""
    versioned: str = ""
    losses: tuple[str, ...] = CONTRASTIVE_LOSSES  # contrastive: the losses it has
    is_peer: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.is_peer = bool(self.install_hint)

    def version(self) -> str | None:
        return package_version(self.distribution) if self.distribution else None

    def display_name(self) -> str:
        version = self.version() if self.is_peer else None
        if self.versioned:
            return self.versioned.format(v=f" {version}" if version else "")
        return f"{self.label} {version}" if version else self.label

    def build(self, device: torch.device, arg: Any = None) -> Callable[..., Tensor]:
        """The loss function (raise Unavailable)."""
        assert self.builder is not None
        return self.builder(self, device, arg)

    def describe(self, loss: str | None = None) -> str:
        return self.call[loss] if isinstance(self.call, dict) else self.call

    def supports(self, loss: str) -> bool:
        return loss in self.losses


LMHeadProvider = ContrastiveProvider = Provider


def _function(provider: Provider, module: str, name: str, missing: str = "") -> Any:
    """``module.name``, else Unavailable (with the install hint when the import fails)."""
    try:
        found = importlib.import_module(module)
    except ImportError as error:
        hint = f" ({provider.install_hint})" if provider.install_hint else ""
        raise Unavailable(f"{module} not importable: {error}{hint}") from error
    function = getattr(found, name, None)
    if function is None:
        raise Unavailable(missing or f"{module.split('.')[0]} has no {name}")
    return function


def _compiled(function: Callable[..., Tensor], **options: Any) -> Callable[..., Tensor]:
    """``torch.compile(function, **options)`` from an empty compile cache (each case has new
    static shapes: earlier cases' graphs must not leak in); compiled in the untimed first call."""
    import torch._dynamo

    torch._dynamo.reset()
    return torch.compile(function, **options)


# ============================================================================= LM head


def torch_eager_loss(e: Tensor, c: Tensor, y: Tensor, softcap: float | None = None) -> Tensor:
    """The plain PyTorch LM head: bf16 logits, upcast, soft-capped (``s·tanh(z/s)``, fp32),
    cross-entropy (mean)."""
    logits = F.linear(e, c).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, y)


TORCH_EAGER_CALL = "F.cross_entropy(cap(F.linear(E, C).float()), y), cap(z) = s·tanh(z/s) or z"


def _fusedloss_lce(exact: bool = False, compiled: bool = False) -> Callable[..., LossFn]:
    """``fusedloss.linear_cross_entropy(E, C, y, backend="triton")``, with an explicit
    ``filter_eps=None`` (``exact``) or inside ``torch.compile(fullgraph=True)``."""

    def build(p: Provider, device: torch.device, softcap: float | None = None) -> LossFn:
        function = _function(p, "fusedloss", "linear_cross_entropy",
                             "fusedloss has no linear_cross_entropy yet")
        extra: dict[str, Any] = {"filter_eps": None} if exact else {}

        def loss(e: Tensor, c: Tensor, y: Tensor) -> Tensor:
            return function(e, c, y, backend="triton", softcap=softcap, **extra)

        return _compiled(loss, fullgraph=True) if compiled else loss

    return build


def _fusedloss_lce_call(exact: bool = False, compiled: bool = False) -> str:
    extra = ", filter_eps=None" if exact else ""
    call = f'fusedloss.linear_cross_entropy(E, C, y, backend="triton", softcap=s{extra})'
    return f"torch.compile({call}, fullgraph=True)" if compiled else call


def _cce(no_filter: bool) -> Callable[..., LossFn]:
    """apple/ml-cross-entropy's ``linear_cross_entropy(e, c, targets)`` (default filter, or
    ``filter_eps=None``)."""

    def build(p: Provider, device: torch.device, softcap: float | None = None) -> LossFn:
        function = _function(p, "cut_cross_entropy", "linear_cross_entropy")
        extra: dict[str, Any] = {"softcap": softcap}
        if no_filter:
            if "filter_eps" not in inspect.signature(function).parameters:
                raise Unavailable("this cut_cross_entropy has no filter_eps argument")
            extra["filter_eps"] = None
        return lambda e, c, y: function(e, c, y, **extra)

    return build


def _liger(p: Provider, device: torch.device, softcap: float | None = None) -> LossFn:
    """liger-kernel's fused linear cross-entropy (gradients computed inside the forward), whose
    ``forward(lin_weight, _input, target)`` (0.8.x) takes the classifier first."""
    loss_class = _function(p, "liger_kernel.transformers.fused_linear_cross_entropy",
                           "LigerFusedLinearCrossEntropyLoss")
    loss_module = loss_class(reduction="mean", softcap=softcap)
    return lambda e, c, y: loss_module(c, e, y)  # the loss alone: no return_* flag set


CCE_HINT = "pip install cut-cross-entropy==25.1.1 --no-deps"
CCE_CALL = "cut_cross_entropy.linear_cross_entropy(E, C, y, softcap=s{})"


def lm_head_providers() -> dict[str, Provider]:
    """All LM-head providers by command-line key, in table order."""
    fusedloss = (("fusedloss", "fusedloss", False, False),
                 ("fusedloss-exact", "fusedloss (exact)", True, False),
                 ("fusedloss-compile", "fusedloss (compiled)", False, True))
    providers = [
        *(Provider(key, label, _fusedloss_lce(exact, compiled),
                   _fusedloss_lce_call(exact, compiled), "fusedloss")
          for key, label, exact, compiled in fusedloss),
        Provider("torch-eager", "torch eager",
                 lambda p, device, softcap=None: functools.partial(torch_eager_loss,
                                                                   softcap=softcap),
                 TORCH_EAGER_CALL),
        # compile errors surface in the untimed first call as the provider's failure
        Provider("torch-compile", "torch.compile",
                 lambda p, device, softcap=None: _compiled(
                     functools.partial(torch_eager_loss, softcap=softcap), dynamic=False),
                 f"torch.compile({TORCH_EAGER_CALL}, dynamic=False)"),
        Provider("cce", "cut-cross-entropy", _cce(False), CCE_CALL.format(""),
                 "cut-cross-entropy", CCE_HINT, "cut-cross-entropy{v}"),
        Provider("cce-nofilter", "cut-cross-entropy, no filter", _cce(True),
                 CCE_CALL.format(", filter_eps=None"), "cut-cross-entropy", CCE_HINT,
                 "cut-cross-entropy{v}, no filter"),
        Provider("liger", "liger-kernel FLCE", _liger,
                 "LigerFusedLinearCrossEntropyLoss(reduction='mean', softcap=s)(C, E, y)",
                 "liger-kernel", "pip install liger-kernel==0.8.5 --no-deps",
                 "liger-kernel{v} FLCE"),
    ]
    return {provider.key: provider for provider in providers}


# ============================================================================= contrastive


def _fusedloss_contrastive(backend: str, compiled: bool) -> Callable[..., ContrastiveFn]:
    """``fusedloss.clip_loss`` / ``nt_xent_loss`` / ``siglip_loss`` with an explicit backend,
    optionally inside ``torch.compile(fullgraph=True)``."""

    def build(p: Provider, device: torch.device, loss: str) -> ContrastiveFn:
        name = {CLIP: "clip_loss", NT_XENT: "nt_xent_loss", SIGLIP: "siglip_loss"}[loss]
        function = _function(p, "fusedloss", name)
        if loss == CLIP:
            call = lambda i, t, s: function(i, t, s, backend=backend)
        elif loss == NT_XENT:
            call = lambda z, tau: function(z, temperature=tau, backend=backend)
        else:
            call = lambda i, t, s, bias: function(i, t, s, bias, backend=backend)
        return _compiled(call, fullgraph=True) if compiled else call

    return build


def _fusedloss_contrastive_calls(backend: str, compiled: bool) -> dict[str, str]:
    b = f'backend="{backend}"'
    calls = {CLIP: f"fusedloss.clip_loss(image, text, logit_scale, {b})",
             NT_XENT: f"fusedloss.nt_xent_loss(z, temperature=τ, {b})",
             SIGLIP: f"fusedloss.siglip_loss(image, text, logit_scale, logit_bias, {b})"}
    if compiled:
        return {loss: f"torch.compile({call}, fullgraph=True)" for loss, call in calls.items()}
    return calls


def materialized_clip_loss(image: Tensor, text: Tensor, logit_scale: Tensor) -> Tensor:
    """open_clip's ``ClipLoss`` on one process: b×b logits in the input dtype, CE in fp32."""
    logits = logit_scale * image @ text.T
    labels = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits.float(), labels) + F.cross_entropy(logits.T.float(), labels)) / 2


def materialized_nt_xent_loss(features: Tensor, temperature: float) -> Tensor:
    """SimCLR's NT-Xent with the 2B×2B logits ``Z Zᵀ/τ`` (input dtype, diagonal −inf in
    place); row i's target is ``(i + B) mod 2B``; CE in fp32."""
    logits = (features @ features.T) / temperature
    logits.fill_diagonal_(float("-inf"))
    rows = logits.shape[0]
    targets = (torch.arange(rows, device=logits.device) + rows // 2) % rows
    return F.cross_entropy(logits.float(), targets)


def materialized_siglip_loss(
    image: Tensor, text: Tensor, logit_scale: Tensor, logit_bias: Tensor
) -> Tensor:
    """open_clip's ``SigLipLoss`` on one process: ``−Σ logsigmoid(z ⊙ logits) / b``, logits
    and ±1 labels ``z = 2·eye − 1`` in the input dtype, logsigmoid and the sum in fp32."""
    logits = logit_scale * image @ text.T + logit_bias
    n = logits.shape[0]
    labels = 2 * torch.eye(n, device=logits.device, dtype=logits.dtype) - 1
    return -F.logsigmoid((labels * logits).float()).sum() / n


MATERIALIZED = {CLIP: materialized_clip_loss, NT_XENT: materialized_nt_xent_loss,
                SIGLIP: materialized_siglip_loss}
MATERIALIZED_CALLS = {
    CLIP: "logits = logit_scale * image @ text.T; (F.cross_entropy(logits.float(), "
          "arange(b)) + F.cross_entropy(logits.T.float(), arange(b))) / 2",
    NT_XENT: "logits = (z @ z.T) / τ; logits.fill_diagonal_(-inf); "
             "F.cross_entropy(logits.float(), (arange(2B) + B) % 2B)",
    SIGLIP: "logits = logit_scale * image @ text.T + logit_bias; labels = 2·eye(b) − 1; "
            "-F.logsigmoid((labels * logits).float()).sum() / b",
}


# inf-cl's process group: created here only when none exists, destroyed at the suite's end.
_benchmark_process_group: dict[str, Any] = {"created": False, "note": ""}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ensure_single_process_group(device: torch.device) -> str:
    """A torch.distributed default group for inf-cl on one GPU (its ``cal_inf_loss`` all-reduces
    ``logit_scale``'s gradient); returns what was done. NCCL, world size 1: inf-cl's ring path
    sends to itself, which gloo cannot. An existing group is used as is."""
    import torch.distributed as dist

    if not dist.is_available():
        raise Unavailable("torch.distributed is not available in this torch build")
    if dist.is_initialized():
        if _benchmark_process_group["created"]:
            return str(_benchmark_process_group["note"])
        return (
            f"existing process group used ({dist.get_backend()}, world size "
            f"{dist.get_world_size()})"
        )
    _benchmark_process_group["created"] = False  # if created, someone else destroyed it
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
    _benchmark_process_group.update(
        created=True,
        note=(
            "torch.distributed initialized by the benchmark: single-process NCCL group "
            f"(world size 1, TCPStore 127.0.0.1:{port}), as inf-cl needs for a tensor "
            "logit_scale; inf-cl then runs its ring path with one rank"
        ),
    )
    return str(_benchmark_process_group["note"])


def destroy_benchmark_process_group() -> None:
    """Tear down the group :func:`ensure_single_process_group` created (if any)."""
    if not _benchmark_process_group["created"]:
        return
    import torch.distributed as dist

    _benchmark_process_group["created"] = False
    if dist.is_initialized():
        dist.destroy_process_group()


def inf_cl_head_dim(width: int) -> int:
    """inf-cl views (b, c) features as (b, c / head_dim, head_dim): 256 by default (its
    CLIP wrapper's), else the largest of 128, 64, 32, 16 dividing c (quick runs)."""
    for head_dim in (256, 128, 64, 32, 16):
        if width % head_dim == 0:
            return head_dim
    raise Unavailable(f"inf-cl needs a width divisible by 16, got c = {width}")


def inf_clip_loss(cal_inf_loss: Callable[..., Tensor], scale_inside: bool = True) -> ContrastiveFn:
    """The CLIP loss from inf-cl's one-direction ``cal_inf_loss``, as ``InfClipLoss`` calls it.

    ``scale_inside``: pass ``logit_scale`` to ``cal_inf_loss`` (needs a process group);
    otherwise multiply the features by it first, as ``cal_inf_loss`` does inside.
    """
    labels_cache: dict[tuple[int, torch.device], Tensor] = {}

    def labels_for(x: Tensor) -> Tensor:
        key = (x.shape[0], x.device)
        if key not in labels_cache:
            labels_cache.clear()
            labels_cache[key] = torch.arange(x.shape[0], device=x.device)
        return labels_cache[key]

    def loss(image: Tensor, text: Tensor, scale: Tensor) -> Tensor:
        labels, head_dim = labels_for(image), inf_cl_head_dim(image.shape[1])
        if scale_inside:
            i2t = cal_inf_loss(image, text, labels, scale, head_dim=head_dim)
            t2i = cal_inf_loss(text, image, labels, scale, head_dim=head_dim)
        else:
            i2t = cal_inf_loss(scale * image, text, labels, head_dim=head_dim)
            t2i = cal_inf_loss(scale * text, image, labels, head_dim=head_dim)
        return ((i2t + t2i) / 2).mean()

    return loss


def _inf_cl(p: Provider, device: torch.device, loss: str) -> ContrastiveFn:
    """Inf-CLIP's ``cal_inf_loss``, once per direction as its ``InfClipLoss`` calls it (fp32
    features, TF32 products). Without a process group the scale is applied outside
    (:func:`inf_clip_loss`), and the call says so."""
    function = _function(p, "inf_cl", "cal_inf_loss")
    if loss != CLIP:
        raise Unavailable(f"inf-cl has no {loss} loss")
    if device.type != "cuda":
        raise Unavailable("inf-cl's Triton kernels need a CUDA device")
    scale, scale_inside = "logit_scale, ", True
    try:
        p.process_group_note = ensure_single_process_group(device)
    except Exception as error:  # no NCCL here: inf-cl's single-device path instead
        p.process_group_note = (
            f"no process group ({type(error).__name__}: {str(error)[:200]}); the scale is "
            "applied outside cal_inf_loss (no GradientGather)"
        )
        scale, scale_inside = "", False
    s = "" if scale_inside else "s * "
    p.call = {CLIP: (
        f"((cal_inf_loss({s}image, text, labels, {scale}head_dim=h) + "
        f"cal_inf_loss({s}text, image, labels, {scale}head_dim=h)) / 2).mean(), "
        f"labels = arange(b), h = 256 (c % 256 ≠ 0: 128, 64, …) [{p.process_group_note}]")}
    return inf_clip_loss(function, scale_inside=scale_inside)


def contrastive_providers(backend: str = "triton") -> dict[str, Provider]:
    """All contrastive providers by command-line key, in table order."""
    providers = [
        Provider("fusedloss", "fusedloss", _fusedloss_contrastive(backend, False),
                 _fusedloss_contrastive_calls(backend, False), "fusedloss"),
        Provider("fusedloss-compile", "fusedloss (compiled)",
                 _fusedloss_contrastive(backend, True),
                 _fusedloss_contrastive_calls(backend, True), "fusedloss"),
        Provider("torch", "torch materialized", lambda p, device, loss: MATERIALIZED[loss],
                 MATERIALIZED_CALLS),
        Provider("inf-cl", "inf-cl", _inf_cl, "", "inf-cl", "pip install inf-cl==1.2.1 --no-deps",
                 losses=(CLIP,)),
    ]
    return {provider.key: provider for provider in providers}
