"""``python -m fusedloss demo``: train the same model twice, once per loss head, and compare.

Two experiments run, one after the other (``--experiment`` picks one): ``lm``, a causal
language model (``fusedloss.linear_cross_entropy``), and ``clip``, a CLIP-style two-tower
model (``fusedloss.clip_loss``).

Experiment ``lm`` trains a small Hugging Face causal language model — a ``LlamaForCausalLM``
built from a ``LlamaConfig`` (random init from the seed, nothing downloaded; needs
``transformers``, the ``demo`` extra) — on a synthetic token source two times from one seed —
same initial weights, same batches, same AdamW, ``model(input_ids=tokens, labels=tokens).loss``
— changing only the loss head:

* **pytorch**: the model as transformers builds it: its forward materializes the (B·T, V)
  logits with ``lm_head``, upcasts them to fp32 and calls ``F.cross_entropy`` on the shifted
  labels;
* **fusedloss**: the same model patched with
  :func:`fusedloss.integrations.transformers.apply_fusedloss`, whose training forward calls
  ``fusedloss.linear_cross_entropy`` on the final hidden states and ``lm_head.weight`` and never
  builds the logits.

transformers computes the loss inside the model's forward, so the head cannot be measured on
its own: for ``lm`` the timing and the peak memory cover the whole forward and backward of a
training step (the optimizer update left out), the same work in both runs apart from the head.
The CPU preset is sized so that the saving shows there too: N·V is four times the block of
logits rows that fusedloss's chunked pure-PyTorch path (its CPU path) holds at a time, so
fusedloss's step peaks at well under half of PyTorch's; on CUDA its Triton path holds no such
block. Without transformers the ``lm`` experiment is skipped with a message saying how to
install it; ``clip`` still runs.

It prints both loss curves side by side, the measured peak memory and time per step, writes
a PNG of the curves, and ends with a one-line verdict on whether the curves agree.

The synthetic source (:class:`ZipfMarkovSource`) is a sparse first-order Markov chain:

1. a unigram distribution over the vocabulary is Zipfian, ``p(rank r) ∝ r^-s``, with the ranks
   assigned to token ids by a random permutation;
2. each token ``v`` gets a successor list of ``support_size`` tokens drawn (with replacement)
   from that unigram, so frequent tokens are frequent successors;
3. the next token after ``v`` is its successor at rank ``j`` with Zipfian probability
   ``∝ (j + 1)^-s``; the first token of a sequence is drawn from the unigram.

Everything is generated from the seed with ``torch.Generator`` on the CPU, so the token stream
is identical across runs, devices and heads. Its exact Bayes-optimal loss (the floor any model
can reach) is computed from the chain and printed for scale.

Experiment ``clip`` trains two small MLP towers on synthetic image–text pairs the same way,
twice from one seed, changing only the loss:

* **pytorch**: open_clip's ``ClipLoss`` on one process, ``logits = logit_scale · I @ Tᵀ`` and
  ``(F.cross_entropy(logits, arange(b)) + F.cross_entropy(logits.T, arange(b))) / 2``, which
  materializes the b×b logits;
* **fusedloss**: ``fusedloss.clip_loss(I, T, logit_scale)``, which never does.

The towers' outputs are L2-normalized and the temperature is learned as in open_clip: a
parameter ``t`` with ``logit_scale = t.exp()``, initialized to ``log(1/0.07)`` and clamped so
that the scale stays at most 100. The pairs (:class:`PairedLatentSource`) share a latent
``z ~ N(0, I)``: the "image" is a fixed random nonlinear map of ``z`` plus noise and the
"text" another one plus independent noise. Its report has the same parts as ``lm``'s and
its own PNG; no closed-form floor is drawn.

The module is laid out so that further experiments reuse the same pieces: an experiment's
training step is an :func:`optimizer_step` (its loss layer timed and measured on its own, or
the whole forward+backward when the loss cannot be cut from the model),
:func:`run_training` loops it into a :class:`RunResult`, :func:`train_both` runs the two
heads and :func:`compare_heads` pairs them into a :class:`Comparison`, :func:`report` prints
and plots it, and :data:`EXPERIMENTS` registers it with the command line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import fusedloss
from fusedloss.core.engine import _torch_chunk_rows
from fusedloss.integrations.transformers import apply_fusedloss

MiB = 2**20


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``, for the report."""
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# Causal LM: synthetic data
# ---------------------------------------------------------------------------------------------


def zipf_probabilities(n: int, exponent: float) -> torch.Tensor:
    """Zipf law over ranks ``1..n``: ``p_r ∝ r^-exponent``. Returns (n,) float64 summing to 1."""
    weights = torch.arange(1, n + 1, dtype=torch.float64).pow(-exponent)
    return weights / weights.sum()


class ZipfMarkovSource:
    """Deterministic sparse first-order Markov chain with Zipfian statistics (see module doc).

    Attributes:
        unigram: (V,) float64, Zipfian over randomly permuted token ids; law of the first token.
        successors: (V, K) int64, ``successors[v, j]`` is the rank-``j`` successor of token ``v``.
        rank_probabilities: (K,) float64, Zipfian probability of choosing the rank-``j``
            successor (the same for every token).
    """

    def __init__(
        self, vocab_size: int, support_size: int = 64, exponent: float = 1.1, seed: int = 0
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.seed = seed
        token_of_rank = torch.randperm(vocab_size, generator=generator)
        self.unigram = torch.empty(vocab_size, dtype=torch.float64)
        self.unigram[token_of_rank] = zipf_probabilities(vocab_size, exponent)
        self.successors = torch.multinomial(
            self.unigram, vocab_size * support_size, replacement=True, generator=generator
        ).view(vocab_size, support_size)
        self.rank_probabilities = zipf_probabilities(support_size, exponent)
        self._optimal_loss: dict[int, float] = {}  # seq_len → optimal_loss(seq_len)

    def batch(self, step: int, batch_size: int, seq_len: int) -> torch.Tensor:
        """Token sequences for one training step, a pure function of ``(seed, step)``.

        Returns:
            (batch_size, seq_len) int64 on the CPU.
        """
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        tokens = torch.empty(batch_size, seq_len, dtype=torch.int64)
        tokens[:, 0] = torch.multinomial(
            self.unigram, batch_size, replacement=True, generator=generator
        )
        ranks = torch.multinomial(
            self.rank_probabilities,
            batch_size * (seq_len - 1),
            replacement=True,
            generator=generator,
        ).view(batch_size, seq_len - 1)
        for t in range(seq_len - 1):
            tokens[:, t + 1] = self.successors[tokens[:, t], ranks[:, t]]
        return tokens

    def transitions(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Non-zero transitions with duplicate successors merged.

        Returns:
            (from_token, to_token, probability): three (E,) tensors, int64, int64, float64.
        """
        support_size = self.successors.shape[1]
        from_token = torch.arange(self.vocab_size).repeat_interleave(support_size)
        keys = from_token * self.vocab_size + self.successors.flatten()
        unique_keys, inverse = keys.unique(return_inverse=True)
        probability = torch.zeros(unique_keys.shape, dtype=torch.float64)
        probability.index_add_(0, inverse, self.rank_probabilities.repeat(self.vocab_size))
        return unique_keys // self.vocab_size, unique_keys % self.vocab_size, probability

    def optimal_loss(self, seq_len: int) -> float:
        """Expected shifted next-token loss of the true chain, in nats: no model can do better.

        Averages ``E[H(next | token_t)]`` over positions ``t = 0..seq_len-2`` with token_t
        distributed as the chain started from the unigram.
        """
        if seq_len in self._optimal_loss:
            return self._optimal_loss[seq_len]
        from_token, to_token, probability = self.transitions()
        row_entropy = torch.zeros(self.vocab_size, dtype=torch.float64)
        row_entropy.index_add_(0, from_token, -probability * probability.log())
        distribution, total = self.unigram, 0.0
        for position in range(seq_len - 1):
            entropy = float(distribution @ row_entropy)
            total += entropy
            flow = distribution[from_token] * probability
            previous = distribution
            distribution = torch.zeros_like(distribution).index_add_(0, to_token, flow)
            if (distribution - previous).abs().sum() < 1e-12:  # stationary: the rest is equal
                total += entropy * (seq_len - 2 - position)
                break
        self._optimal_loss[seq_len] = total / (seq_len - 1)
        return self._optimal_loss[seq_len]


# ---------------------------------------------------------------------------------------------
# Causal LM: model, a Hugging Face LlamaForCausalLM (random init from the seed, no download)
# ---------------------------------------------------------------------------------------------

TRANSFORMERS_MISSING = (
    "the lm experiment trains a Hugging Face model and needs transformers: "
    "pip install 'fusedloss[demo]' (or transformers==5.17.0)"
)


@dataclass(frozen=True)
class LMConfig:
    """Model, data and optimizer settings of the language-model experiment.

    The model is a ``LlamaForCausalLM`` (:func:`build_lm`). ``head_dtype`` is the dtype its
    forward runs in, and so the dtype of the loss head's inputs: ``float32``, or
    ``bfloat16`` under autocast (the weights stay fp32).
    """

    vocab_size: int = 32768
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 30
    lr: float = 3e-3
    warmup_steps: int = 5
    weight_decay: float = 0.01
    support_size: int = 64
    zipf_exponent: float = 1.1
    seed: int = 0
    head_dtype: torch.dtype = torch.float32

    def describe(self) -> str:
        """One line for the report."""
        compute = (
            "in float32"
            if self.head_dtype == torch.float32
            else f"under {dtype_name(self.head_dtype)} autocast"
        )
        return (
            f"Hugging Face LlamaForCausalLM (random init), V={self.vocab_size}, "
            f"D={self.d_model}, {self.n_layers} decoder layers ({self.n_heads} heads), "
            f"batch {self.batch_size}×{self.seq_len} tokens, {self.steps} steps, AdamW lr "
            f"{self.lr:g}, forward {compute}"
        )

    @property
    def tokens_per_step(self) -> int:
        """Rows of the loss per step: ``batch_size · (seq_len − 1)`` (shifted targets)."""
        return self.batch_size * (self.seq_len - 1)

    @property
    def logit_rows(self) -> int:
        """Rows of transformers' logits per step: ``batch_size · seq_len`` (every position;
        the last one's target is padded with -100)."""
        return self.batch_size * self.seq_len


LM_SIZES: dict[str, LMConfig] = {
    # Seconds on a CPU: smoke tests of the whole pipeline.
    "tiny": LMConfig(
        vocab_size=1024,
        d_model=32,
        n_layers=1,
        n_heads=2,
        seq_len=16,
        batch_size=4,
        steps=20,
        warmup_steps=5,
    ),
    # The CPU default. Two runs of 30 steps take about 70 s on one core of a 2-core machine.
    # N·V = 2032 × 32768: PyTorch's logits (254 MiB in fp32) are four of the blocks fusedloss's
    # CPU path holds at a time (FUSEDLOSS_TORCH_CHUNK_ELEMENTS = 2^24 fp32 logits, 64 MiB).
    "small": LMConfig(),
    # A GPU-sized run where the (N, V) logits are ~1 GiB in fp32.
    "large": LMConfig(
        vocab_size=32768,
        d_model=512,
        n_layers=4,
        n_heads=8,
        seq_len=512,
        batch_size=16,
        steps=250,
        lr=1e-3,
        warmup_steps=20,
        head_dtype=torch.bfloat16,
    ),
}


def build_lm(config: LMConfig) -> nn.Module:
    """A ``LlamaForCausalLM`` of the config's sizes, in training mode, its weights drawn from
    torch's global generator (seed it first): untied head, SwiGLU MLP of width ``4·d_model``,
    RoPE, no dropout, no KV cache. Built from a ``LlamaConfig``: nothing is downloaded.

    Raises:
        ImportError: transformers is not installed (the message says how to install it).
    """
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as error:
        raise ImportError(TRANSFORMERS_MISSING) from error
    hf_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=4 * config.d_model,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_heads,
        max_position_embeddings=config.seq_len,
        tie_word_embeddings=False,
        use_cache=False,
    )
    return LlamaForCausalLM(hf_config).train()


# ---------------------------------------------------------------------------------------------
# Causal LM: loss heads, model → the model whose training forward computes the loss that way
# ---------------------------------------------------------------------------------------------


def pytorch_lm_head(model: nn.Module) -> nn.Module:
    """Reference: the model as transformers builds it. Its forward materializes the
    (B·T, V) logits (``lm_head``), upcasts them to fp32 and calls ``F.cross_entropy``."""
    return model


def fusedloss_lm_head(model: nn.Module) -> nn.Module:
    """The model patched with :func:`fusedloss.integrations.transformers.apply_fusedloss`: in
    training with labels its forward calls ``fusedloss.linear_cross_entropy`` on the final
    hidden states and ``lm_head.weight``, and never builds the logits."""
    return apply_fusedloss(model)


LM_HEADS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "pytorch": pytorch_lm_head,
    "fusedloss": fusedloss_lm_head,
}


# ---------------------------------------------------------------------------------------------
# Shared by experiments: results, comparison, schedule, measuring, training loop
# ---------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    """One training run: the loss per step and what the measured part of the step cost (the
    loss layer, or for ``lm`` the whole forward+backward: :attr:`Comparison.measured`)."""

    name: str
    losses: list[float] = field(default_factory=list)
    loss_layer_seconds: list[float] = field(default_factory=list)
    loss_layer_peak_bytes: int | None = None
    final_values: dict[str, float] = field(default_factory=dict)  # e.g. a learned temperature

    def mean_loss_layer_ms(self, skip: int) -> float:
        """Mean loss forward+backward time in ms over the timed steps after the first ``skip``.

        Steps timed as NaN (the memory-measured step) are left out.
        """
        timed = [s for s in self.loss_layer_seconds[skip:] if not math.isnan(s)]
        timed = timed or [s for s in self.loss_layer_seconds if not math.isnan(s)]
        return 1e3 * sum(timed) / len(timed) if timed else math.nan


@dataclass
class Comparison:
    """Two runs of one experiment that should trace the same curve."""

    title: str
    reference: RunResult
    candidate: RunResult
    tolerance: float
    notes: list[str] = field(default_factory=list)
    floor: float | None = None  # the best loss any model can reach, drawn on the plot
    measured: str = "loss layer"  # what the timings and peaks cover, for the report

    def differences(self) -> list[float]:
        """Per-step ``candidate − reference`` losses."""
        return [c - r for c, r in zip(self.candidate.losses, self.reference.losses, strict=True)]

    def final_losses(self, last: int = 10) -> tuple[float, float]:
        """Mean loss over the last ``last`` steps: (reference, candidate)."""
        return tuple(
            sum(run.losses[-last:]) / len(run.losses[-last:])
            for run in (self.reference, self.candidate)
        )

    def agrees(self) -> bool:
        """Whether the final losses differ by at most ``tolerance``."""
        reference, candidate = self.final_losses()
        return abs(candidate - reference) <= self.tolerance


# Training amplifies rounding differences, so the runs drift apart slowly; these bounds are
# on the final loss (mean of the last 10 steps), in nats.
FINAL_LOSS_TOLERANCE = {torch.float32: 1e-2, torch.bfloat16: 5e-2, torch.float16: 5e-2}


def warmup_cosine(step: int, warmup_steps: int, total_steps: int) -> float:
    """Learning-rate multiplier: linear warm-up to 1, then cosine decay to 0.1."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels so wall-clock timings cover the work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def peak_memory_above_start(device: torch.device) -> Iterator[dict[str, int]]:
    """Measure the peak of allocated memory inside the block, minus what was allocated before.

    CUDA: ``torch.cuda.max_memory_allocated``. CPU: the allocation and free events that
    ``torch.profiler`` records for PyTorch's CPU allocator (``profile_memory=True``), replayed
    in order; memory allocated outside PyTorch's allocator is not seen. Yields a dict whose
    ``"peak_bytes"`` is filled in when the block exits.
    """
    result: dict[str, int] = {}
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        yield result
        synchronize(device)
        result["peak_bytes"] = torch.cuda.max_memory_allocated(device) - start
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    profiler = torch.profiler.profile(activities=activities, profile_memory=True)
    with _native_stderr_silenced():
        profiler.start()
    try:
        yield result
    finally:
        with _native_stderr_silenced():
            profiler.stop()
    result["peak_bytes"] = _peak_from_profiler_trace(profiler)


@contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """Silence writes to file descriptor 2, where the profiler logs its start and stop."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _peak_from_profiler_trace(profiler: torch.profiler.profile) -> int:
    """Running maximum of the CPU allocator's byte deltas in a profiler's chrome trace."""
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path) as file:
            events = json.load(file)["traceEvents"]
    deltas = [
        (event["ts"], event["args"]["Bytes"])
        for event in events
        if event.get("name") == "[memory]" and event["args"].get("Device Type", 0) == 0
    ]
    current = peak = 0
    for _, delta in sorted(deltas, key=lambda item: item[0]):
        current += delta
        peak = max(peak, current)
    return peak


def run_loss_layer(
    loss_fn: Callable[[], torch.Tensor], device: torch.device, measure_memory: bool = False
) -> tuple[float, float, int | None]:
    """Run a loss layer's forward and backward, timed and, when asked, memory-measured.

    ``loss_fn`` computes the loss from detached leaves (and parameters) so that the timing
    and the memory cover the loss layer alone; the caller pushes the leaves' gradients on.

    Returns:
        (loss, seconds of forward+backward, peak bytes above the start or None).
    """
    meter = peak_memory_above_start(device) if measure_memory else nullcontext({})
    with meter as memory:
        synchronize(device)
        start = time.perf_counter()
        loss = loss_fn()
        loss.backward()
        synchronize(device)
        seconds = time.perf_counter() - start
    return loss.item(), seconds, memory.get("peak_bytes")


# What one training step reports: (loss, loss-layer seconds, loss-layer peak bytes or None).
StepCost = tuple[float, float, int | None]


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    forward: Callable[[], Sequence[torch.Tensor]],
    loss_fn: Callable[..., torch.Tensor],
    measure_memory: bool = False,
) -> StepCost:
    """One optimizer step whose loss layer is timed, and measured when asked, on its own.

    ``forward()`` runs the model body; ``loss_fn`` gets detached copies of its outputs, so that
    :func:`run_loss_layer` sees only the loss layer, and their gradients are then pushed
    through the body. The result is the same gradient as one ``loss.backward()`` through
    everything. A model that computes its loss inside its own forward (``lm``'s Hugging Face
    model) cannot be cut there: its ``forward`` returns ``()`` and ``loss_fn()`` runs the whole
    model, so the timing and the memory cover the whole forward and backward.
    """
    optimizer.zero_grad(set_to_none=True)
    outputs = tuple(forward())
    leaves = [output.detach().requires_grad_() for output in outputs]
    device = optimizer.param_groups[0]["params"][0].device
    cost = run_loss_layer(lambda: loss_fn(*leaves), device, measure_memory)
    if outputs:
        torch.autograd.backward(outputs, [leaf.grad for leaf in leaves])
    optimizer.step()
    return cost


def run_training(
    name: str,
    config: LMConfig | ClipConfig,
    optimizer: torch.optim.Optimizer,
    train_step: Callable[[int, bool], StepCost],
    memory_step: int = 1,
) -> RunResult:
    """Run ``train_step(step, measure_memory)`` for ``config.steps`` steps under the
    :func:`warmup_cosine` schedule and record the losses and loss-layer costs.

    Only step ``memory_step`` is memory-measured, and its time is left out (recorded as NaN):
    on CPU it runs under the profiler, which slows it down.
    """
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, config.warmup_steps, config.steps)
    )
    result = RunResult(name)
    memory_step = min(memory_step, config.steps - 1)
    for step in range(config.steps):
        measure = step == memory_step
        loss, seconds, peak = train_step(step, measure)
        schedule.step()
        result.losses.append(loss)
        result.loss_layer_seconds.append(math.nan if measure else seconds)
        if measure:
            result.loss_layer_peak_bytes = peak
    return result


def train_both(train: Callable[[str], RunResult], verbose: bool = True) -> dict[str, RunResult]:
    """``train(head_name)`` for the "pytorch" then the "fusedloss" head, timing each run."""
    runs = {}
    for head_name in ("pytorch", "fusedloss"):
        start = time.perf_counter()
        runs[head_name] = train(head_name)
        if verbose:
            print(
                f"  trained with the {head_name} head in {time.perf_counter() - start:.1f} s",
                flush=True,
            )
    return runs


def compare_heads(
    title: str,
    runs: dict[str, RunResult],
    head_dtype: torch.dtype,
    notes: list[str],
    floor: float | None = None,
) -> Comparison:
    """The :func:`train_both` runs as a :class:`Comparison`: fusedloss against the PyTorch
    reference, within the final-loss tolerance of the loss inputs' dtype."""
    return Comparison(
        title=title,
        reference=runs["pytorch"],
        candidate=runs["fusedloss"],
        tolerance=FINAL_LOSS_TOLERANCE[head_dtype],
        notes=notes,
        floor=floor,
    )


def memory_notes(device: torch.device, analytic: str, cuda: str, cpu: str) -> list[str]:
    """The analytic note on what the PyTorch loss holds, then the one on the path fusedloss
    takes on ``device`` (Triton on CUDA, chunked PyTorch on the CPU)."""
    return [analytic, cuda if device.type == "cuda" else cpu]


def resolve_device(name: str) -> torch.device:
    """``"auto"`` → CUDA when available, else CPU; otherwise the named device."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    return torch.device(name)


# ---------------------------------------------------------------------------------------------
# Causal LM: training, fusedloss head vs PyTorch head
# ---------------------------------------------------------------------------------------------


def lm_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tokens: torch.Tensor,
    head_dtype: torch.dtype,
    measure_memory: bool = False,
) -> StepCost:
    """One optimizer step on a (B, T) batch: ``model(input_ids=tokens, labels=tokens).loss``.

    transformers computes the loss inside the model's forward (the patched forward too), so
    the head cannot be cut out: the timed and measured part is the whole forward and backward
    (:func:`optimizer_step` with nothing left outside the measurement).

    Returns:
        (loss, forward+backward seconds, forward+backward peak bytes or None).
    """

    def loss_fn() -> torch.Tensor:
        autocast = (
            nullcontext()
            if head_dtype == torch.float32
            else torch.autocast(tokens.device.type, dtype=head_dtype)
        )
        with autocast:
            return model(input_ids=tokens, labels=tokens).loss

    return optimizer_step(optimizer, lambda: (), loss_fn, measure_memory)


def train_lm(
    config: LMConfig,
    head_name: str,
    device: torch.device,
    source: ZipfMarkovSource | None = None,
    memory_step: int = 1,
) -> RunResult:
    """Train a fresh :func:`build_lm` model from ``config.seed`` with one loss head.

    Args:
        config: sizes, steps and optimizer settings.
        head_name: a key of :data:`LM_HEADS` (``"fusedloss"`` patches the model).
        device: where the model and batches live.
        source: token source (built from ``config`` when None; pass one to share it).
        memory_step: the step whose forward+backward is measured for peak memory; it is left
            out of the timings (on CPU it runs under the profiler).

    Returns:
        A :class:`RunResult` with ``config.steps`` losses and forward+backward timings.
    """
    source = source or lm_source(config)
    torch.manual_seed(config.seed)
    model = LM_HEADS[head_name](build_lm(config).to(device))
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay
    )

    def train_step(step: int, measure_memory: bool) -> StepCost:
        tokens = source.batch(step, config.batch_size, config.seq_len).to(device)
        return lm_train_step(model, optimizer, tokens, config.head_dtype, measure_memory)

    return run_training(head_name, config, optimizer, train_step, memory_step)


def lm_source(config: LMConfig) -> ZipfMarkovSource:
    """The token source an :class:`LMConfig` describes."""
    return ZipfMarkovSource(
        config.vocab_size, config.support_size, config.zipf_exponent, config.seed
    )


def lm_experiment(
    config: LMConfig,
    device: torch.device,
    source: ZipfMarkovSource | None = None,
    verbose: bool = True,
) -> Comparison:
    """Train the Llama model unpatched (PyTorch head), then patched with fusedloss; compare."""
    source = source or lm_source(config)
    runs = train_both(lambda head_name: train_lm(config, head_name, device, source), verbose)
    comparison = compare_heads(
        f"causal LM (LlamaForCausalLM), V={config.vocab_size}, D={config.d_model}, "
        f"{config.n_layers} layers",
        runs,
        config.head_dtype,
        notes=lm_memory_notes(config, device),
        floor=source.optimal_loss(config.seq_len),
    )
    return replace(comparison, measured="training step")


def lm_memory_notes(config: LMConfig, device: torch.device) -> list[str]:
    """What is measured, and what each head must hold, analytically, to put the peaks in
    context."""
    rows, n, v = config.logit_rows, config.tokens_per_step, config.vocab_size
    logits = f"B·T×V = {rows}×{v} fp32 logits = {rows * v * 4 / MiB:.1f} MiB"
    if config.head_dtype != torch.float32:
        size = rows * v * config.head_dtype.itemsize / MiB
        logits += f" (and first the {dtype_name(config.head_dtype)} ones, {size:.1f} MiB)"
    chunk = min(_torch_chunk_rows(v), n)  # the rows of logits it holds at a time
    blocks = math.ceil(n / chunk)
    return [
        "measured: the whole forward+backward of the model (embeddings, decoder layers, head, "
        "loss, parameter gradients), the optimizer update left out; transformers computes the "
        "loss inside the forward, so the head cannot be measured apart. The rest of the step "
        "is the same in both runs: the difference is the head's",
        *memory_notes(
            device,
            analytic=f"analytic: transformers' head materializes {logits}; F.cross_entropy "
            "keeps a log-softmax of the same size for the backward, which builds gradients of "
            "the same size",
            cuda="fusedloss (Triton) keeps per-row statistics and small per-tile records, never "
            "an N×V array",
            cpu=f"on the CPU fusedloss runs its chunked pure-PyTorch path, which holds {chunk} "
            f"rows × V fp32 logits at a time ({chunk * v * 4 / MiB:.1f} MiB; N = {n} rows here, "
            f"{blocks} block{'s' * (blocks > 1)}), so the head's share of its peak does not grow "
            "with N, and recomputes each block in the backward, so on the CPU its step is "
            "slower; on CUDA its Triton path holds no such block",
        ),
    ]


# ---------------------------------------------------------------------------------------------
# Contrastive two-tower (CLIP-style): synthetic paired data
# ---------------------------------------------------------------------------------------------


class RandomTanhMap:
    """A fixed random two-layer network ``tanh(z W₁) W₂``, scaled to unit-variance outputs.

    ``W₁`` has a gain of 2 so that the tanh bends (the map is not close to linear); ``W₂`` is
    rescaled so that every output feature has variance 1 over ``z ~ N(0, I)`` (estimated on
    4096 draws from the same generator).
    """

    def __init__(
        self, in_dim: int, hidden_dim: int, out_dim: int, generator: torch.Generator
    ) -> None:
        self.w1 = torch.randn(in_dim, hidden_dim, generator=generator) * (2 / in_dim**0.5)
        self.w2 = torch.randn(hidden_dim, out_dim, generator=generator) / hidden_dim**0.5
        self.w2 /= self(torch.randn(4096, in_dim, generator=generator)).std(dim=0)

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        """(N, in_dim) → (N, out_dim)."""
        return torch.tanh(z @ self.w1) @ self.w2


class PairedLatentSource:
    """Synthetic image–text pairs that share a latent, deterministic from the seed.

    Pair ``i`` is ``(image_map(z_i) + σ·ε, text_map(z_i) + σ·ε')`` with ``z_i ~ N(0, I)`` and
    independent Gaussian noise ``ε, ε'``: the two "modalities" are different fixed random
    nonlinear views of the same latent (:class:`RandomTanhMap`, unit-variance features), so
    a pair can only be matched by recovering ``z`` from both sides. Everything is drawn with
    ``torch.Generator`` on the CPU, like :class:`ZipfMarkovSource`.
    """

    def __init__(
        self, latent_dim: int, image_dim: int, text_dim: int, noise: float, seed: int = 0
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.latent_dim, self.noise, self.seed = latent_dim, noise, seed
        hidden_dim = 4 * latent_dim
        self.image_map = RandomTanhMap(latent_dim, hidden_dim, image_dim, generator)
        self.text_map = RandomTanhMap(latent_dim, hidden_dim, text_dim, generator)

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs of one training step, a pure function of ``(seed, step)``.

        Returns:
            (images (batch_size, image_dim), texts (batch_size, text_dim)), fp32 on the CPU;
            row ``i`` of both is pair ``i``.
        """
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        z = torch.randn(batch_size, self.latent_dim, generator=generator)
        views = []
        for view_map in (self.image_map, self.text_map):
            view = view_map(z)
            views.append(view + self.noise * torch.randn(view.shape, generator=generator))
        return views[0], views[1]


# ---------------------------------------------------------------------------------------------
# Contrastive two-tower: model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClipConfig:
    """Model, data and optimizer settings of the contrastive (CLIP-style) experiment."""

    latent_dim: int = 16
    image_dim: int = 64
    text_dim: int = 48
    noise: float = 0.5
    hidden_dim: int = 256
    embed_dim: int = 128
    batch_size: int = 1024
    steps: int = 150
    lr: float = 2e-3
    warmup_steps: int = 10
    weight_decay: float = 0.1
    seed: int = 0
    head_dtype: torch.dtype = torch.float32

    def describe(self) -> str:
        """One line for the report."""
        towers = " and ".join(
            f"{d}→{self.hidden_dim}→{self.hidden_dim}→{self.embed_dim}"
            for d in (self.image_dim, self.text_dim)
        )
        return (
            f"2 MLP towers ({towers}), L2-normalized, learnable logit_scale (init 1/0.07, "
            f"clamped at 100); batch {self.batch_size} pairs, {self.steps} steps, AdamW lr "
            f"{self.lr:g}, loss inputs in {dtype_name(self.head_dtype)}"
        )


CLIP_SIZES: dict[str, ClipConfig] = {
    # Seconds on a CPU: smoke tests of the whole pipeline.
    "tiny": ClipConfig(
        latent_dim=8,
        image_dim=24,
        text_dim=16,
        hidden_dim=64,
        embed_dim=32,
        batch_size=64,
        steps=20,
        warmup_steps=2,
    ),
    # Two runs of 150 steps take about 20 s on one core of a 2-core machine.
    "small": ClipConfig(),
    # A GPU-sized run where the b×b logits are 1 GiB in fp32.
    "large": ClipConfig(
        latent_dim=32,
        image_dim=256,
        text_dim=192,
        hidden_dim=1024,
        embed_dim=512,
        batch_size=16384,
        steps=250,
        lr=1e-3,
        warmup_steps=20,
        head_dtype=torch.bfloat16,
    ),
}


def mlp_tower(in_dim: int, hidden_dim: int, out_dim: int) -> nn.Sequential:
    """Three linear layers with GELUs between: (N, in_dim) → (N, out_dim)."""
    return nn.Sequential(
        nn.Linear(in_dim, hidden_dim),
        nn.GELU(),
        nn.Linear(hidden_dim, hidden_dim),
        nn.GELU(),
        nn.Linear(hidden_dim, out_dim),
    )


class TwoTower(nn.Module):
    """Image and text towers into one embedding space, with open_clip's learnable temperature.

    ``logit_scale`` holds the log of the scale, initialized to ``log(1/0.07)``; the loss gets
    ``logit_scale.exp()``, and :func:`clip_train_step` clamps it to ``[0, log 100]`` after every
    optimizer step (open_clip's training loop does the same).
    """

    def __init__(self, config: ClipConfig) -> None:
        super().__init__()
        self.image_tower = mlp_tower(config.image_dim, config.hidden_dim, config.embed_dim)
        self.text_tower = mlp_tower(config.text_dim, config.hidden_dim, config.embed_dim)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(
        self, images: torch.Tensor, texts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(b, image_dim), (b, text_dim) → unit-norm features (b, E) twice and the scale ()."""
        image_features = F.normalize(self.image_tower(images), dim=-1)
        text_features = F.normalize(self.text_tower(texts), dim=-1)
        return image_features, text_features, self.logit_scale.exp()


# ---------------------------------------------------------------------------------------------
# Contrastive two-tower: losses, (image (b, E), text (b, E), logit_scale ()) → scalar loss, fp32
# ---------------------------------------------------------------------------------------------

ClipHead = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def pytorch_clip_head(
    image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor
) -> torch.Tensor:
    """Reference: open_clip's ``ClipLoss`` on one process, with the b×b logits upcast to fp32."""
    logits = (logit_scale * image_features @ text_features.T).float()
    labels = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def fusedloss_clip_head(
    image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor
) -> torch.Tensor:
    """The same loss via ``fusedloss.clip_loss``: no b×b logits in memory."""
    return fusedloss.clip_loss(image_features, text_features, logit_scale)


CLIP_HEADS: dict[str, ClipHead] = {"pytorch": pytorch_clip_head, "fusedloss": fusedloss_clip_head}


# ---------------------------------------------------------------------------------------------
# Contrastive two-tower: training, fusedloss.clip_loss vs PyTorch
# ---------------------------------------------------------------------------------------------


def clip_train_step(
    model: TwoTower,
    optimizer: torch.optim.Optimizer,
    images: torch.Tensor,
    texts: torch.Tensor,
    head: ClipHead,
    head_dtype: torch.dtype,
    measure_memory: bool = False,
) -> StepCost:
    """One optimizer step on a batch of pairs, then the clamp of ``logit_scale``.

    As in :func:`lm_train_step`, the loss runs on detached copies of the features and of the
    scale, and their gradients are then pushed through the towers (:func:`optimizer_step`).

    Returns:
        (loss, loss-layer seconds, loss-layer peak bytes or None).
    """
    cost = optimizer_step(
        optimizer,
        lambda: model(images, texts),  # image features, text features, logit scale
        lambda image, text, scale: head(image.to(head_dtype), text.to(head_dtype), scale),
        measure_memory,
    )
    with torch.no_grad():
        model.logit_scale.clamp_(0, math.log(100))
    return cost


def train_clip(
    config: ClipConfig,
    head_name: str,
    device: torch.device,
    source: PairedLatentSource | None = None,
    memory_step: int = 1,
) -> RunResult:
    """Train a fresh :class:`TwoTower` from ``config.seed`` with one contrastive loss.

    Weight decay applies to the weight matrices only, not to biases or ``logit_scale``
    (open_clip's rule). Arguments and result as in :func:`train_lm`, with ``head_name`` a key
    of :data:`CLIP_HEADS`; the result's ``final_values`` holds the learned ``logit_scale``.
    """
    source = source or clip_source(config)
    torch.manual_seed(config.seed)
    model = TwoTower(config).to(device)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr,
        weight_decay=config.weight_decay,
    )
    head = CLIP_HEADS[head_name]

    def train_step(step: int, measure_memory: bool) -> StepCost:
        images, texts = (x.to(device) for x in source.batch(step, config.batch_size))
        return clip_train_step(
            model, optimizer, images, texts, head, config.head_dtype, measure_memory
        )

    result = run_training(head_name, config, optimizer, train_step, memory_step)
    result.final_values["logit_scale"] = model.logit_scale.exp().item()
    return result


def clip_source(config: ClipConfig) -> PairedLatentSource:
    """The pair source a :class:`ClipConfig` describes."""
    return PairedLatentSource(
        config.latent_dim, config.image_dim, config.text_dim, config.noise, config.seed
    )


def clip_experiment(
    config: ClipConfig,
    device: torch.device,
    source: PairedLatentSource | None = None,
    verbose: bool = True,
) -> Comparison:
    """Train the two towers with the PyTorch loss, then with ``fusedloss.clip_loss``; compare."""
    source = source or clip_source(config)
    runs = train_both(lambda head_name: train_clip(config, head_name, device, source), verbose)
    scales = ", ".join(
        f"{name} {run.final_values['logit_scale']:.3f}" for name, run in runs.items()
    )
    return compare_heads(
        f"CLIP-style two towers, batch {config.batch_size} pairs, E={config.embed_dim}",
        runs,
        config.head_dtype,
        notes=[
            f"learned logit_scale after {config.steps} steps: {scales} (init {1 / 0.07:.3f})",
            *clip_memory_notes(config, device),
        ],
    )


def clip_memory_notes(config: ClipConfig, device: torch.device) -> list[str]:
    """What each loss must hold, analytically, to put the measured peaks in context."""
    b = config.batch_size
    return memory_notes(
        device,
        analytic=f"analytic: the PyTorch loss materializes b×b = {b}×{b} fp32 logits = "
        f"{b * b * 4 / MiB:.1f} MiB, and each of its two F.cross_entropy calls (rows, then "
        "columns via logits.T) keeps a log-softmax of the same size for the backward",
        cuda="fusedloss.clip_loss (Triton) keeps per-row and per-column log-sum-exps and small "
        "per-tile records, never a b×b array",
        cpu="on the CPU clip_loss runs its chunked pure-PyTorch path, which holds a block of "
        "rows × b fp32 logits at a time (all b rows when b is below its chunk size), so at "
        "this b its CPU peak is no smaller than PyTorch's; the saving is the Triton path's, "
        "on CUDA",
    )


# ---------------------------------------------------------------------------------------------
# Reporting (shared by experiments)
# ---------------------------------------------------------------------------------------------


def format_curve_table(comparison: Comparison, every: int) -> str:
    """Both loss curves every ``every`` steps (and the last step) with their difference."""
    reference, candidate = comparison.reference, comparison.candidate
    header = f"{'step':>6}  {reference.name:>10}  {candidate.name:>10}  {'difference':>11}"
    lines = [header, "-" * len(header)]
    steps = len(reference.losses)
    for step in sorted({*range(0, steps, every), steps - 1}):
        r, c = reference.losses[step], candidate.losses[step]
        lines.append(f"{step + 1:>6}  {r:>10.5f}  {c:>10.5f}  {c - r:>+11.2e}")
    return "\n".join(lines)


def plot_curves(comparison: Comparison, path: Path) -> Path | None:
    """Write both curves and their difference to ``path`` (PNG); None if matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(1, len(comparison.reference.losses) + 1)
    figure, (curves, difference) = plt.subplots(
        2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    for run, style in ((comparison.reference, "-"), (comparison.candidate, "--")):
        curves.plot(steps, run.losses, style, label=f"{run.name} head", linewidth=1.2)
    if comparison.floor is not None:
        curves.axhline(comparison.floor, color="gray", linestyle=":", label="best possible")
    curves.set_ylabel("training loss (nats)")
    curves.set_title(comparison.title)
    curves.legend()
    curves.grid(alpha=0.3)
    difference.plot(steps, comparison.differences(), color="tab:red", linewidth=1.0)
    difference.set_ylabel(f"{comparison.candidate.name} − {comparison.reference.name}")
    difference.set_xlabel("step")
    difference.grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def format_costs(comparison: Comparison, device: torch.device, skip: int) -> list[str]:
    """Peak memory and mean time per step of the measured part (``comparison.measured``: the
    loss layer, or the training step) for both runs, one line each."""
    what = comparison.measured
    if device.type == "cuda":
        how = "torch.cuda.max_memory_allocated during its forward+backward, above the start"
    else:
        how = (
            "measured with torch.profiler allocation events of PyTorch's CPU allocator "
            "during its forward+backward of one step, above the start"
        )
    lines = [f"{what} peak memory ({how}):"]
    runs = (comparison.reference, comparison.candidate)
    for run in runs:
        peak = run.loss_layer_peak_bytes
        lines.append(f"  {run.name:>10}: " + ("n/a" if peak is None else f"{peak / MiB:9.1f} MiB"))
    sync = ", synchronized" if device.type == "cuda" else ""
    lines.append(f"{what} time (mean ms per step, forward+backward{sync}):")
    for run in runs:
        lines.append(f"  {run.name:>10}: {run.mean_loss_layer_ms(skip):9.2f} ms")
    return lines


def format_verdict(comparison: Comparison) -> str:
    """One line: max |difference| over the curves and whether the final losses agree."""
    max_difference = max(abs(d) for d in comparison.differences())
    reference, candidate = comparison.final_losses()
    status = "AGREE" if comparison.agrees() else "DISAGREE"
    return (
        f"verdict: max |difference| over {len(comparison.differences())} steps = "
        f"{max_difference:.2e}; final losses (mean of last 10 steps) "
        f"{comparison.reference.name} {reference:.4f} vs {comparison.candidate.name} "
        f"{candidate:.4f}: {status} within {comparison.tolerance:g} nats"
    )


def report(
    comparison: Comparison, device: torch.device, out_dir: Path, plot_name: str, every: int
) -> Path | None:
    """Print the curve table, costs and verdict of a comparison; write its plot."""
    print(format_curve_table(comparison, every))
    print()
    for line in format_costs(comparison, device, skip=3):
        print(line)
    for note in comparison.notes:
        print(f"note: {note}")
    path = plot_curves(comparison, out_dir / plot_name)
    if path is None:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)")
    else:
        print(f"plot written to {path}")
    print(format_verdict(comparison))
    return path


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the demo's options on ``parser`` (shared with ``python -m fusedloss``)."""
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where to train (auto: CUDA when available)",
    )
    parser.add_argument(
        "--experiment",
        choices=["all", *EXPERIMENTS],
        default="all",
        help="which experiment to run (default: all: the causal LM, then the CLIP towers)",
    )
    parser.add_argument(
        "--size",
        choices=["auto", *LM_SIZES],
        default="auto",
        help="model/batch preset (auto: large on CUDA, small on CPU; tiny: "
        "a seconds-long smoke run)",
    )
    parser.add_argument("--steps", type=int, help="training steps per run (default: preset)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the data")
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="dtype of the loss inputs: lm runs its forward under autocast to it, clip casts "
        "its features (auto: preset)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("demo_out"),
        help="directory for the plot (default: demo_out/)",
    )
    parser.add_argument(
        "--threads", type=int, help="CPU threads when training on the CPU (default: 1)"
    )
    parser.add_argument("--log-every", type=int, help="table row interval (default: steps/15)")
    return parser


def build_parser() -> argparse.ArgumentParser:
    """Parser of ``python -m fusedloss demo``."""
    parser = argparse.ArgumentParser(
        prog="python -m fusedloss demo",
        description="Train a causal LM and a CLIP-style two-tower model, each twice from one "
        "seed (PyTorch loss vs fusedloss loss), and compare loss curves, loss-layer memory and "
        "time.",
    )
    return add_arguments(parser)


def config_from_args(
    args: argparse.Namespace,
    device: torch.device,
    presets: dict[str, LMConfig] | dict[str, ClipConfig] = LM_SIZES,
) -> LMConfig | ClipConfig:
    """The preset of ``presets`` chosen by ``--size``, with ``--steps``, ``--seed`` and
    ``--dtype`` applied (``presets``: :data:`LM_SIZES` or :data:`CLIP_SIZES`)."""
    size = args.size if args.size != "auto" else ("large" if device.type == "cuda" else "small")
    config = replace(presets[size], seed=args.seed)
    if args.steps is not None:
        config = replace(config, steps=args.steps)
    if args.dtype != "auto":
        config = replace(config, head_dtype=getattr(torch, args.dtype))
    return config


def main(argv: Sequence[str] | None = None) -> dict[str, Comparison]:
    """Run the demo; ``argv`` defaults to ``sys.argv[1:]``. Returns the comparison of each
    experiment run, keyed by its name in :data:`EXPERIMENTS`."""
    args = build_parser().parse_args(argv)
    device = resolve_device(args.device)
    names = list(EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # One thread by default: on a small shared machine an oversubscribed OpenMP pool makes
        # every step several times slower and the timings erratic.
        torch.set_num_threads(args.threads or 1)
    comparisons = {}
    try:
        for index, name in enumerate(names):
            if index:
                print("\n" + "=" * 100 + "\n")
            presets, run_demo = EXPERIMENTS[name]
            config = config_from_args(args, device, presets)
            comparison = run_demo(config, device, args.out, args.log_every)
            if comparison is not None:  # None: skipped (lm without transformers)
                comparisons[name] = comparison
    finally:
        torch.set_num_threads(threads)
    return comparisons


def _where(device: torch.device) -> str:
    """"1 CPU thread", "2 CPU threads" or the device, for a demo's first line."""
    threads = torch.get_num_threads()
    return f"{threads} CPU thread{'s' * (threads > 1)}" if device.type == "cpu" else str(device)


def _run_demo(
    config: LMConfig | ClipConfig,
    device: torch.device,
    out_dir: Path,
    every: int | None,
    *,
    what: str,
    data: str,
    experiment: Callable[[], Comparison],
    plot_name: str,
) -> Comparison:
    """Print an experiment's set-up (``what`` it compares, its model and its ``data``), run
    it, and report it with a table row every ``every`` steps (default: about 15 rows)."""
    print(f"fusedloss demo: {what}, on {_where(device)}")
    print(f"  model: {config.describe()}")
    print(f"  data: {data}")
    start = time.perf_counter()
    comparison = experiment()
    print(f"  both runs: {time.perf_counter() - start:.1f} s\n")
    report(comparison, device, out_dir, plot_name, every or max(1, config.steps // 15))
    return comparison


def _run_lm_demo(
    config: LMConfig, device: torch.device, out_dir: Path, every: int | None
) -> Comparison | None:
    """Print the setup, run :func:`lm_experiment`, and report it; without transformers,
    say so and return None (the other experiments still run)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(f"fusedloss demo: lm experiment skipped: {TRANSFORMERS_MISSING}")
        return None
    source = lm_source(config)
    data = (
        f"Zipf-Markov chain, {config.support_size} successors per token, exponent "
        f"{config.zipf_exponent}, seed {config.seed}; loss of a uniform guess ln V = "
        f"{math.log(config.vocab_size):.3f}, best possible = "
        f"{source.optimal_loss(config.seq_len):.3f} nats"
    )
    return _run_demo(
        config,
        device,
        out_dir,
        every,
        what="causal LM (Hugging Face Llama), PyTorch head vs fusedloss head "
        "(apply_fusedloss)",
        data=data,
        experiment=lambda: lm_experiment(config, device, source),
        plot_name="lm_loss_curves.png",
    )


def _run_clip_demo(
    config: ClipConfig, device: torch.device, out_dir: Path, every: int | None
) -> Comparison:
    """Print the setup, run :func:`clip_experiment`, and report it."""
    data = (
        f"latent z ~ N(0, I_{config.latent_dim}); image = a fixed random tanh map of z "
        f"({config.image_dim} dims), text = another ({config.text_dim} dims), each plus "
        f"N(0, {config.noise:g}²) noise, seed {config.seed}; loss of a uniform guess ln b = "
        f"{math.log(config.batch_size):.3f} nats"
    )
    return _run_demo(
        config,
        device,
        out_dir,
        every,
        what="CLIP-style two towers, PyTorch loss (open_clip's formula) vs fusedloss.clip_loss",
        data=data,
        experiment=lambda: clip_experiment(config, device),
        plot_name="clip_loss_curves.png",
    )


# name → (presets selected by --size, function printing the set-up, running and reporting it;
# it returns None when the experiment was skipped)
EXPERIMENTS: dict[str, tuple[dict, Callable[..., Comparison | None]]] = {
    "lm": (LM_SIZES, _run_lm_demo),
    "clip": (CLIP_SIZES, _run_clip_demo),
}
