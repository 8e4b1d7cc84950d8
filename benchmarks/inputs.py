"""Benchmark inputs: LM-head shapes and the "peaked" / "flat" logit regimes.

The generators follow the published protocol every figure in our docs uses, so numbers
compare with the peers' (V×D classifier C, N×D hidden states E, labels y):

    C = randn(V, D) / sqrt(D);  y = randint(0, V, (N,))
    flat:   E = randn(N, D)                                   (random init: p ≈ 1/V)
    peaked: E = 13·C[y] + 2·randn(N, D); then a Zipf frequency prior in feature 0:
            C[:, 0] = −log(rank) / 4 with rank a random permutation of 1..V;  E[:, 0] = 4
    both cast to the benchmark dtype afterwards

"peaked" looks like a trained model (mean loss ≈ 3 nats at V = 256000, a few dozen
softmax entries per row above 2^-12); "flat" is the worst case for gradient filtering.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

REGIMES = ("peaked", "flat")


@dataclass(frozen=True)
class LMHeadShape:
    """A language-model head: vocabulary size V and hidden size D."""

    name: str
    vocab_size: int  # V
    hidden_size: int  # D


LM_HEAD_SHAPES: dict[str, LMHeadShape] = {
    shape.name: shape
    for shape in (
        LMHeadShape("gemma2-2b", 256_000, 2304),
        LMHeadShape("llama3-8b", 128_256, 4096),
        LMHeadShape("phi3.5", 32_064, 3072),
    )
}

# --quick shrinks every shape by these factors (V/128, D/32: odd sizes such as 2000×72
# and 250×96 on purpose) so that a suite runs on a CPU, Triton's interpreter included.
QUICK_VOCAB_DIVISOR = 128
QUICK_HIDDEN_DIVISOR = 32
QUICK_N = 128


def quick_shape(shape: LMHeadShape) -> LMHeadShape:
    """The small stand-in for ``shape`` used by ``--quick`` (same name, smaller V and D)."""
    return LMHeadShape(
        shape.name,
        max(2, shape.vocab_size // QUICK_VOCAB_DIVISOR),
        max(2, shape.hidden_size // QUICK_HIDDEN_DIVISOR),
    )


def make_lm_head_inputs(
    n: int,
    vocab_size: int,
    hidden_size: int,
    regime: str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Hidden states, classifier and labels for one LM-head case.

    Returns ``(E, C, y)``: ``E`` (n, D) and ``C`` (V, D) in ``dtype``, ``y`` (n,) int64 in
    [0, V). Random numbers are drawn in float32 on ``device`` from a generator seeded with
    ``seed``, in the order C, y, then E's noise, then the rank permutation, so one seed
    gives one input per device.
    """
    if regime not in REGIMES:
        raise ValueError(f"unknown regime {regime!r}; expected one of {REGIMES}")
    device = torch.device(device)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)

    def randn(*size: int) -> Tensor:
        return torch.randn(*size, generator=generator, device=device, dtype=torch.float32)

    classifier = randn(vocab_size, hidden_size) / math.sqrt(hidden_size)
    labels = torch.randint(0, vocab_size, (n,), generator=generator, device=device)
    if regime == "flat":
        hidden = randn(n, hidden_size)
    else:
        hidden = 13.0 * classifier[labels] + 2.0 * randn(n, hidden_size)
        rank = torch.randperm(vocab_size, generator=generator, device=device) + 1
        classifier[:, 0] = -torch.log(rank.to(torch.float32)) / 4.0
        hidden[:, 0] = 4.0
    return hidden.to(dtype), classifier.to(dtype), labels
