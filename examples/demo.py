"""Train a model twice, once with PyTorch's loss and once with fusedloss's, and compare.

    pip install "fusedloss[demo]"         # matplotlib and transformers
    python examples/demo.py               # both experiments, plots into demo_out/
    python examples/demo.py --size tiny   # a smoke run of seconds

Each experiment trains twice from one seed (same weights, batches, AdamW and schedule),
changing only the loss; it prints both loss curves, peak memory and time per step, writes a
PNG of the curves, and ends with a verdict: do the final losses agree within a tolerance?

* lm: a small Hugging Face ``LlamaForCausalLM`` (random init, nothing downloaded) on synthetic
  tokens, as transformers builds it (its forward materializes the (B·T, V) logits for
  ``F.cross_entropy``) vs patched with ``apply_fusedloss(model)`` (its training forward calls
  ``fusedloss.linear_cross_entropy`` on the hidden states and ``lm_head.weight``: no logits).
* clip: two MLP towers on synthetic image-text pairs, open_clip's loss (b×b logits) vs
  ``fusedloss.clip_loss`` (none).

On the CPU fusedloss runs a chunked pure-PyTorch path instead of its Triton kernels: it holds
a block of rows of logits at a time and recomputes it in the backward. So there the LM step
peaks at well under half of PyTorch's memory (the CPU size is chosen to show it) but runs
slower, and at the CLIP size one block is all b rows: no saving. The Triton path's memory and
speed show on CUDA (``--size large``, the default there).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import fusedloss
from fusedloss.integrations.transformers import apply_fusedloss

MiB = 2**20
SEED = 0


# --- Synthetic data, a function of the seed and the step (torch.Generator on the CPU) ---

def zipf(n: int, exponent: float) -> torch.Tensor:
    """Zipf's law over ranks 1..n, ``p(r) ∝ r^-exponent``: (n,) float64."""
    weights = torch.arange(1, n + 1, dtype=torch.float64).pow(-exponent)
    return weights / weights.sum()


class ZipfMarkovTokens:
    """A sparse first-order Markov chain over V tokens: each token has ``support`` successors
    drawn from a Zipfian unigram, and the one of rank j follows with probability ∝ (j+1)^-s."""

    def __init__(self, vocab_size: int, support: int = 64, exponent: float = 1.1) -> None:
        generator = torch.Generator().manual_seed(SEED)
        self.unigram = torch.empty(vocab_size, dtype=torch.float64)
        self.unigram[torch.randperm(vocab_size, generator=generator)] = zipf(vocab_size, exponent)
        self.successors = torch.multinomial(
            self.unigram, vocab_size * support, replacement=True, generator=generator
        ).view(vocab_size, support)
        self.rank_probabilities = zipf(support, exponent)

    def batch(self, step: int, batch_size: int, seq_len: int) -> torch.Tensor:
        """The (batch_size, seq_len) int64 tokens of one training step."""
        generator = torch.Generator().manual_seed(SEED * 1_000_003 + step)
        tokens = torch.empty(batch_size, seq_len, dtype=torch.int64)
        tokens[:, 0] = torch.multinomial(self.unigram, batch_size, True, generator=generator)
        ranks = torch.multinomial(
            self.rank_probabilities, batch_size * (seq_len - 1), True, generator=generator
        ).view(batch_size, seq_len - 1)
        for t in range(seq_len - 1):
            tokens[:, t + 1] = self.successors[tokens[:, t], ranks[:, t]]
        return tokens


class PairedLatents:
    """Image-text pairs sharing a latent ``z ~ N(0, I)``: the "image" is a fixed random map
    ``tanh(z W₁) W₂`` of z, the "text" another, each with unit-variance features plus noise."""

    def __init__(self, latent_dim: int, image_dim: int, text_dim: int, noise=0.5) -> None:
        generator = torch.Generator().manual_seed(SEED)
        self.latent_dim, self.noise, self.maps = latent_dim, noise, []
        for out_dim in (image_dim, text_dim):
            hidden = 4 * latent_dim
            w1 = torch.randn(latent_dim, hidden, generator=generator) * (2 / latent_dim**0.5)
            w2 = torch.randn(hidden, out_dim, generator=generator) / hidden**0.5
            z = torch.randn(4096, latent_dim, generator=generator)
            self.maps.append((w1, w2 / (torch.tanh(z @ w1) @ w2).std(dim=0)))

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(images, texts) of one training step, fp32; row i of both is pair i."""
        generator = torch.Generator().manual_seed(SEED * 1_000_003 + step)
        z = torch.randn(batch_size, self.latent_dim, generator=generator)
        views = [torch.tanh(z @ w1) @ w2 for w1, w2 in self.maps]
        return tuple(x + self.noise * torch.randn(x.shape, generator=generator) for x in views)


# --- Sizes: --size picks one (auto: large on CUDA, else small); --steps overrides the steps ---

F32, BF16 = torch.float32, torch.bfloat16  # dtype: of the LM's autocast, of the CLIP features
SIZES = {
    "tiny": dict(  # seconds on a CPU
        lm=dict(vocab_size=1024, d_model=32, n_layers=1, n_heads=2, seq_len=16, batch_size=4,
                steps=20, lr=3e-3, warmup_steps=5, dtype=F32),
        clip=dict(latent_dim=8, image_dim=24, text_dim=16, hidden_dim=64, embed_dim=32,
                  batch_size=64, steps=20, lr=2e-3, warmup_steps=2, dtype=F32)),
    "small": dict(  # the CPU default: PyTorch's 2048×32768 fp32 logits dominate the LM step
        lm=dict(vocab_size=32768, d_model=64, n_layers=2, n_heads=4, seq_len=128, batch_size=16,
                steps=30, lr=3e-3, warmup_steps=5, dtype=F32),
        clip=dict(latent_dim=16, image_dim=64, text_dim=48, hidden_dim=256, embed_dim=128,
                  batch_size=1024, steps=150, lr=2e-3, warmup_steps=10, dtype=F32)),
    "large": dict(  # the CUDA default: the LM's and the CLIP loss's logits are 1 GiB in fp32
        lm=dict(vocab_size=32768, d_model=512, n_layers=4, n_heads=8, seq_len=512, batch_size=16,
                steps=250, lr=1e-3, warmup_steps=20, dtype=BF16),
        clip=dict(latent_dim=32, image_dim=256, text_dim=192, hidden_dim=1024, embed_dim=512,
                  batch_size=16384, steps=250, lr=1e-3, warmup_steps=20, dtype=BF16)),
}


# --- Models, and the PyTorch CLIP loss ---

def build_llama(config: SimpleNamespace) -> LlamaForCausalLM:
    """A LlamaForCausalLM of the config's sizes, from a LlamaConfig: nothing is downloaded."""
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.d_model,
        intermediate_size=4 * config.d_model, num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads, num_key_value_heads=config.n_heads,
        max_position_embeddings=config.seq_len, tie_word_embeddings=False, use_cache=False,
    )).train()


def mlp(in_dim: int, hidden_dim: int, out_dim: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.GELU(),
                         nn.Linear(hidden_dim, hidden_dim), nn.GELU(),
                         nn.Linear(hidden_dim, out_dim))


class TwoTower(nn.Module):
    """Two towers into one space, L2-normalized; open_clip's learnable scale, initially 1/0.07."""

    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        self.image_tower = mlp(config.image_dim, config.hidden_dim, config.embed_dim)
        self.text_tower = mlp(config.text_dim, config.hidden_dim, config.embed_dim)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, images, texts):
        return (F.normalize(self.image_tower(images), dim=-1),
                F.normalize(self.text_tower(texts), dim=-1), self.logit_scale.exp())


def pytorch_clip_loss(image_features, text_features, logit_scale):
    """open_clip's ClipLoss on one process: the b×b logits in fp32, two cross-entropies."""
    logits = (logit_scale * image_features @ text_features.T).float()
    labels = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


CLIP_LOSSES = {"pytorch": pytorch_clip_loss, "fusedloss": fusedloss.clip_loss}


# --- Measuring a block: its time, and its peak memory above what was allocated at its start ---

@contextmanager
def quiet_stderr():  # torch.profiler logs its start and stop to file descriptor 2
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class Meter:
    """Times its block (synchronized on CUDA); with ``memory=True`` it measures its peak too:
    torch.cuda.max_memory_allocated on CUDA; on the CPU the allocation events of PyTorch's
    allocator that torch.profiler records, replayed in order."""

    def __init__(self, device: torch.device, memory: bool) -> None:
        self.cuda, self.memory, self.peak_bytes = device.type == "cuda", memory, None

    def __enter__(self) -> Meter:
        if self.memory and self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start_bytes = torch.cuda.memory_allocated()
        elif self.memory:
            self.profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            with quiet_stderr():
                self.profiler.start()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc_info) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.start
        if self.memory and self.cuda:
            self.peak_bytes = torch.cuda.max_memory_allocated() - self.start_bytes
        elif self.memory:
            with quiet_stderr():
                self.profiler.stop()
            with tempfile.NamedTemporaryFile(suffix=".json") as trace:
                self.profiler.export_chrome_trace(trace.name)
                events = json.loads(Path(trace.name).read_text())["traceEvents"]
            deltas = sorted((e["ts"], e["args"]["Bytes"]) for e in events
                            if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0)
            self.peak_bytes = max([0, *itertools.accumulate(delta for _, delta in deltas)])


# --- Training: one loop for both experiments ---

@dataclass
class Run:
    name: str
    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # measured part, every step but one
    peak_bytes: int | None = None  # measured part, step 1

    def mean_ms(self) -> float:
        timed = self.seconds[2:] or self.seconds  # the first two timed steps warm up
        return 1e3 * sum(timed) / len(timed)


def train(name: str, config, optimizer, step: Callable[[int, Meter], float], device,
          after_step: Callable[[], None] = lambda: None) -> Run:
    """``config.steps`` optimizer steps; ``step(i, meter)`` runs the forward and backward of
    batch i, the measured part inside ``meter``, and returns the loss. Learning rate: linear
    warm-up, cosine decay to 0.1×. Step 1 is memory-measured (not timed: the profiler is slow)."""

    def lr_factor(i: int) -> float:
        if i < config.warmup_steps:
            return (i + 1) / config.warmup_steps
        progress = (i - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    run, start = Run(name), time.perf_counter()
    for i in range(config.steps):
        meter = Meter(device, memory=i == min(1, config.steps - 1))
        optimizer.zero_grad(set_to_none=True)
        run.losses.append(step(i, meter))
        optimizer.step()
        after_step()
        schedule.step()
        if meter.memory:
            run.peak_bytes = meter.peak_bytes
        else:
            run.seconds.append(meter.seconds)
    print(f"  trained with the {name} head in {time.perf_counter() - start:.1f} s", flush=True)
    return run


def train_lm(name, config: SimpleNamespace, tokens: ZipfMarkovTokens, device) -> Run:
    """Train a fresh Llama, patched with ``apply_fusedloss`` for the "fusedloss" run."""
    torch.manual_seed(SEED)
    model = build_llama(config).to(device)
    if name == "fusedloss":
        apply_fusedloss(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.01)
    autocast = torch.autocast(device.type, config.dtype, enabled=config.dtype != torch.float32)

    def step(i: int, meter: Meter) -> float:
        batch = tokens.batch(i, config.batch_size, config.seq_len).to(device)
        with meter:  # the whole forward and backward: the loss is inside the model's forward
            with autocast:
                loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
        return loss.item()

    return train(name, config, optimizer, step, device)


def train_clip(name, config: SimpleNamespace, pairs: PairedLatents, device) -> tuple[Run, float]:
    """Train fresh towers with one loss; returns the run and the learned scale."""
    torch.manual_seed(SEED)
    model = TwoTower(config).to(device)
    decay = [p for p in model.parameters() if p.ndim >= 2]  # as open_clip: no weight decay
    no_decay = [p for p in model.parameters() if p.ndim < 2]  # of biases and the scale
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0}],
                                  lr=config.lr, weight_decay=0.1)

    def step(i: int, meter: Meter) -> float:
        images, texts = (x.to(device) for x in pairs.batch(i, config.batch_size))
        outputs = model(images, texts)
        # The loss runs on detached copies so that the meter sees the loss layer alone; their
        # gradients then go through the towers, as one backward through everything would.
        image, text, scale = (x.detach().requires_grad_() for x in outputs)
        with meter:
            loss = CLIP_LOSSES[name](image.to(config.dtype), text.to(config.dtype), scale)
            loss.backward()
        torch.autograd.backward(outputs, [image.grad, text.grad, scale.grad])
        return loss.item()

    def clamp() -> None:  # as open_clip, after every optimizer step: the scale is at most 100
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))

    run = train(name, config, optimizer, step, device, after_step=clamp)
    return run, model.logit_scale.exp().item()


# --- Comparing and reporting ---

# Training amplifies rounding differences, so the runs drift apart slowly: the tolerance is on
# the final loss (the mean of the last 10 steps), in nats, by the dtype of the loss's inputs.
TOLERANCE = {torch.float32: 1e-2, torch.bfloat16: 5e-2}


@dataclass
class Comparison:
    title: str
    reference: Run  # pytorch
    candidate: Run  # fusedloss
    tolerance: float
    measured: str  # what the memory and the time cover
    notes: list[str]

    def differences(self) -> list[float]:
        return [c - r for r, c in zip(self.reference.losses, self.candidate.losses, strict=True)]

    def final_losses(self, last: int = 10) -> tuple[float, float]:
        return tuple(sum(r.losses[-last:]) / len(r.losses[-last:])
                     for r in (self.reference, self.candidate))

    def agrees(self) -> bool:
        reference, candidate = self.final_losses()
        return abs(candidate - reference) <= self.tolerance

    def verdict(self) -> str:
        (reference, candidate), n = self.final_losses(), len(self.reference.losses)
        return (f"verdict: max |difference| over {n} steps = "
                f"{max(abs(d) for d in self.differences()):.2e}; final losses (mean of last 10 "
                f"steps) pytorch {reference:.4f} vs fusedloss {candidate:.4f}: "
                f"{'AGREE' if self.agrees() else 'DISAGREE'} within {self.tolerance:g} nats")


def plot(comparison: Comparison, path: Path) -> None:
    """Both curves, and their difference below, into a PNG (if matplotlib is installed)."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)")
        return
    steps = range(1, len(comparison.reference.losses) + 1)
    figure, (curves, difference) = plt.subplots(
        2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for run, style in ((comparison.reference, "-"), (comparison.candidate, "--")):
        curves.plot(steps, run.losses, style, label=f"{run.name} head", linewidth=1.2)
    curves.set(ylabel="training loss (nats)", title=comparison.title)
    curves.legend()
    difference.plot(steps, comparison.differences(), color="tab:red", linewidth=1.0)
    difference.set(ylabel="fusedloss − pytorch", xlabel="step")
    for axes in (curves, difference):
        axes.grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"plot written to {path}")


def report(comparison: Comparison, device: torch.device, path: Path) -> None:
    """Print the curves (about 15 rows), memory, time and notes; plot; print the verdict."""
    runs, n = (comparison.reference, comparison.candidate), len(comparison.reference.losses)
    header = f"{'step':>6}  {'pytorch':>10}  {'fusedloss':>10}  {'difference':>11}"
    print(f"\n{header}\n{'-' * len(header)}")
    for i in sorted({*range(0, n, max(1, n // 15)), n - 1}):
        r, c = (run.losses[i] for run in runs)
        print(f"{i + 1:>6}  {r:>10.5f}  {c:>10.5f}  {c - r:>+11.2e}")
    how = "torch.cuda.max_memory_allocated" if device.type == "cuda" else (
        "measured with torch.profiler allocation events of PyTorch's CPU allocator")
    print(f"\n{comparison.measured} peak memory ({how} during its forward+backward of one "
          "step, above the start):")
    for run in runs:
        print(f"  {run.name:>10}: {run.peak_bytes / MiB:9.1f} MiB")
    sync = ", synchronized" if device.type == "cuda" else ""
    print(f"{comparison.measured} time (mean ms per step, forward+backward{sync}):")
    for run in runs:
        print(f"  {run.name:>10}: {run.mean_ms():9.2f} ms")
    for note in comparison.notes:
        print(f"note: {note}")
    plot(comparison, path)
    print(comparison.verdict())


# --- The two experiments, and the command line ---

def where(device: torch.device) -> str:
    n = torch.get_num_threads()
    return f"{n} CPU thread{'s' * (n > 1)}" if device.type == "cpu" else str(device)


def lm_experiment(config: SimpleNamespace, device: torch.device, out: Path) -> Comparison:
    tokens = ZipfMarkovTokens(config.vocab_size)
    v, rows = config.vocab_size, config.batch_size * config.seq_len
    dtype = str(config.dtype).removeprefix("torch.")
    forward = "in float32" if dtype == "float32" else f"under {dtype} autocast"
    print(f"fusedloss demo: causal LM (Hugging Face Llama), PyTorch head vs fusedloss head "
          f"(apply_fusedloss), on {where(device)}\n  model: LlamaForCausalLM (random init), "
          f"V={v}, D={config.d_model}, "
          f"{config.n_layers} decoder layers ({config.n_heads} heads), batch "
          f"{config.batch_size}×{config.seq_len} tokens, {config.steps} steps, AdamW lr "
          f"{config.lr:g}, forward {forward}\n  data: Zipf-Markov chain, 64 successors per "
          f"token, exponent 1.1; loss of a uniform guess ln V = {math.log(v):.3f} nats")
    runs = [train_lm(name, config, tokens, device) for name in ("pytorch", "fusedloss")]
    notes = [
        "measured: the model's whole forward+backward (not the optimizer update), since the "
        "loss is inside transformers' forward; the rest is the same in both runs",
        f"analytic: transformers' head materializes B·T×V = {rows}×{v} fp32 logits = "
        f"{rows * v * 4 / MiB:.1f} MiB, F.cross_entropy a log-softmax of that size for the "
        "backward, which builds gradients of that size",
        "fusedloss (Triton) keeps per-row statistics and small per-tile records, never an N×V "
        "array" if device.type == "cuda" else "on the CPU fusedloss runs its chunked "
        "pure-PyTorch path: it holds a bounded block of rows × V fp32 logits at a time, not all "
        "N rows, and recomputes it in the backward, so its step is slower; on CUDA its Triton "
        "path holds no such block",
    ]
    comparison = Comparison(f"causal LM (LlamaForCausalLM), V={v}, D={config.d_model}, "
                            f"{config.n_layers} layers", *runs, TOLERANCE[config.dtype],
                            "training step", notes)
    report(comparison, device, out / "lm_loss_curves.png")
    return comparison


def clip_experiment(config: SimpleNamespace, device: torch.device, out: Path) -> Comparison:
    pairs = PairedLatents(config.latent_dim, config.image_dim, config.text_dim)
    b, h, e = config.batch_size, config.hidden_dim, config.embed_dim
    dtype = str(config.dtype).removeprefix("torch.")
    print("fusedloss demo: CLIP-style two towers, PyTorch loss (open_clip's formula) vs "
          f"fusedloss.clip_loss, on {where(device)}\n  model: 2 MLP towers ({config.image_dim}"
          f"→{h}→{h}→{e} and {config.text_dim}→{h}→{h}→{e}), L2-normalized, learnable "
          f"logit_scale (init 1/0.07, clamped at 100); batch {b} pairs, {config.steps} steps, "
          f"AdamW lr {config.lr:g}, loss inputs in {dtype}\n  data: latent z ~ "
          f"N(0, I_{config.latent_dim}); image = a fixed random tanh map of z ({config.image_dim}"
          f" dims), text = another ({config.text_dim} dims), each plus N(0, {pairs.noise:g}²) "
          f"noise; loss of a uniform guess ln b = {math.log(b):.3f} nats")
    (reference, scale), (candidate, fused_scale) = (
        train_clip(name, config, pairs, device) for name in ("pytorch", "fusedloss"))
    notes = [
        f"learned logit_scale after {config.steps} steps: pytorch {scale:.3f}, fusedloss "
        f"{fused_scale:.3f} (init {1 / 0.07:.3f})",
        f"analytic: the PyTorch loss materializes b×b = {b}×{b} fp32 logits = "
        f"{b * b * 4 / MiB:.1f} MiB, and its two F.cross_entropy calls a log-softmax each",
        "fusedloss.clip_loss (Triton) keeps per-row and per-column log-sum-exps and small "
        "per-tile records, never a b×b array" if device.type == "cuda" else "on the CPU "
        "clip_loss runs its chunked pure-PyTorch path, whose block of rows × b logits is, at a b "
        "this small, all b rows: no saving here; the saving is the Triton path's, on CUDA",
    ]
    comparison = Comparison(f"CLIP-style two towers, batch {b} pairs, E={e}", reference,
                            candidate, TOLERANCE[config.dtype], "loss layer", notes)
    report(comparison, device, out / "clip_loss_curves.png")
    return comparison


def main(argv: list[str] | None = None) -> dict[str, Comparison]:
    experiments = {"lm": lm_experiment, "clip": clip_experiment}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", choices=["all", *experiments], default="all")
    parser.add_argument("--size", choices=["auto", *SIZES], default="auto",
                        help="auto: large on CUDA, else small; tiny: a smoke run")
    parser.add_argument("--steps", type=int, help="training steps per run (default: the size's)")
    parser.add_argument("--out", type=Path, default=Path("demo_out"), help="folder of the plots")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default: 1)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = args.size if args.size != "auto" else ("large" if device.type == "cuda" else "small")
    if device.type == "cpu":  # one thread by default: on a small shared machine an
        torch.set_num_threads(args.threads)  # oversubscribed pool makes the steps erratic
    comparisons = {}
    for name in experiments if args.experiment == "all" else [args.experiment]:
        if comparisons:
            print("\n" + "=" * 100 + "\n")
        config = SimpleNamespace(**SIZES[size][name])
        config.steps = args.steps or config.steps
        comparisons[name] = experiments[name](config, device, args.out)
    return comparisons


if __name__ == "__main__":
    main()
