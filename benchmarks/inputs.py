"""Benchmark inputs: LM-head shapes and logit regimes, and contrastive feature pairs.

LM head (V×D classifier C, N×D hidden states E, labels y), the peers' published protocol::

    C = randn(V, D) / sqrt(D);  y = randint(0, V, (N,))
    flat:   E = randn(N, D)                                   (random init: p ≈ 1/V)
    peaked: E = 13·C[y] + 2·randn(N, D); then a Zipf frequency prior in feature 0:
            C[:, 0] = −log(rank) / 4 with rank a random permutation of 1..V;  E[:, 0] = 4
    both cast to the benchmark dtype afterwards

"peaked" looks like a trained model; "flat" is the worst case for gradient filtering. The
"trained" regime is the final normed hidden states, head and next-token targets of a small GPT
trained on Python sources (held-out text), made once by ``python -m benchmarks.trained_lm
--out DIR`` and read by :func:`load_trained_regime`.

Contrastive pairs (b × c L2-normalized image and text features, or two views):
:func:`make_pair_features`, regimes "random" and "trained".
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

REGIMES = ("peaked", "flat")


def _check_regime(regime: str, regimes: tuple[str, ...]) -> None:
    if regime not in regimes:
        raise ValueError(f"unknown regime {regime!r}; expected one of {regimes}")


@dataclass(frozen=True)
class LMHeadShape:
    """A language-model head: vocabulary size V, hidden size D, and the logit soft-cap s of
    its model (``s·tanh(z/s)`` before the softmax, Gemma 2's ``final_logit_softcapping``)."""

    name: str
    vocab_size: int  # V
    hidden_size: int  # D
    softcap: float | None = None

    @property
    def label(self) -> str:
        """``gemma2-2b (256000, 2304, softcap 30)``: the name, (V, D) and the soft-cap."""
        softcap = f", softcap {self.softcap:g}" if self.softcap else ""
        return f"{self.name} ({self.vocab_size}, {self.hidden_size}{softcap})"


LM_HEAD_SHAPES: dict[str, LMHeadShape] = {
    shape.name: shape
    for shape in (
        LMHeadShape("llama3-1b", 128_256, 2048),  # Llama 3.2 1B
        LMHeadShape("llama3-8b", 128_256, 4096),
        LMHeadShape("qwen2.5-1.5b", 151_936, 1536),
        LMHeadShape("qwen2.5-7b", 151_936, 3584),
        LMHeadShape("gemma2-2b", 256_000, 2304, softcap=30.0),
        LMHeadShape("phi3.5", 32_064, 3072),
    )
}

# --quick shrinks every shape by these factors (V/128, D/32: odd sizes such as 2000×72
# and 250×96 on purpose) so that a suite runs on a CPU, Triton's interpreter included.
QUICK_VOCAB_DIVISOR = 128
QUICK_HIDDEN_DIVISOR = 32
QUICK_N = 128


def quick_shape(shape: LMHeadShape) -> LMHeadShape:
    """``shape`` for ``--quick``: same name and soft-cap, smaller V and D."""
    return dataclasses.replace(shape, vocab_size=max(2, shape.vocab_size // QUICK_VOCAB_DIVISOR),
                               hidden_size=max(2, shape.hidden_size // QUICK_HIDDEN_DIVISOR))


def make_lm_head_inputs(n: int, vocab_size: int, hidden_size: int, regime: str, *,
                        dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                        seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """``(E, C, y)``: E (n, D) and C (V, D) in ``dtype``, y (n,) int64 in [0, V). Drawn in
    float32 on ``device`` from one generator seeded with ``seed``, in the order C, y, E's
    noise, the rank permutation (keep this order: results depend on it)."""
    _check_regime(regime, REGIMES)
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)

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


# ----------------------------------------------------------------------------- trained

TRAINED_REGIME = "trained"
TRAINED_LM_ENV = "FUSEDLOSS_TRAINED_LM"  # a directory holding TRAINED_LM_FILE, or the file
TRAINED_LM_FILE = "trained_lm.pt"
_MAKE_TRAINED_LM = (
    "create it on a CUDA machine with `python -m benchmarks.trained_lm --out DIR` (from the "
    "repository root, a few minutes; `--quick` makes a tiny CPU one for tests), then pass "
    f"DIR or set {TRAINED_LM_ENV}=DIR"
)


def trained_lm_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The file of the "trained" regime: ``path`` (a directory or the file), else the
    environment variable ``FUSEDLOSS_TRAINED_LM``. Raises ``FileNotFoundError`` saying how
    to create it when there is none."""
    if path is None:
        path = os.environ.get(TRAINED_LM_ENV) or None
    if path is None:
        raise FileNotFoundError(f'the "{TRAINED_REGIME}" regime needs the hidden states of a '
                                f"trained model: {TRAINED_LM_ENV} is not set and no path was "
                                f"given; {_MAKE_TRAINED_LM}")
    file = Path(path)
    if file.is_dir():
        file = file / TRAINED_LM_FILE
    if not file.is_file():
        raise FileNotFoundError(f'the "{TRAINED_REGIME}" regime\'s file {file} does not exist; '
                                f"{_MAKE_TRAINED_LM}")
    return file


def load_trained_regime(path: str | os.PathLike[str] | None = None,
                        device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                        *, n: int | None = None) -> tuple[Tensor, Tensor, Tensor, dict[str, Any]]:
    """``(E, C, y, metadata)`` of the "trained" regime: E (N, D) and C (V, D) in ``dtype`` on
    ``device``, y (N,) int64, and the dict ``benchmarks.trained_lm`` wrote. ``n`` keeps the
    first ``n`` rows; ``path`` is a directory holding ``trained_lm.pt`` or the file (None:
    ``$FUSEDLOSS_TRAINED_LM``)."""
    file = trained_lm_path(path)
    payload = torch.load(file, map_location="cpu", weights_only=True)
    hidden, classifier, labels = payload["E"], payload["C"], payload["y"]
    if n is not None:
        if not 0 < n <= hidden.shape[0]:
            raise ValueError(f"n must be in [1, {hidden.shape[0]}] for {file}, got {n}")
        hidden, labels = hidden[:n], labels[:n]
    return (hidden.to(device=device, dtype=dtype).contiguous(),
            classifier.to(device=device, dtype=dtype).contiguous(),
            labels.to(device=device, dtype=torch.int64).contiguous(), dict(payload["metadata"]))


def trained_shape(path: str | os.PathLike[str] | None = None) -> LMHeadShape:
    """The LM head of the "trained" regime's file: ``LMHeadShape("trained", V, D)``."""
    payload = torch.load(trained_lm_path(path), map_location="cpu", weights_only=True)
    vocab_size, hidden_size = payload["C"].shape
    return LMHeadShape(TRAINED_REGIME, int(vocab_size), int(hidden_size))


def trained_rows(path: str | os.PathLike[str] | None = None) -> int:
    """N, the rows the "trained" regime's file holds."""
    payload = torch.load(trained_lm_path(path), map_location="cpu", weights_only=True)
    return int(payload["E"].shape[0])


# ----------------------------------------------------------------------------- contrastive

PAIR_REGIMES = ("random", "trained")

# logit_scale (already exp()-ed, open_clip's convention) that goes with each regime:
# 1/0.07 is CLIP's initial temperature, 100 the value trained CLIP models reach (open_clip
# clamps logit_scale there).
RANDOM_LOGIT_SCALE = 1.0 / 0.07
TRAINED_LOGIT_SCALE = 100.0

# The "trained" generator's parameters (see make_pair_features): a mean CLIP loss of a few
# nats at logit_scale 100 (calibration: docs; every run reports its own loss).
TRAINED_CLUSTER_SIZE = 8  # C = b // 8 clusters: ≈ 8 pairs share a cluster (Poisson sizes)
TRAINED_LATENT = 0.45  # a: weight of the pair's shared instance latent
TRAINED_NOISE = 1.5  # s: weight of each side's own noise


def pair_logit_scale(regime: str) -> float:
    """The CLIP ``logit_scale`` of a regime: 1/0.07 (random) or 100 (trained)."""
    _check_regime(regime, PAIR_REGIMES)
    return RANDOM_LOGIT_SCALE if regime == "random" else TRAINED_LOGIT_SCALE


def make_pair_features(b: int, c: int, regime: str, *, dtype: torch.dtype = torch.bfloat16,
                       device: str | torch.device = "cpu", seed: int = 0,
                       cluster_size: int = TRAINED_CLUSTER_SIZE, latent: float = TRAINED_LATENT,
                       noise: float = TRAINED_NOISE) -> tuple[Tensor, Tensor]:
    """Paired, L2-normalized features ``(image, text)``, each (b, c) in ``dtype``: row i of
    each forms pair i (SimCLR: the two views of sample i). Drawn in float32 on ``device`` from
    a generator seeded with ``seed``, normalized in float32, then cast.

    ``"random"``, an untrained model: independent random unit vectors (with CLIP's initial
    logit_scale 1/0.07 every softmax is almost flat: the worst case for gradient filtering).

    ``"trained"``, a model that has learnt something: pairs share a latent, and the batch has
    cluster structure (near-duplicate captions, several photos of one kind of thing)::

        C = max(1, b // cluster_size) clusters with random unit centres c_k
        k_i = randint(C) for every pair i      (clusters in random order, as in real batches)
        w_i, n_i, n'_i random unit vectors     (pair latent, image noise, text noise)
        image_i = normalize(c_k + latent·w_i + noise·n_i)
        text_i  = normalize(c_k + latent·w_i + noise·n'_i)
    """
    _check_regime(regime, PAIR_REGIMES)
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)

    def unit(rows: int) -> Tensor:
        x = torch.randn(rows, c, generator=generator, device=device, dtype=torch.float32)
        return torch.nn.functional.normalize(x, dim=1)

    if regime == "random":
        image = unit(b).to(dtype)
        return image, unit(b).to(dtype)
    clusters = max(1, b // max(1, cluster_size))
    centres = unit(clusters)
    assignment = torch.randint(0, clusters, (b,), generator=generator, device=device)
    base = centres[assignment]
    del centres, assignment
    base.add_(unit(b), alpha=latent)
    image = torch.nn.functional.normalize(base + noise * unit(b), dim=1).to(dtype)
    text = torch.nn.functional.normalize(base.add_(unit(b), alpha=noise), dim=1).to(dtype)
    return image, text
