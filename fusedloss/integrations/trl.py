"""TRL's trainers on fusedloss's LM head.

TRL (1.16) trains every causal LM through a fused head of its own: its trainers (SFT, DPO, KTO,
GRPO, RLOO) wrap the model's forward (``trl.trainer.utils.add_fused_lm_head``) and call
``model(..., labels=labels, fused_lm_head=True)``, which runs the backbone and then TRL's
``ChunkedLogProbFunction`` over ``lm_head.weight``: per-token log-probabilities (and, as each
trainer asks, the entropy, log Σ p², the mean logit, whether the target is the argmax), with
the logits formed in the input dtype tile by tile. ``apply_fusedloss_to_trl()`` swaps that
function for :class:`LogProbFunction`, which computes the same outputs with
``fusedloss.linear_log_probs``' op: no logits at all, statistics and gradients accumulated in
fp32. TRL keeps everything around it (the shift, the masking of prompt and padding tokens, its
losses, FSDP's gathering of the head)::

    from fusedloss.integrations.trl import apply_fusedloss_to_trl
    apply_fusedloss_to_trl()          # before or after the trainer is built: looked up per call
    trainer = trl.DPOTrainer(...)     # or GRPOTrainer, SFTTrainer, KTOTrainer, RLOOTrainer
    trainer.train()

``remove_fusedloss_from_trl()`` puts TRL's function back.
"""

from __future__ import annotations

import torch

from ..core import engine
from ..ops import log_probs as ops
from ..ops._common import autocast_operands

# The per-token outputs of TRL's function besides the log-probabilities, in its order.
OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class LogProbFunction:
    """A drop-in for ``trl.kernels.ChunkedLogProbFunction`` (same ``apply`` arguments and
    outputs) computed by fusedloss's core."""

    @staticmethod
    def apply(
        hidden: torch.Tensor,  # (N, D)
        weight: torch.Tensor,  # (V, D)
        bias: torch.Tensor | None,  # (V,)
        targets: torch.Tensor,  # (N,) token ids in [0, V)
        temperature: float,
        chunk_size: int,  # TRL's tile width: the core picks its own tiles
        final_logit_softcapping: float | None = None,
        logit_scale: float = 1.0,
        outputs: tuple[str, ...] = OPTIONAL_OUTPUTS,
    ) -> tuple[torch.Tensor | None, ...]:
        """(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1), each (N,) (fp32; bool
        for is_top1) or None when not in ``outputs``, of softcap(α·(hidden Wᵀ + bias)) / T
        with α = ``logit_scale``. The log-probs and the entropy are differentiable."""
        unknown = set(outputs) - {"log_probs", *OPTIONAL_OUTPUTS}
        if unknown:
            raise ValueError(f"outputs holds {sorted(unknown)}; TRL's are log_probs and "
                             f"{', '.join(OPTIONAL_OUTPUTS)}")
        hidden, weight, bias = autocast_operands(hidden.device, hidden, weight, bias)
        if weight.dtype != hidden.dtype:  # TRL's cast_lm_head_to_fp32: fp32 hidden states
            weight = weight.to(hidden.dtype)
            bias = None if bias is None else bias.to(hidden.dtype)
        if hidden.shape[0] == 0:  # an all-masked micro-batch: zeros, still in the graph
            zero = hidden.sum(dim=-1).float() + weight[:0].float().sum()
            return (zero, *(zero.detach() if name in outputs else None
                            for name in OPTIONAL_OUTPUTS))
        backend = engine.resolve_backend(
            "torch" if hidden.dtype == torch.float64 else "auto", hidden.device)
        (log_prob, entropy, log_sum_squares, mean_logit, _, _, row_stats, target_logit,
         _) = ops.linear_log_probs(
            hidden, weight, targets.long(), None if bias is None else bias.contiguous(), -100,
            float(logit_scale), float(temperature),
            None if final_logit_softcapping is None else float(final_logit_softcapping),
            "entropy" in outputs, "log_sum_sq_probs" in outputs, "mean_logits" in outputs,
            backend)
        # The target is the argmax when its logit is the row's max (a tie counts as a hit).
        is_top1 = target_logit >= row_stats[0] if "is_top1" in outputs else None
        return (log_prob, entropy if "entropy" in outputs else None,
                log_sum_squares if "log_sum_sq_probs" in outputs else None,
                mean_logit if "mean_logits" in outputs else None, is_top1)


_TRL_FUNCTION = "_ChunkedLogProbFunction"


def _trl_utils():
    try:
        from trl.trainer import utils
    except ImportError as error:
        raise ImportError("fusedloss.integrations.trl needs trl (pip install trl)") from error
    if not hasattr(utils, _TRL_FUNCTION):
        raise ImportError(f"this trl ({getattr(utils, '__name__', 'trl')}) has no fused LM head "
                          f"(trl.trainer.utils.{_TRL_FUNCTION}); trl >= 1.16 has")
    return utils


def apply_fusedloss_to_trl() -> None:
    """Makes TRL's fused LM head (every trainer's ``fused_lm_head=True`` call) compute with
    fusedloss. Idempotent; ``remove_fusedloss_from_trl`` undoes it."""
    utils = _trl_utils()
    if getattr(utils, _TRL_FUNCTION) is not LogProbFunction:
        utils._fusedloss_replaced = getattr(utils, _TRL_FUNCTION)
        setattr(utils, _TRL_FUNCTION, LogProbFunction)


def remove_fusedloss_from_trl() -> None:
    """Puts TRL's own fused LM head back (a no-op if fusedloss was not applied)."""
    utils = _trl_utils()
    if getattr(utils, _TRL_FUNCTION) is LogProbFunction:
        setattr(utils, _TRL_FUNCTION, utils._fusedloss_replaced)


def is_fusedloss_applied_to_trl() -> bool:
    return getattr(_trl_utils(), _TRL_FUNCTION) is LogProbFunction
