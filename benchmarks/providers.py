"""The implementations the benchmarks compare (ours, torch's, the peers'), by command-line key:
a provider builds the loss function (mean) a suite times, or raises ``common.Unavailable``."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.common import Unavailable, package_version

CLIP, NT_XENT, SIGLIP, INFO_NCE = "clip", "nt-xent", "siglip", "info-nce"
CONTRASTIVE_LOSSES = (CLIP, NT_XENT, SIGLIP, INFO_NCE)


@dataclass(eq=False)
class Provider:
    """``builder(provider, device, arg)`` makes the loss function (``arg``: the head's soft-cap,
    or the contrastive loss); a peer (third party) has an ``install_hint``."""

    key: str = ""  # command-line name
    label: str = ""  # column title
    builder: Callable[..., Callable[..., Tensor]] | None = None
    call: str | dict[str, str] = ""  # the exact call measured (contrastive: by loss)
    distribution: str | None = None
    install_hint: str = ""
    compile: dict[str, bool] | None = None
    losses: tuple[str, ...] = CONTRASTIVE_LOSSES  # contrastive: the losses it has
    is_peer: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.is_peer = bool(self.install_hint)

    def display_name(self) -> str:
        version = package_version(self.distribution) if self.is_peer and self.distribution else None
        return f"{self.label} {version}" if version else self.label

    def build(self, device: torch.device, arg: Any = None) -> Callable[..., Tensor]:
        """The loss function (raise Unavailable)."""
        assert self.builder is not None
        function = self.builder(self, device, arg)
        if self.compile is None:
            return function
        torch._dynamo.reset()  # each case has new static shapes: earlier graphs must not leak in
        return torch.compile(function, **self.compile)  # compiled in the untimed first call

    def describe(self, loss: str | None = None) -> str:
        call = self.call[loss] if isinstance(self.call, dict) else self.call
        if self.compile is None:
            return call
        return f"torch.compile({call}, {', '.join(f'{k}={v}' for k, v in self.compile.items())})"

    def supports(self, loss: str) -> bool:
        return loss in self.losses


def _function(provider: Provider, module: str, name: str) -> Any:
    """``module.name``, else Unavailable (with the install hint when the import fails)."""
    try:
        found = importlib.import_module(module)
    except ImportError as error:
        hint = f" ({provider.install_hint})" if provider.install_hint else ""
        raise Unavailable(f"{module} not importable: {error}{hint}") from error
    if not hasattr(found, name):
        raise Unavailable(f"{module.split('.')[0]} has no {name}")
    return getattr(found, name)


# ============================================================================= LM head
def torch_eager_loss(e: Tensor, c: Tensor, y: Tensor, softcap: float | None = None) -> Tensor:
    """bf16 logits, upcast, soft-capped (``s·tanh(z/s)``), cross-entropy (mean)."""
    logits = F.linear(e, c).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, y)


def _fusedloss_lce(exact: bool) -> Callable[..., Callable[..., Tensor]]:
    def build(p: Provider, device: torch.device, softcap: float | None = None) -> Any:
        function = _function(p, "fusedloss", "linear_cross_entropy")
        extra = {"filter_eps": None} if exact else {}
        return lambda e, c, y: function(e, c, y, backend="triton", softcap=softcap, **extra)

    return build


def _torch(p: Provider, device: torch.device, softcap: float | None = None) -> Any:
    return functools.partial(torch_eager_loss, softcap=softcap)


def _liger(p: Provider, device: torch.device, softcap: float | None = None) -> Any:
    """liger-kernel 0.8's ``forward(lin_weight, _input, target)`` takes the classifier first."""
    module = "liger_kernel.transformers.fused_linear_cross_entropy"
    loss_class = _function(p, module, "LigerFusedLinearCrossEntropyLoss")
    loss_module = loss_class(reduction="mean", softcap=softcap)
    return lambda e, c, y: loss_module(c, e, y)


def lm_head_providers() -> dict[str, Provider]:
    """All LM-head providers by command-line key, in table order."""
    call = 'fusedloss.linear_cross_entropy(E, C, y, backend="triton", softcap=s{})'
    torch_call = "F.cross_entropy(cap(F.linear(E, C).float()), y), cap(z) = s·tanh(z/s) or z"
    providers = [
        Provider("fusedloss", "fusedloss", _fusedloss_lce(False), call.format("")),
        Provider("fusedloss-exact", "fusedloss (exact)", _fusedloss_lce(True),
                 call.format(", filter_eps=None")),
        Provider("fusedloss-compile", "fusedloss (compiled)", _fusedloss_lce(False),
                 call.format(""), compile={"fullgraph": True}),
        Provider("torch-eager", "torch eager", _torch, torch_call),
        Provider("torch-compile", "torch.compile", _torch, torch_call, compile={"dynamic": False}),
        Provider("cce", "cut-cross-entropy", lambda p, device, softcap=None: functools.partial(
                 _function(p, "cut_cross_entropy", "linear_cross_entropy"), softcap=softcap),
                 "cut_cross_entropy.linear_cross_entropy(E, C, y, softcap=s)",
                 "cut-cross-entropy", "pip install cut-cross-entropy==25.1.1 --no-deps"),
        Provider("liger", "liger-kernel", _liger,
                 "LigerFusedLinearCrossEntropyLoss(reduction='mean', softcap=s)(C, E, y)",
                 "liger-kernel", "pip install liger-kernel==0.8.5 --no-deps"),
    ]
    return {provider.key: provider for provider in providers}


# ============================================================================= contrastive
# The fusedloss function of each contrastive loss, and the arguments every provider takes.
CONTRASTIVE_ARGS = {CLIP: ("clip_loss", "image, text, logit_scale"),
                    NT_XENT: ("nt_xent_loss", "z, temperature=τ"),
                    SIGLIP: ("siglip_loss", "image, text, logit_scale, logit_bias"),
                    INFO_NCE: ("info_nce_loss", "query, keys, temperature=τ")}


def _fusedloss_contrastive(backend: str) -> Callable[..., Callable[..., Tensor]]:
    def build(p: Provider, device: torch.device, loss: str) -> Callable[..., Tensor]:
        function = _function(p, "fusedloss", CONTRASTIVE_ARGS[loss][0])
        if loss == NT_XENT:
            return lambda z, tau: function(z, temperature=tau, backend=backend)
        if loss == INFO_NCE:
            return lambda q, k, tau: function(q, k, temperature=tau, backend=backend)
        return lambda *args: function(*args, backend=backend)

    return build


def materialized_clip_loss(image: Tensor, text: Tensor, logit_scale: Tensor) -> Tensor:
    """open_clip's ``ClipLoss`` on one process: b×b logits in the input dtype, CE in fp32."""
    logits = logit_scale * image @ text.T
    labels = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits.float(), labels) + F.cross_entropy(logits.T.float(), labels)) / 2


def materialized_nt_xent_loss(features: Tensor, temperature: float) -> Tensor:
    """SimCLR's NT-Xent: 2B×2B logits ``Z Zᵀ/τ``, diagonal −inf, row i's target (i + B) mod 2B."""
    logits = (features @ features.T) / temperature
    logits.fill_diagonal_(float("-inf"))
    rows = logits.shape[0]
    targets = (torch.arange(rows, device=logits.device) + rows // 2) % rows
    return F.cross_entropy(logits.float(), targets)


def materialized_siglip_loss(
    image: Tensor, text: Tensor, logit_scale: Tensor, logit_bias: Tensor
) -> Tensor:
    """open_clip's ``SigLipLoss`` on one process: ``−Σ logsigmoid(z ⊙ logits) / b``, z = ±1."""
    logits = logit_scale * image @ text.T + logit_bias
    n = logits.shape[0]
    labels = 2 * torch.eye(n, device=logits.device, dtype=logits.dtype) - 1
    return -F.logsigmoid((labels * logits).float()).sum() / n


def materialized_info_nce_loss(query: Tensor, keys: Tensor, temperature: float) -> Tensor:
    """MoCo-style InfoNCE: N×M logits ``Q Kᵀ/τ`` in the input dtype, CE in fp32, query i's
    positive key i."""
    logits = (query @ keys.T) / temperature
    return F.cross_entropy(logits.float(), torch.arange(logits.shape[0], device=logits.device))


MATERIALIZED = {CLIP: materialized_clip_loss, NT_XENT: materialized_nt_xent_loss,
                SIGLIP: materialized_siglip_loss, INFO_NCE: materialized_info_nce_loss}

# inf-cl's process group: created here only when none exists, destroyed at the suite's end.
_benchmark_process_group: dict[str, Any] = {"created": False, "note": ""}


def ensure_single_process_group(device: torch.device) -> str:
    """A single-process NCCL group for inf-cl (its ``cal_inf_loss`` all-reduces the scale's
    gradient; its ring sends to itself, which gloo cannot); returns what was done."""
    import torch.distributed as dist

    if not dist.is_initialized():
        store = dist.TCPStore("127.0.0.1", 0, 1, True)  # port 0: a free one
        index = torch.cuda.current_device() if device.index is None else device.index
        dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                                device_id=torch.device("cuda", index))
        _benchmark_process_group.update(created=True, note=(
            "torch.distributed initialized by the benchmark: single-process NCCL group (world "
            f"size 1, TCPStore 127.0.0.1:{store.port}); inf-cl runs its ring path with one rank"))
    if _benchmark_process_group["created"]:
        return str(_benchmark_process_group["note"])
    return f"existing process group ({dist.get_backend()}, {dist.get_world_size()} ranks)"


def destroy_benchmark_process_group() -> None:
    """Tear down the group :func:`ensure_single_process_group` created (if any)."""
    import torch.distributed as dist

    if _benchmark_process_group["created"] and dist.is_initialized():
        dist.destroy_process_group()
    _benchmark_process_group["created"] = False


def inf_cl_head_dim(width: int) -> int:
    """inf-cl views (b, c) features as (b, c / h, h): h = 256, else 128, 64, 32, 16 dividing c."""
    for head_dim in (256, 128, 64, 32, 16):
        if width % head_dim == 0:
            return head_dim
    raise Unavailable(f"inf-cl needs a width divisible by 16, got c = {width}")


def inf_clip_loss(cal_inf_loss: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """The CLIP loss from inf-cl's one-direction ``cal_inf_loss``, as ``InfClipLoss`` calls it
    (``logit_scale`` passed to it: it needs a process group)."""

    @functools.lru_cache(maxsize=1)
    def labels_for(rows: int, device: torch.device) -> Tensor:
        return torch.arange(rows, device=device)

    def loss(image: Tensor, text: Tensor, scale: Tensor) -> Tensor:
        labels = labels_for(image.shape[0], image.device)
        head_dim = inf_cl_head_dim(image.shape[1])
        i2t = cal_inf_loss(image, text, labels, scale, head_dim=head_dim)
        t2i = cal_inf_loss(text, image, labels, scale, head_dim=head_dim)
        return ((i2t + t2i) / 2).mean()

    return loss


def _inf_cl(p: Provider, device: torch.device, loss: str) -> Callable[..., Tensor]:
    """Inf-CLIP's ``cal_inf_loss`` once per direction, in a process group (fp32 features)."""
    function = _function(p, "inf_cl", "cal_inf_loss")
    if loss != CLIP:
        raise Unavailable(f"inf-cl has no {loss} loss")
    if device.type != "cuda":
        raise Unavailable("inf-cl's Triton kernels need a CUDA device")
    try:
        p.process_group_note = ensure_single_process_group(device)
    except Exception as error:
        raise Unavailable(f"no process group for inf-cl: {error}") from error
    return inf_clip_loss(function)


INF_CL_CALL = ("((cal_inf_loss(image, text, labels, logit_scale, head_dim=h) + cal_inf_loss(text, "
               "image, labels, logit_scale, head_dim=h)) / 2).mean(), labels = arange(b), h = 256 "
               "(c % 256 ≠ 0: 128, 64, …)")


def contrastive_providers(backend: str = "triton") -> dict[str, Provider]:
    """All contrastive providers by command-line key, in table order."""
    fusedloss_calls = {loss: f'fusedloss.{name}({args}, backend="{backend}")'
                       for loss, (name, args) in CONTRASTIVE_ARGS.items()}
    materialized_calls = {loss: f"benchmarks.providers.{MATERIALIZED[loss].__name__}({args})"
                          for loss, (_, args) in CONTRASTIVE_ARGS.items()}
    providers = [
        Provider("fusedloss", "fusedloss", _fusedloss_contrastive(backend), fusedloss_calls),
        Provider("fusedloss-compile", "fusedloss (compiled)", _fusedloss_contrastive(backend),
                 fusedloss_calls, compile={"fullgraph": True}),
        Provider("torch", "torch materialized", lambda p, device, loss: MATERIALIZED[loss],
                 materialized_calls),
        Provider("inf-cl", "inf-cl", _inf_cl, {CLIP: INF_CL_CALL}, "inf-cl",
                 "pip install inf-cl==1.2.1 --no-deps", losses=(CLIP,)),
    ]
    return {provider.key: provider for provider in providers}
