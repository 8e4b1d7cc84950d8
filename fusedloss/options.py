"""The LM head's options as one object: built from the public arguments, checked in one place
(``check``), carried to the ops.

``fusedloss.linear_cross_entropy`` (and the vocabulary-parallel head and the module that wrap
it) spell the options out, as PyTorch's signature does; past the argument list they travel as a
:class:`CrossEntropyOptions`.
"""

from __future__ import annotations

import dataclasses

from .core.chunked_logits import LossOptions

REDUCTIONS = ("none", "mean", "sum")


@dataclasses.dataclass(frozen=True)
class CrossEntropyOptions:
    """The options of ``fusedloss.linear_cross_entropy`` (its docstring says what each does),
    as given: ``check`` raises for a bad value, naming the argument."""

    reduction: str = "mean"
    ignore_index: int | None = None  # None: PyTorch's default, -100 for class indices
    label_smoothing: float = 0.0
    softcap: float | None = None
    z_loss: float = 0.0
    shift: bool = False
    filter_eps: float | str | None = "auto"
    return_lse: bool = False
    backend: str = "auto"

    def check(self) -> None:
        """ValueError naming the option for a value outside its domain (those that need no
        tensor; ``filter_eps`` and ``backend`` are resolved, and checked, against the input)."""
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be 'none', 'mean' or 'sum', got {self.reduction!r}")
        if not 0.0 <= float(self.label_smoothing) <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing}")
        if self.softcap is not None and not 0.0 < float(self.softcap) < float("inf"):
            raise ValueError(f"softcap must be None or a finite value > 0, got {self.softcap}")
        if not float(self.z_loss) >= 0.0:
            raise ValueError(f"z_loss must be >= 0, got {self.z_loss}")

    @property
    def index_to_ignore(self) -> int:
        """The target value that is ignored with class-index targets."""
        return -100 if self.ignore_index is None else int(self.ignore_index)

    def loss(self) -> LossOptions:
        """The options that define the loss, as the kernels take them."""
        return LossOptions(self.index_to_ignore, float(self.label_smoothing),
                           None if self.softcap is None else float(self.softcap),
                           float(self.z_loss))
