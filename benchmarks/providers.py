"""Implementations compared by the benchmarks: ours and the peers', behind one interface.

A provider turns into a loss function ``loss(E, C, y) -> scalar`` (mean reduction) once
per case; the suite times ``loss(E, C, y)`` (forward) or ``torch.autograd.grad(loss, (E, C))``
(forward+backward) itself, so every provider is measured the same way. A provider whose
package or API is missing raises :class:`Unavailable` from ``build`` and the suite skips
it with that note.

Peers install as pure-Python wheels without dependencies::

    pip install cut-cross-entropy==25.1.1 liger-kernel==0.8.5 --no-deps
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
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

    def build(self, device: torch.device) -> LossFn:
        """Import what is needed and return the loss function (raise Unavailable)."""
        raise NotImplementedError

    def describe(self) -> str:
        """The exact call being measured, for the results file."""
        return ""


def _import(module: str, provider: LMHeadProvider) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        hint = f" ({provider.install_hint})" if provider.install_hint else ""
        raise Unavailable(f"{module} not importable: {error}{hint}") from error


# ----------------------------------------------------------------------------- ours


class FusedLossProvider(LMHeadProvider):
    """``fusedloss.linear_cross_entropy(E, C, y, backend="triton")``, optionally exact."""

    distribution = "fusedloss"

    def __init__(self, exact: bool = False):
        self.exact = exact
        self.key = "fusedloss-exact" if exact else "fusedloss"
        self.label = "fusedloss (exact)" if exact else "fusedloss"

    def build(self, device: torch.device) -> LossFn:
        fusedloss = _import("fusedloss", self)
        linear_cross_entropy = getattr(fusedloss, "linear_cross_entropy", None)
        if linear_cross_entropy is None:
            raise Unavailable("fusedloss has no linear_cross_entropy yet")
        if self.exact:
            return lambda e, c, y: linear_cross_entropy(e, c, y, backend="triton", filter_eps=None)
        return lambda e, c, y: linear_cross_entropy(e, c, y, backend="triton")

    def describe(self) -> str:
        extra = ", filter_eps=None" if self.exact else ""
        return f'fusedloss.linear_cross_entropy(E, C, y, backend="triton"{extra})'


# ----------------------------------------------------------------------------- torch


def torch_eager_loss(e: Tensor, c: Tensor, y: Tensor) -> Tensor:
    """The plain PyTorch LM head: bf16 logits, upcast, cross-entropy (mean)."""
    return F.cross_entropy(F.linear(e, c).float(), y)


class TorchEagerProvider(LMHeadProvider):
    key = "torch-eager"
    label = "torch eager"

    def build(self, device: torch.device) -> LossFn:
        return torch_eager_loss

    def describe(self) -> str:
        return "F.cross_entropy(F.linear(E, C).float(), y)"


class TorchCompileProvider(LMHeadProvider):
    """The eager function under ``torch.compile`` (static shapes, compiled per case).

    Compilation happens in the suite's first, untimed call; a compile error surfaces
    there and is reported as the provider's failure.
    """

    key = "torch-compile"
    label = "torch.compile"

    def build(self, device: torch.device) -> LossFn:
        # Each case has new static shapes; start from an empty cache so old graphs and
        # automatic-dynamic decisions from earlier cases cannot leak in.
        import torch._dynamo

        torch._dynamo.reset()
        return torch.compile(torch_eager_loss, dynamic=False)

    def describe(self) -> str:
        return "torch.compile(F.cross_entropy(F.linear(E, C).float(), y), dynamic=False)"


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
    """``F.linear_cross_entropy(E, C, y, options=LinearCrossEntropyOptions(…))``, torch ≥ 2.13."""

    key = "torch-chunked"
    label = "torch chunked"

    def __init__(self) -> None:
        self.options: Any = None

    def build(self, device: torch.device) -> LossFn:
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

    def build(self, device: torch.device) -> LossFn:
        module = _import("cut_cross_entropy", self)
        function = getattr(module, "linear_cross_entropy", None)
        if function is None:
            raise Unavailable("cut_cross_entropy has no linear_cross_entropy")
        if not self.no_filter:
            return lambda e, c, y: function(e, c, y)
        if "filter_eps" not in inspect.signature(function).parameters:
            raise Unavailable("this cut_cross_entropy has no filter_eps argument")
        return lambda e, c, y: function(e, c, y, filter_eps=None)

    def describe(self) -> str:
        extra = ", filter_eps=None" if self.no_filter else ""
        return f"cut_cross_entropy.linear_cross_entropy(E, C, y{extra})"


class LigerProvider(LMHeadProvider):
    """liger-kernel's fused linear cross-entropy (gradients computed inside the forward).

    Uses ``LigerFusedLinearCrossEntropyLoss`` (``forward(lin_weight, _input, target)`` in
    0.8.x; the argument order is read from its signature), else the functional
    ``liger_fused_linear_cross_entropy(input, weight, target)``.
    """

    key = "liger"
    label = "liger-kernel FLCE"
    distribution = "liger-kernel"
    is_peer = True
    install_hint = "pip install liger-kernel==0.8.5 --no-deps"

    def __init__(self) -> None:
        self.call = ""

    def display_name(self) -> str:
        version = self.version()
        return f"liger-kernel {version} FLCE" if version else self.label

    def build(self, device: torch.device) -> LossFn:
        _import("liger_kernel", self)  # a missing package gives one clear note
        errors = []
        try:
            return self._build_module()
        except Unavailable as error:
            errors.append(str(error))
        try:
            return self._build_functional()
        except Unavailable as error:
            errors.append(str(error))
        raise Unavailable("; ".join(errors))

    def _build_module(self) -> LossFn:
        module = _import("liger_kernel.transformers.fused_linear_cross_entropy", self)
        loss_class = getattr(module, "LigerFusedLinearCrossEntropyLoss", None)
        if loss_class is None:
            raise Unavailable("liger_kernel has no LigerFusedLinearCrossEntropyLoss")
        loss_module = loss_class(reduction="mean")
        names = list(inspect.signature(loss_module.forward).parameters)
        weight_first = bool(names) and names[0] in ("lin_weight", "weight", "linear_weight")
        self.call = "LigerFusedLinearCrossEntropyLoss(reduction='mean')" + (
            "(C, E, y)" if weight_first else "(E, C, y)"
        )
        if weight_first:
            return lambda e, c, y: _loss_only(loss_module(c, e, y))
        return lambda e, c, y: _loss_only(loss_module(e, c, y))

    def _build_functional(self) -> LossFn:
        module = _import("liger_kernel.transformers.functional", self)
        function = getattr(module, "liger_fused_linear_cross_entropy", None)
        if function is None:
            raise Unavailable("liger_kernel has no liger_fused_linear_cross_entropy")
        self.call = "liger_fused_linear_cross_entropy(E, C, y, reduction='mean')"
        return lambda e, c, y: _loss_only(function(e, c, y, reduction="mean"))

    def describe(self) -> str:
        return self.call


def _loss_only(output: Any) -> Tensor:
    """Liger may return a named tuple with the loss and extras."""
    return output if isinstance(output, Tensor) else output.loss


# ----------------------------------------------------------------------------- registry


def lm_head_providers() -> dict[str, LMHeadProvider]:
    """All LM-head providers by command-line key, in table order."""
    providers: list[LMHeadProvider] = [
        FusedLossProvider(),
        FusedLossProvider(exact=True),
        TorchEagerProvider(),
        TorchCompileProvider(),
        TorchChunkedProvider(),
        CutCrossEntropyProvider(),
        CutCrossEntropyProvider(no_filter=True),
        LigerProvider(),
    ]
    return {provider.key: provider for provider in providers}
