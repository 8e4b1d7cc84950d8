"""Implementations compared by the benchmarks: ours and the peers', behind one interface.

A provider turns into a loss function ``loss(E, C, y) -> scalar`` (mean reduction) once
per case, for the case's logit soft-cap s (``s·tanh(z/s)`` on the logits z, or None); the
suite times ``loss(E, C, y)`` (forward) or ``torch.autograd.grad(loss, (E, C))``
(forward+backward) itself, so every provider is measured the same way. A provider whose
package or API is missing raises :class:`Unavailable` from ``build`` and the suite skips
it with that note.

Peers install as pure-Python wheels without dependencies::

    pip install cut-cross-entropy==25.1.1 liger-kernel==0.8.5 inf-cl==1.2.1 --no-deps

Contrastive providers (:class:`ContrastiveProvider`, the ``contrastive`` suite) work the same
way for the CLIP, NT-Xent and SigLIP losses; their loss functions take the loss's own
arguments (:data:`CONTRASTIVE_SIGNATURES`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.common import package_version

LossFn = Callable[[Tensor, Tensor, Tensor], Tensor]  # (E (N, D), C (V, D), y (N,)) -> loss


class Unavailable(Exception):
    """The provider cannot run here (package or API missing); the message says why."""


class LMHeadProvider:
    """One linear-cross-entropy implementation.

    ``key`` is the command-line name, ``label`` the column title, ``distribution`` the
    package whose version is reported (``None`` for torch itself), ``is_peer`` marks
    third-party implementations (their absence is "not installed", not a failure).
    """

    key: str = ""
    label: str = ""
    distribution: str | None = None
    is_peer: bool = False
    install_hint: str = ""

    def version(self) -> str | None:
        return package_version(self.distribution) if self.distribution else None

    def display_name(self) -> str:
        version = self.version() if self.is_peer else None
        return f"{self.label} {version}" if version else self.label

    def build(self, device: torch.device, softcap: float | None = None) -> LossFn:
        """Import what is needed and return the loss function for logits soft-capped at
        ``softcap`` (raise Unavailable)."""
        raise NotImplementedError

    def describe(self) -> str:
        """The exact call being measured, for the results file (``s``: the head's soft-cap,
        None for heads without one)."""
        return ""


def _import(module: str, provider: LMHeadProvider) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        hint = f" ({provider.install_hint})" if provider.install_hint else ""
        raise Unavailable(f"{module} not importable: {error}{hint}") from error


# ----------------------------------------------------------------------------- ours


class FusedLossProvider(LMHeadProvider):
    """``fusedloss.linear_cross_entropy(E, C, y, backend="triton")`` (whose ``filter_eps="auto"``
    is exact), optionally with an explicit ``filter_eps=None`` (``exact``), with gradient
    filtering at the filter's bound for E's dtype (``filtered``: bf16 2⁻¹²), or inside
    ``torch.compile(fullgraph=True)`` (compiled in the suite's untimed first call)."""

    distribution = "fusedloss"

    def __init__(self, exact: bool = False, compiled: bool = False, filtered: bool = False):
        self.exact, self.compiled, self.filtered = exact, compiled, filtered
        self.key = ("fusedloss-exact" if exact else "fusedloss-filtered" if filtered else
                    "fusedloss-compile" if compiled else "fusedloss")
        self.label = ("fusedloss (exact)" if exact else "fusedloss (filtered)" if filtered else
                      "fusedloss (compiled)" if compiled else "fusedloss")

    def build(self, device: torch.device, softcap: float | None = None) -> LossFn:
        fusedloss = _import("fusedloss", self)
        linear_cross_entropy = getattr(fusedloss, "linear_cross_entropy", None)
        if linear_cross_entropy is None:
            raise Unavailable("fusedloss has no linear_cross_entropy yet")
        resolve = None
        if self.filtered:
            from fusedloss.core.filtering import resolve_filter_eps as resolve

        def loss(e: Tensor, c: Tensor, y: Tensor) -> Tensor:
            extra: dict[str, Any] = {"filter_eps": None} if self.exact else {}
            if resolve is not None:
                extra["filter_eps"] = resolve("auto", e.dtype)
            return linear_cross_entropy(e, c, y, backend="triton", softcap=softcap, **extra)

        return _compiled(loss) if self.compiled else loss

    def describe(self) -> str:
        extra = (", filter_eps=None" if self.exact else
                 ", filter_eps=<the filter's bound for the dtype>" if self.filtered else "")
        call = f'fusedloss.linear_cross_entropy(E, C, y, backend="triton", softcap=s{extra})'
        return f"torch.compile({call}, fullgraph=True)" if self.compiled else call


def _compiled(function: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``function`` under ``torch.compile(fullgraph=True)``, from an empty compile cache (each
    case has new static shapes: earlier cases' graphs must not leak in)."""
    import torch._dynamo

    torch._dynamo.reset()
    return torch.compile(function, fullgraph=True)


# ----------------------------------------------------------------------------- torch


def torch_eager_loss(e: Tensor, c: Tensor, y: Tensor, softcap: float | None = None) -> Tensor:
    """The plain PyTorch LM head: bf16 logits, upcast, soft-capped (``softcap`` s:
    ``s·tanh(z/s)``, in fp32), cross-entropy (mean)."""
    logits = F.linear(e, c).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, y)


TORCH_EAGER_CALL = "F.cross_entropy(cap(F.linear(E, C).float()), y), cap(z) = s·tanh(z/s) or z"


class TorchEagerProvider(LMHeadProvider):
    key = "torch-eager"
    label = "torch eager"

    def build(self, device: torch.device, softcap: float | None = None) -> LossFn:
        return functools.partial(torch_eager_loss, softcap=softcap)

    def describe(self) -> str:
        return TORCH_EAGER_CALL


class TorchCompileProvider(LMHeadProvider):
    """The eager function under ``torch.compile`` (static shapes, compiled per case).

    Compilation happens in the suite's first, untimed call; a compile error surfaces
    there and is reported as the provider's failure.
    """

    key = "torch-compile"
    label = "torch.compile"

    def build(self, device: torch.device, softcap: float | None = None) -> LossFn:
        # Each case has new static shapes; start from an empty cache so old graphs and
        # automatic-dynamic decisions from earlier cases cannot leak in.
        import torch._dynamo

        torch._dynamo.reset()
        return torch.compile(functools.partial(torch_eager_loss, softcap=softcap), dynamic=False)

    def describe(self) -> str:
        return f"torch.compile({TORCH_EAGER_CALL}, dynamic=False)"


def chunked_options(options_class: type) -> Any:
    """A ``torch.nn.LinearCrossEntropyOptions`` that selects the chunked strategy.

    Fields are read at run time (the class is new and may change): prefer the automatic
    chunk-size heuristic, else a fixed batch chunk, else the zero-argument default (which
    already opts in to the chunked path).
    """
    if dataclasses.is_dataclass(options_class):
        fields = {field.name for field in dataclasses.fields(options_class)}
    else:
        fields = set(inspect.signature(options_class).parameters)
    if "chunking_method" in fields:
        return options_class(chunking_method="auto")
    if "batch_chunk_size" in fields:
        return options_class(batch_chunk_size=1024)
    return options_class()


class TorchChunkedProvider(LMHeadProvider):
    """``F.linear_cross_entropy(E, C, y, options=LinearCrossEntropyOptions(…))``, torch ≥ 2.13;
    it has no soft-cap, so a soft-capped head is unavailable to it."""

    key = "torch-chunked"
    label = "torch chunked"

    def __init__(self) -> None:
        self.options: Any = None

    def build(self, device: torch.device, softcap: float | None = None) -> LossFn:
        if softcap is not None:
            raise Unavailable(f"F.linear_cross_entropy has no softcap (this head's: {softcap:g})")
        function = getattr(F, "linear_cross_entropy", None)
        options_class = getattr(torch.nn, "LinearCrossEntropyOptions", None)
        if function is None or options_class is None:
            raise Unavailable(
                f"torch {torch.__version__} has no F.linear_cross_entropy with "
                "LinearCrossEntropyOptions (needs torch ≥ 2.13)"
            )
        self.options = chunked_options(options_class)
        options = self.options
        return lambda e, c, y: function(e, c, y, options=options)

    def describe(self) -> str:
        return f"F.linear_cross_entropy(E, C, y, options={self.options!r})"


# ----------------------------------------------------------------------------- peers


class CutCrossEntropyProvider(LMHeadProvider):
    """apple/ml-cross-entropy: ``linear_cross_entropy(e, c, targets)`` (default filter)."""

    distribution = "cut-cross-entropy"
    is_peer = True
    install_hint = "pip install cut-cross-entropy==25.1.1 --no-deps"

    def __init__(self, no_filter: bool = False):
        self.no_filter = no_filter
        self.key = "cce-nofilter" if no_filter else "cce"
        self.label = "cut-cross-entropy, no filter" if no_filter else "cut-cross-entropy"

    def display_name(self) -> str:
        version = self.version()
        base = f"cut-cross-entropy {version}" if version else "cut-cross-entropy"
        return f"{base}, no filter" if self.no_filter else base

    def build(self, device: torch.device, softcap: float | None = None) -> LossFn:
        module = _import("cut_cross_entropy", self)
        function = getattr(module, "linear_cross_entropy", None)
        if function is None:
            raise Unavailable("cut_cross_entropy has no linear_cross_entropy")
        extra: dict[str, Any] = {"softcap": softcap}
        if self.no_filter:
            if "filter_eps" not in inspect.signature(function).parameters:
                raise Unavailable("this cut_cross_entropy has no filter_eps argument")
            extra["filter_eps"] = None
        return lambda e, c, y: function(e, c, y, **extra)

    def describe(self) -> str:
        extra = ", filter_eps=None" if self.no_filter else ""
        return f"cut_cross_entropy.linear_cross_entropy(E, C, y, softcap=s{extra})"


class LigerProvider(LMHeadProvider):
    """liger-kernel's fused linear cross-entropy (gradients computed inside the forward):
    ``LigerFusedLinearCrossEntropyLoss(reduction="mean", softcap=s)``, whose
    ``forward(lin_weight, _input, target)`` (0.8.x) takes the classifier first."""

    key = "liger"
    label = "liger-kernel FLCE"
    distribution = "liger-kernel"
    is_peer = True
    install_hint = "pip install liger-kernel==0.8.5 --no-deps"

    def display_name(self) -> str:
        version = self.version()
        return f"liger-kernel {version} FLCE" if version else self.label

    def build(self, device: torch.device, softcap: float | None = None) -> LossFn:
        module = _import("liger_kernel.transformers.fused_linear_cross_entropy", self)
        loss_class = getattr(module, "LigerFusedLinearCrossEntropyLoss", None)
        if loss_class is None:
            raise Unavailable("liger_kernel has no LigerFusedLinearCrossEntropyLoss")
        loss_module = loss_class(reduction="mean", softcap=softcap)
        return lambda e, c, y: loss_module(c, e, y)  # the loss alone: no return_* flag set

    def describe(self) -> str:
        return "LigerFusedLinearCrossEntropyLoss(reduction='mean', softcap=s)(C, E, y)"


# ----------------------------------------------------------------------------- registry


def lm_head_providers() -> dict[str, LMHeadProvider]:
    """All LM-head providers by command-line key, in table order."""
    providers: list[LMHeadProvider] = [
        FusedLossProvider(),
        FusedLossProvider(exact=True),
        FusedLossProvider(filtered=True),
        FusedLossProvider(compiled=True),
        TorchEagerProvider(),
        TorchCompileProvider(),
        TorchChunkedProvider(),
        CutCrossEntropyProvider(),
        CutCrossEntropyProvider(no_filter=True),
        LigerProvider(),
    ]
    return {provider.key: provider for provider in providers}


# ============================================================================= contrastive

CLIP, NT_XENT, SIGLIP = "clip", "nt-xent", "siglip"
CONTRASTIVE_LOSSES = (CLIP, NT_XENT, SIGLIP)
# What a contrastive provider's loss function takes (all features (rows, c), same dtype):
CONTRASTIVE_SIGNATURES = {
    CLIP: "loss(image, text, logit_scale)",  # logit_scale: 0-dim fp32 tensor (gets a gradient)
    NT_XENT: "loss(features, temperature)",  # features (2B, c): two views stacked; τ a float
    SIGLIP: "loss(image, text, logit_scale, logit_bias)",  # both 0-dim fp32 tensors
}
ContrastiveFn = Callable[..., Tensor]


class ContrastiveProvider:
    """One implementation of some contrastive losses (mean reduction, as the libraries')."""

    key: str = ""
    label: str = ""
    distribution: str | None = None
    is_peer: bool = False
    install_hint: str = ""
    losses: tuple[str, ...] = CONTRASTIVE_LOSSES

    def version(self) -> str | None:
        return package_version(self.distribution) if self.distribution else None

    def display_name(self) -> str:
        version = self.version() if self.is_peer else None
        return f"{self.label} {version}" if version else self.label

    def supports(self, loss: str) -> bool:
        return loss in self.losses

    def build(self, device: torch.device, loss: str) -> ContrastiveFn:
        """Import what is needed and return the loss function (raise Unavailable)."""
        raise NotImplementedError

    def describe(self, loss: str) -> str:
        """The exact call being measured, for the results file."""
        return ""


class FusedLossContrastiveProvider(ContrastiveProvider):
    """``fusedloss.clip_loss`` / ``nt_xent_loss`` / ``siglip_loss`` with an explicit backend.

    ``exact=True`` passes ``filter_eps=None`` (every tile of the backward computed; SigLIP has
    no filtering, so the exact variant does not apply to it). ``compiled=True`` measures the
    call inside ``torch.compile(fullgraph=True)``.
    """

    distribution = "fusedloss"

    def __init__(self, backend: str = "triton", exact: bool = False, compiled: bool = False):
        self.backend, self.exact, self.compiled = backend, exact, compiled
        self.key = "fusedloss-exact" if exact else "fusedloss-compile" if compiled else "fusedloss"
        self.label = ("fusedloss (exact)" if exact else
                      "fusedloss (compiled)" if compiled else "fusedloss")
        self.losses = (CLIP, NT_XENT) if exact else CONTRASTIVE_LOSSES

    def build(self, device: torch.device, loss: str) -> ContrastiveFn:
        fusedloss = _import("fusedloss", self)
        name = {CLIP: "clip_loss", NT_XENT: "nt_xent_loss", SIGLIP: "siglip_loss"}[loss]
        function = getattr(fusedloss, name, None)
        if function is None:
            raise Unavailable(f"fusedloss has no {name}")
        backend = self.backend
        extra: dict[str, Any] = {"filter_eps": None} if self.exact else {}
        if loss == CLIP:
            call = lambda i, t, s: function(i, t, s, backend=backend, **extra)
        elif loss == NT_XENT:
            call = lambda z, tau: function(z, temperature=tau, backend=backend, **extra)
        else:
            call = lambda i, t, s, bias: function(i, t, s, bias, backend=backend)
        return _compiled(call) if self.compiled else call

    def describe(self, loss: str) -> str:
        extra = ", filter_eps=None" if self.exact else ""
        backend = f'backend="{self.backend}"'
        if loss == CLIP:
            call = f"fusedloss.clip_loss(image, text, logit_scale, {backend}{extra})"
        elif loss == NT_XENT:
            call = f"fusedloss.nt_xent_loss(z, temperature=τ, {backend}{extra})"
        else:
            call = f"fusedloss.siglip_loss(image, text, logit_scale, logit_bias, {backend})"
        return f"torch.compile({call}, fullgraph=True)" if self.compiled else call


def materialized_clip_loss(image: Tensor, text: Tensor, logit_scale: Tensor) -> Tensor:
    """open_clip's ``ClipLoss`` on one process: b×b logits in the input dtype, fp32 CE.

    ``logits = logit_scale * image @ text.T`` (bf16 for bf16 features), then
    ``(CE(logits, arange) + CE(logits.T, arange)) / 2`` on the logits upcast to fp32 (what
    autocast does with ``cross_entropy``).
    """
    logits = logit_scale * image @ text.T
    labels = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits.float(), labels) + F.cross_entropy(logits.T.float(), labels)) / 2


def materialized_nt_xent_loss(features: Tensor, temperature: float) -> Tensor:
    """SimCLR's NT-Xent with the 2B×2B logits: ``Z Zᵀ/τ`` in the input dtype, diagonal −inf.

    Row i's target is ``(i + B) mod 2B``; CE (mean over the 2B rows) on the logits upcast to
    fp32. The diagonal is filled in place (no 2B×2B mask).
    """
    logits = (features @ features.T) / temperature
    logits.fill_diagonal_(float("-inf"))
    rows = logits.shape[0]
    targets = (torch.arange(rows, device=logits.device) + rows // 2) % rows
    return F.cross_entropy(logits.float(), targets)


def materialized_siglip_loss(
    image: Tensor, text: Tensor, logit_scale: Tensor, logit_bias: Tensor
) -> Tensor:
    """open_clip's ``SigLipLoss`` on one process: ``−Σ logsigmoid(z ⊙ logits) / b``.

    ``logits = logit_scale * image @ text.T + logit_bias`` and the ±1 labels ``z`` (built as
    open_clip does, ``2·eye − 1``) in the input dtype; logsigmoid and the sum in fp32.
    """
    logits = logit_scale * image @ text.T + logit_bias
    n = logits.shape[0]
    labels = 2 * torch.eye(n, device=logits.device, dtype=logits.dtype) - 1
    return -F.logsigmoid((labels * logits).float()).sum() / n


class TorchMaterializedProvider(ContrastiveProvider):
    """The plain PyTorch losses that hold the whole b×b (2B×2B) logits matrix."""

    key = "torch"
    label = "torch materialized"

    def build(self, device: torch.device, loss: str) -> ContrastiveFn:
        return {
            CLIP: materialized_clip_loss,
            NT_XENT: materialized_nt_xent_loss,
            SIGLIP: materialized_siglip_loss,
        }[loss]

    def describe(self, loss: str) -> str:
        if loss == CLIP:
            return (
                "logits = logit_scale * image @ text.T; (F.cross_entropy(logits.float(), "
                "arange(b)) + F.cross_entropy(logits.T.float(), arange(b))) / 2"
            )
        if loss == NT_XENT:
            return (
                "logits = (z @ z.T) / τ; logits.fill_diagonal_(-inf); "
                "F.cross_entropy(logits.float(), (arange(2B) + B) % 2B)"
            )
        return (
            "logits = logit_scale * image @ text.T + logit_bias; labels = 2·eye(b) − 1; "
            "-F.logsigmoid((labels * logits).float()).sum() / b"
        )


# inf-cl's process group: created here only when none exists, destroyed at the suite's end.
_benchmark_process_group: dict[str, Any] = {"created": False, "note": ""}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ensure_single_process_group(device: torch.device) -> str:
    """A torch.distributed default group for inf-cl on one GPU; returns what was done.

    inf-cl's ``cal_inf_loss`` sends the gradient of ``scale`` through ``dist.all_reduce``
    (its ``GradientGather``), so a tensor ``logit_scale`` needs a process group even on one
    GPU. With a group initialized it takes its ring path (``InfProb``: the same Triton
    kernels, plus one send/receive of dk to itself in the backward). That self send works
    with NCCL, not with gloo ("Pair is not connected"), so the group is a single-process NCCL
    group (world size 1) on a TCPStore at a free local port. An existing group is used as is.
    """
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
    if _benchmark_process_group["created"]:  # created, then destroyed by someone else
        _benchmark_process_group["created"] = False
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

    ``scale_inside``: pass ``logit_scale`` to ``cal_inf_loss`` (its gradient then goes through
    inf-cl's ``GradientGather``: needs a process group); otherwise multiply the features by it
    first, which is what ``cal_inf_loss`` does inside. Labels are ``arange(b)``, cached.
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


class InfCLProvider(ContrastiveProvider):
    """Inf-CLIP's ``cal_inf_loss``, called once per direction as its ``InfClipLoss`` does::

        loss = ((cal_inf_loss(image, text, labels, logit_scale)
                 + cal_inf_loss(text, image, labels, logit_scale)) / 2).mean()

    inf-cl casts the features to fp32 and multiplies in TF32 (64×64 tiles); bf16 features
    are accepted (``scale * q`` is formed in the features' dtype first). A tensor
    ``logit_scale`` needs a process group (:func:`ensure_single_process_group`); when none
    can be made, the scale is applied outside instead (``cal_inf_loss(s·q, k, labels)``,
    inf-cl's single-device path, the same kernels) and the call says so.
    """

    key = "inf-cl"
    label = "inf-cl"
    distribution = "inf-cl"
    is_peer = True
    install_hint = "pip install inf-cl==1.2.1 --no-deps"
    losses = (CLIP,)

    def __init__(self) -> None:
        self.call = ""
        self.process_group_note = ""

    def build(self, device: torch.device, loss: str) -> ContrastiveFn:
        module = _import("inf_cl", self)
        function = getattr(module, "cal_inf_loss", None)
        if function is None:
            raise Unavailable("inf_cl has no cal_inf_loss")
        if loss != CLIP:
            raise Unavailable(f"inf-cl has no {loss} loss")
        if device.type != "cuda":
            raise Unavailable("inf-cl's Triton kernels need a CUDA device")
        try:
            self.process_group_note = ensure_single_process_group(device)
        except Exception as error:  # no NCCL here: inf-cl's single-device path instead
            self.process_group_note = (
                f"no process group ({type(error).__name__}: {str(error)[:200]}); the scale is "
                "applied outside cal_inf_loss (no GradientGather)"
            )
            self.call = (
                "((cal_inf_loss(s * image, text, labels, head_dim=h) + "
                "cal_inf_loss(s * text, image, labels, head_dim=h)) / 2).mean()"
            )
            return inf_clip_loss(function, scale_inside=False)
        self.call = (
            "((cal_inf_loss(image, text, labels, logit_scale, head_dim=h) + "
            "cal_inf_loss(text, image, labels, logit_scale, head_dim=h)) / 2).mean()"
        )
        return inf_clip_loss(function, scale_inside=True)

    def describe(self, loss: str) -> str:
        note = f" [{self.process_group_note}]" if self.process_group_note else ""
        return f"{self.call}, labels = arange(b), h = 256 (c % 256 ≠ 0: 128, 64, …){note}"


def contrastive_providers(backend: str = "triton") -> dict[str, ContrastiveProvider]:
    """All contrastive providers by command-line key, in table order."""
    providers: list[ContrastiveProvider] = [
        FusedLossContrastiveProvider(backend),
        FusedLossContrastiveProvider(backend, exact=True),
        FusedLossContrastiveProvider(backend, compiled=True),
        TorchMaterializedProvider(),
        InfCLProvider(),
    ]
    return {provider.key: provider for provider in providers}
