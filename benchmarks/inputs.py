"""Benchmark inputs (formulas: benchmarks/README.md): LM-head (E, C, y) in the "peaked" and
"flat" regimes, the "trained" regime's file, and contrastive feature pairs. Keep the order of
the random draws: results depend on it."""

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
    """V, D and the model's logit soft-cap s (``s·tanh(z/s)``, Gemma 2)."""

    name: str
    vocab_size: int
    hidden_size: int
    softcap: float | None = None

    @property
    def label(self) -> str:
        softcap = f", softcap {self.softcap:g}" if self.softcap else ""
        return f"{self.name} ({self.vocab_size}, {self.hidden_size}{softcap})"


LM_HEAD_SHAPES: dict[str, LMHeadShape] = {s.name: s for s in (
    LMHeadShape("llama3-1b", 128_256, 2048),  # Llama 3.2 1B
    LMHeadShape("llama3-8b", 128_256, 4096),
    LMHeadShape("qwen2.5-1.5b", 151_936, 1536),
    LMHeadShape("qwen2.5-7b", 151_936, 3584),
    LMHeadShape("gemma2-2b", 256_000, 2304, softcap=30.0),
    LMHeadShape("phi3.5", 32_064, 3072),
    LMHeadShape("gpt2", 50_257, 768),  # narrow heads: D ≤ 1024 takes the Hopper recompute kernel
    LMHeadShape("smollm2-360m", 49_152, 960),
)}
QUICK_N = 128


def quick_shape(shape: LMHeadShape) -> LMHeadShape:
    """``--quick``: V/128, D/32 (odd sizes such as 2000×72 on purpose), CPU-sized."""
    return dataclasses.replace(shape, vocab_size=max(2, shape.vocab_size // 128),
                               hidden_size=max(2, shape.hidden_size // 32))


def make_lm_head_inputs(n: int, vocab_size: int, hidden_size: int, regime: str, *,
                        dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                        seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """``(E, C, y)``: float32 draws from one generator in the order C, y, E's noise, the rank
    permutation; E and C then cast to ``dtype``."""
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


TRAINED_REGIME = "trained"
TRAINED_LM_ENV = "FUSEDLOSS_TRAINED_LM"  # a directory holding TRAINED_LM_FILE, or the file
TRAINED_LM_FILE = "trained_lm.pt"


def _load_trained(path: str | os.PathLike[str] | None) -> tuple[Path, dict[str, Any]]:
    """(file, payload) of ``path`` (a directory or the file), else ``$FUSEDLOSS_TRAINED_LM``."""
    if path is None:
        path = os.environ.get(TRAINED_LM_ENV) or None
    file = None if path is None else Path(path)
    if file is not None and file.is_dir():
        file = file / TRAINED_LM_FILE
    if file is None or not file.is_file():
        where = f"its file {file} does not exist" if file else f"{TRAINED_LM_ENV} is not set"
        raise FileNotFoundError(
            f'the "{TRAINED_REGIME}" regime needs a trained model\'s rows: {where}; create them '
            "on a CUDA machine with `python -m benchmarks.trained_lm --out DIR` (a few minutes; "
            f"`--quick` makes a tiny CPU one), then pass DIR or set {TRAINED_LM_ENV}=DIR")
    return file, torch.load(file, map_location="cpu", weights_only=True)


def load_trained_regime(path: str | os.PathLike[str] | None = None,
                        device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                        *, n: int | None = None) -> tuple[Tensor, Tensor, Tensor, dict[str, Any]]:
    """``(E, C, y, metadata)`` of the "trained" regime's file, its first ``n`` rows."""
    file, payload = _load_trained(path)
    hidden, classifier, labels = payload["E"], payload["C"], payload["y"]
    if n is not None:
        if not 0 < n <= hidden.shape[0]:
            raise ValueError(f"n must be in [1, {hidden.shape[0]}] for {file}, got {n}")
        hidden, labels = hidden[:n], labels[:n]
    return (hidden.to(device=device, dtype=dtype).contiguous(),
            classifier.to(device=device, dtype=dtype).contiguous(),
            labels.to(device=device, dtype=torch.int64).contiguous(), dict(payload["metadata"]))


def trained_size(path: str | os.PathLike[str] | None = None) -> tuple[LMHeadShape, int]:
    """The "trained" file's (V, D) as an LMHeadShape named "trained", and its rows (N)."""
    payload = _load_trained(path)[1]
    vocab_size, hidden_size = map(int, payload["C"].shape)
    return LMHeadShape(TRAINED_REGIME, vocab_size, hidden_size), len(payload["E"])


PAIR_REGIMES = ("random", "trained")
# logit_scale (exp()-ed): CLIP's initial 1/0.07, and 100, where trained CLIP models end
RANDOM_LOGIT_SCALE = 1.0 / 0.07
TRAINED_LOGIT_SCALE = 100.0
# the "trained" pairs: ≈ 8 pairs a cluster, shared-latent and noise weights (README.md)
TRAINED_CLUSTER_SIZE = 8
TRAINED_LATENT = 0.45
TRAINED_NOISE = 1.5


def pair_logit_scale(regime: str) -> float:
    _check_regime(regime, PAIR_REGIMES)
    return RANDOM_LOGIT_SCALE if regime == "random" else TRAINED_LOGIT_SCALE


def make_pair_features(b: int, c: int, regime: str, *, dtype: torch.dtype = torch.bfloat16,
                       device: str | torch.device = "cpu", seed: int = 0) -> tuple[Tensor, Tensor]:
    """``(image, text)``, each (b, c) L2-normalized in float32, then cast; row i of each is
    pair i: independent unit vectors ("random"), or clustered pairs ("trained", README.md)."""
    _check_regime(regime, PAIR_REGIMES)
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)

    def unit(rows: int) -> Tensor:
        x = torch.randn(rows, c, generator=generator, device=device, dtype=torch.float32)
        return torch.nn.functional.normalize(x, dim=1)

    if regime == "random":
        return unit(b).to(dtype), unit(b).to(dtype)
    clusters = max(1, b // TRAINED_CLUSTER_SIZE)
    centres = unit(clusters)
    base = centres[torch.randint(0, clusters, (b,), generator=generator, device=device)]
    base.add_(unit(b), alpha=TRAINED_LATENT)
    image = torch.nn.functional.normalize(base + TRAINED_NOISE * unit(b), dim=1).to(dtype)
    text = torch.nn.functional.normalize(base.add_(unit(b), alpha=TRAINED_NOISE), dim=1).to(dtype)
    return image, text
