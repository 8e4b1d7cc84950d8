"""The "trained" LM-head regime (benchmarks/README.md): E, C, y of a small GPT trained on the
``.py`` files of site-packages, run on held-out text. ``python -m benchmarks.trained_lm --out DIR
[--minutes M | --quick]`` writes trained_lm.pt ({"E", "C", "y", "x", "metadata"}),
trained_lm.json (the metadata), tokenizer.json, and model.pt with Settings.save_model."""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import hashlib
import json
import math
import os
import platform
import site
import sys
import sysconfig
import time
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.inputs import TRAINED_LM_FILE, TRAINED_REGIME

END_OF_TEXT = "<|endoftext|>"
METADATA_FILE = "trained_lm.json"
TOKENIZER_FILE = "tokenizer.json"
MODEL_FILE = "model.pt"
FORMAT_VERSION = 1
SOFTMAX_THRESHOLD = 2.0**-12  # the "below bf16 precision" level of gradient filtering
SOFTMAX_TOP = (50, 1000, 10000)
MB = 1_000_000

Log = Callable[[str], None]
_print = functools.partial(print, flush=True)


@dataclass(frozen=True)
class Settings:
    """Everything that decides the result; the defaults are the full-size run."""

    out: Path
    minutes: float = 4.0  # training wall clock after the first step
    steps: int | None = None  # a fixed step count instead of the time budget
    vocab: int = 32768  # V (≥ the tokenizer's vocabulary)
    width: int = 768  # D
    layers: int = 4
    heads: int = 12
    seq_len: int = 1024
    batch_size: int = 32  # windows per step
    n: int = 8192  # rows saved
    corpus_mb: float = 200.0
    tokenizer_mb: float = 64.0  # training text the tokenizer learns from
    max_tokens: int = 128_000_000  # cap on the training stream
    held_out_fraction: float = 0.02
    max_file_kb: float = 1024.0  # larger files (mostly generated tables) are skipped
    roots: tuple[str, ...] = ()  # empty: the interpreter's site-packages
    lr: float = 1e-3
    warmup: float = 0.05  # fraction of the budget
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    eval_windows: int = 32  # held-out windows of each evaluation
    eval_every_s: float = 30.0
    device: str = ""  # empty: cuda when available, else cpu
    seed: int = 0
    save_model: bool = False


QUICK = dict(steps=20, vocab=512, width=32, layers=1, heads=2, seq_len=64, batch_size=8, n=96,
             corpus_mb=0.2, tokenizer_mb=0.2, held_out_fraction=0.1, max_file_kb=64.0, lr=1e-2,
             warmup=0.1, eval_windows=4, device="cpu")  # --quick: tiny, CPU, seconds


@dataclass
class Corpus:
    train: list[str] = field(default_factory=list)
    held_out: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


def default_roots() -> list[str]:
    """Existing site-/dist-packages directories (no repeats), torch's own included."""
    candidates = [*site.getsitepackages(), sysconfig.get_paths()["purelib"]]
    user = site.getusersitepackages()
    if isinstance(user, str):
        candidates.append(user)
    candidates.append(str(Path(torch.__file__).resolve().parents[1]))
    candidates += [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")]
    roots, seen = [], set()
    for candidate in candidates:
        real = os.path.realpath(candidate)
        if os.path.isdir(real) and real not in seen:
            seen.add(real)
            roots.append(candidate)
    return roots


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()[:8],
                          "big")


def is_held_out(relative_path: str, fraction: float) -> bool:
    """A hash of the file's path (not the seed) decides."""
    return _digest(relative_path) < fraction * 2.0**64


def list_python_files(roots: Sequence[str]) -> list[tuple[str, str]]:
    found = []
    for root in roots:
        for directory, subdirectories, files in os.walk(root):
            subdirectories.sort()
            found += [(root, os.path.relpath(os.path.join(directory, name), root))
                      for name in sorted(files) if name.endswith(".py")]
    return found


def _read_text(path: Path, max_bytes: float, seen: set[bytes]) -> tuple[bytes | None, str]:
    """(raw bytes, text), or (None, why it is skipped)."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None, "unreadable"
    if not raw.strip():
        return None, "empty"
    if len(raw) > max_bytes:
        return None, "too_large"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not_utf8"
    digest = hashlib.sha256(raw).digest()
    if digest in seen:
        return None, "duplicate"
    seen.add(digest)
    return raw, text


def collect_corpus(settings: Settings) -> Corpus:
    """Files in a seeded hash order of their paths, each split filled to its quota."""
    roots = list(settings.roots) or default_roots()
    if not roots:
        raise RuntimeError("no site-packages directory found")
    files = list_python_files(roots)
    order = sorted(files, key=lambda f: (_digest(f"{settings.seed}:{f[1]}"), f))
    held = settings.held_out_fraction
    quota = {"train": (1.0 - held) * settings.corpus_mb * MB,
             "held_out": held * settings.corpus_mb * MB}
    taken = {"train": 0, "held_out": 0}
    corpus = Corpus()
    texts = {"train": corpus.train, "held_out": corpus.held_out}
    skipped, packages, seen = Counter(), Counter(), set()
    for root, relative in order:
        if all(taken[s] >= quota[s] for s in taken):
            break
        split = "held_out" if is_held_out(relative, held) else "train"
        if taken[split] >= quota[split]:
            continue
        raw, text = _read_text(Path(root, relative), settings.max_file_kb * 1000, seen)
        if raw is None:
            skipped[text] += 1
            continue
        texts[split].append(text)
        taken[split] += len(raw)
        packages[relative.split(os.sep, 1)[0]] += len(raw)
    if not corpus.train or not corpus.held_out:
        raise RuntimeError(f"too little text under {roots}: {len(corpus.train)} training and "
                           f"{len(corpus.held_out)} held-out files")
    corpus.info = {
        "source": ".py files under site-packages" if not settings.roots else ".py files",
        "roots": roots, "python_files_found": len(files),
        "files": {"train": len(corpus.train), "held_out": len(corpus.held_out)},
        "bytes": dict(taken), "skipped_files": dict(skipped),
        "largest_packages_mb": {k: round(v / MB, 2) for k, v in packages.most_common(15)},
        "cap_mb": settings.corpus_mb, "held_out_fraction": held,
        "split": "by a hash of the file's path relative to its root", "seed": settings.seed,
    }
    return corpus


def train_tokenizer(texts: Sequence[str], vocab_size: int, max_bytes: float) -> Any:
    """Byte-level BPE of ≤ ``vocab_size`` entries, trained on the first ~``max_bytes``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sample, size = [], 0
    for text in texts:
        if size >= max_bytes:
            break
        sample.append(text)
        size += len(text)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer, tokenizer.decoder = (
        pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel())
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(sample, trainer, length=len(sample))
    return tokenizer


def token_stream(tokenizer: Any, texts: Sequence[str], max_tokens: int | None = None,
                 batch: int = 512) -> Tensor:
    """int32 ids of ``texts``, each followed by END_OF_TEXT, one stream cut at max_tokens."""
    end = tokenizer.token_to_id(END_OF_TEXT)
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    ids = array("i")
    for start in range(0, len(texts), batch):
        for encoding in encode(list(texts[start : start + batch])):
            ids.extend(encoding.ids)
            ids.append(end)
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    if max_tokens is not None:
        del ids[max_tokens:]
    if not ids:
        return torch.empty(0, dtype=torch.int32)
    return torch.frombuffer(ids, dtype=torch.int32).clone()


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    width: int
    layers: int
    heads: int
    seq_len: int


class Block(nn.Module):
    """Pre-norm block: causal self-attention, then a 4× GELU MLP; no biases."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        width, self.heads = config.width, config.heads
        self.attention_norm = nn.LayerNorm(width, bias=False)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.attention_out = nn.Linear(width, width, bias=False)
        self.mlp_norm = nn.LayerNorm(width, bias=False)
        self.mlp_in = nn.Linear(width, 4 * width, bias=False)
        self.mlp_out = nn.Linear(4 * width, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, width = x.shape
        qkv = self.qkv(self.attention_norm(x)).view(b, t, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attention_out(attended.transpose(1, 2).reshape(b, t, width))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.mlp_norm(x))))


class GPT(nn.Module):
    """Decoder-only LM; ``hidden`` gives the final normed states the head reads."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.width % config.heads:
            raise ValueError(f"width {config.width} is not a multiple of heads {config.heads}")
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.width)
        self.position_embedding = nn.Embedding(config.seq_len, config.width)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.width, bias=False)
        self.head = nn.Linear(config.width, config.vocab_size, bias=False)
        # GPT-2's initialization: N(0, 0.02), residual outputs scaled by 1/√(2·layers).
        for name, parameter in self.named_parameters():
            if parameter.dim() == 2:
                std = 0.02 / math.sqrt(2 * config.layers) if name.endswith("_out.weight") else 0.02
                nn.init.normal_(parameter, std=std)

    def hidden(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        logits = self.head(self.hidden(tokens))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def autocast(device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def precision(device: torch.device) -> str:
    return "bf16 autocast, float32 weights" if device.type == "cuda" else "float32"


def windows(stream: Tensor, count: int, seq_len: int) -> tuple[Tensor, Tensor, Tensor]:
    """``count`` windows evenly over ``stream``: starts, inputs, targets (count, seq_len)."""
    last = stream.numel() - seq_len - 1
    if last < 0:
        raise ValueError(f"a stream of {stream.numel()} tokens is shorter than one window")
    starts = torch.linspace(0, last, count, dtype=torch.float64, device=stream.device).long()
    chunk = stream[starts[:, None] + torch.arange(seq_len + 1, device=stream.device)].long()
    return starts, chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def evaluate(model: GPT, inputs: Tensor, targets: Tensor, device: torch.device) -> float:
    total = torch.zeros((), device=device)
    for start in range(0, inputs.shape[0], 8):
        with autocast(device):
            loss = model(inputs[start : start + 8], targets[start : start + 8])
        total += loss * inputs[start : start + 8].shape[0]
    return float(total) / inputs.shape[0]


def cosine_decay(progress: float, floor: float) -> float:
    """1 at ``progress`` 0, cosine down to ``floor`` at 1 (and after)."""
    return floor + 0.5 * (1.0 - floor) * (1.0 + math.cos(math.pi * min(1.0, progress)))


def learning_rate(settings: Settings, progress: float) -> float:
    """Linear warm-up over ``settings.warmup`` of the budget, then cosine to the floor."""
    if progress < settings.warmup:
        return settings.lr * progress / settings.warmup
    decay = (progress - settings.warmup) / max(1e-9, 1.0 - settings.warmup)
    return settings.lr * cosine_decay(decay, settings.min_lr_ratio)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(model: GPT, train_stream: Tensor, held_out_stream: Tensor, settings: Settings,
          device: torch.device, log: Log = _print) -> dict[str, Any]:
    """Trains ``model`` in place; returns the training record for the metadata."""
    seq_len = settings.seq_len
    if train_stream.numel() < seq_len + 2:
        raise RuntimeError(f"the training stream ({train_stream.numel()} tokens) is too short")
    _, eval_inputs, eval_targets = windows(held_out_stream, settings.eval_windows, seq_len)
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2],
               "weight_decay": settings.weight_decay},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=0.0, betas=(0.9, 0.95), fused=device.type == "cuda")
    generator = torch.Generator(device=device).manual_seed(settings.seed)
    offsets = torch.arange(seq_len + 1, device=device)
    tokens_per_step = settings.batch_size * seq_len

    def step(lr: float) -> Tensor:
        starts = torch.randint(0, train_stream.numel() - seq_len, (settings.batch_size,),
                               device=device, generator=generator)
        chunk = train_stream[starts[:, None] + offsets].long()
        for group in optimizer.param_groups:
            group["lr"] = lr
        with autocast(device):
            loss = model(chunk[:, :-1], chunk[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    model.train()
    initial = evaluate(model, eval_inputs, eval_targets, device)
    history = [{"step": 0, "seconds": 0.0, "tokens": 0, "lr": 0.0, "train_loss": None,
                "held_out_loss": initial}]
    log(f"step 0: held-out loss {initial:.3f} (log V = {math.log(model.config.vocab_size):.3f})")
    # The first step (learning rate 0, the kernels' first launches) is outside the budget.
    started = time.perf_counter()
    step(0.0)
    _sync(device)
    first_step_s = time.perf_counter() - started

    steps, running, running_steps = 1, torch.zeros((), device=device), 0
    clock = time.perf_counter()
    next_eval = settings.eval_every_s
    while True:
        elapsed = time.perf_counter() - clock
        if settings.steps is not None:
            progress = (steps - 1) / max(1, settings.steps - 1)
            done = steps >= settings.steps
        else:
            progress = elapsed / (settings.minutes * 60.0)
            done = progress >= 1.0
        lr = learning_rate(settings, min(progress, 1.0))
        if done or elapsed >= next_eval:
            _sync(device)
            elapsed = time.perf_counter() - clock
            train_loss = float(running) / running_steps if running_steps else None
            held_out = evaluate(model, eval_inputs, eval_targets, device)
            history.append({"step": steps, "seconds": round(elapsed, 2),
                            "tokens": steps * tokens_per_step, "lr": lr,
                            "train_loss": train_loss, "held_out_loss": held_out})
            shown = f"{train_loss:.3f}" if train_loss is not None else "—"
            log(f"step {steps}: {elapsed:.0f} s, train loss {shown}, held-out loss "
                f"{held_out:.3f}, {steps * tokens_per_step / max(elapsed, 1e-9) / 1e3:.0f}k "
                "tokens/s")
            running, running_steps = torch.zeros((), device=device), 0
            next_eval = elapsed + settings.eval_every_s
            if done:
                break
        running += step(lr)
        running_steps += 1
        steps += 1
    seconds = time.perf_counter() - clock
    model.eval()
    return {
        "steps": steps, "tokens": steps * tokens_per_step, "seconds": round(seconds, 2),
        "first_step_seconds": round(first_step_s, 2),
        "tokens_per_second": round((steps - 1) * tokens_per_step / max(seconds, 1e-9)),
        "budget": f"{settings.steps} steps" if settings.steps else f"{settings.minutes} min",
        "batch": f"{settings.batch_size} random windows × {seq_len} tokens",
        "optimizer": "AdamW β=(0.9, 0.95), weight decay on matrices, gradient clip 1.0",
        "lr": settings.lr,
        "schedule": f"linear warm-up {settings.warmup:.0%} of the budget, cosine to "
        f"{settings.min_lr_ratio:g}× the peak",
        "weight_decay": settings.weight_decay, "precision": precision(device),
        "final_train_loss": history[-1]["train_loss"],
        "final_held_out_loss": history[-1]["held_out_loss"],
        "held_out_eval": f"{settings.eval_windows} windows spread over the held-out stream",
        "log": history,
    }


@torch.no_grad()
def extract_rows(model: GPT, held_out_stream: Tensor, n: int, device: torch.device
                 ) -> dict[str, Any]:
    """hidden (n, D) float32, x, y, the model's own per-row loss and the window starts of
    ceil(n / seq_len) windows spread evenly over the held-out stream, cut at n rows."""
    seq_len = model.config.seq_len
    count = math.ceil(n / seq_len)
    if held_out_stream.numel() < count * seq_len + 1:
        raise RuntimeError(
            f"the held-out stream has {held_out_stream.numel()} tokens, fewer than the "
            f"{count * seq_len + 1} that {n} rows need: raise corpus_mb or "
            "held_out_fraction, or lower n")
    starts, inputs, targets = windows(held_out_stream.to(device), count, seq_len)
    hidden, losses = [], []
    for start in range(0, count, 8):
        x, y = inputs[start : start + 8], targets[start : start + 8]
        with autocast(device):
            h = model.hidden(x)
            logits = model.head(h)
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none"))
        hidden.append(h.float().flatten(0, 1))
    return {"hidden": torch.cat(hidden)[:n], "inputs": inputs.flatten()[:n],
            "targets": targets.flatten()[:n], "model_loss": torch.cat(losses)[:n],
            "starts": starts.tolist()}


@torch.no_grad()
def softmax_shape(hidden: Tensor, classifier: Tensor, labels: Tensor,
                  rows_per_block: int = 0) -> dict[str, Any]:
    """Per-row statistics of softmax(hidden @ classifier.T), float32, ≤ 2^26 logits a block."""
    n, vocab = hidden.shape[0], classifier.shape[0]
    if rows_per_block <= 0:
        rows_per_block = max(1, min(n, (1 << 26) // vocab))
    weight = classifier.float()
    counts, outside, losses, p_target = [], {k: [] for k in SOFTMAX_TOP}, [], []
    for start in range(0, n, rows_per_block):
        log_p = torch.log_softmax(hidden[start : start + rows_per_block].float() @ weight.T, 1)
        y = labels[start : start + rows_per_block]
        loss = -log_p.gather(1, y[:, None]).squeeze(1)
        losses.append(loss)
        p_target.append(torch.exp(-loss))
        p = log_p.exp_()
        counts.append((p > SOFTMAX_THRESHOLD).sum(dim=1))
        # mass outside the top k = sum of the V − k smallest, summed from the small end
        tail = p.sort(dim=1).values.cumsum_(dim=1)
        for k in SOFTMAX_TOP:
            outside[k].append(tail[:, vocab - k - 1] if k < vocab else torch.zeros_like(loss))
        del p, tail, log_p
    count = torch.cat(counts).double()
    return {
        "computed_from": "the stored bf16 E and C: float32 logits E·Cᵀ, float32 softmax",
        "rows": n, "vocab": vocab, "threshold": SOFTMAX_THRESHOLD,
        "entries_above_threshold_mean": float(count.mean()),
        "entries_above_threshold_median": float(count.quantile(0.5)),
        "mass_outside_top": {str(k): float(torch.cat(outside[k]).double().mean())
                             for k in SOFTMAX_TOP},
        "mean_loss": float(torch.cat(losses).double().mean()),
        "mean_p_target": float(torch.cat(p_target).double().mean()),
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or device.type


def build(settings: Settings, argv: Sequence[str] | None = None, log: Log = _print) -> Path:
    """Runs every step and writes DIR; returns the path of ``trained_lm.pt``."""
    import tokenizers

    device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(settings.seed)
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    began = tick = time.perf_counter()
    corpus = collect_corpus(settings)
    info = corpus.info
    info["seconds"] = round(time.perf_counter() - tick, 2)
    log(f"corpus: {info['files']['train']} + {info['files']['held_out']} files, "
        f"{info['bytes']['train'] / MB:.1f} + {info['bytes']['held_out'] / MB:.1f} "
        f"MB (train + held-out) from {', '.join(info['roots'])}")

    tick = time.perf_counter()
    tokenizer = train_tokenizer(corpus.train, settings.vocab, settings.tokenizer_mb * MB)
    tokenizer_s = time.perf_counter() - tick
    tokenizer.save(str(out / TOKENIZER_FILE))
    tick = time.perf_counter()
    train_stream = token_stream(tokenizer, corpus.train, settings.max_tokens)
    held_out_stream = token_stream(tokenizer, corpus.held_out)
    encode_s = time.perf_counter() - tick
    info["tokens"] = {"train": train_stream.numel(), "held_out": held_out_stream.numel()}
    info["max_tokens"] = settings.max_tokens
    tokenizer_info = {
        "kind": "byte-level BPE (tokenizers: ByteLevel pre-tokenizer and decoder)",
        "vocab_size": tokenizer.get_vocab_size(), "requested_vocab_size": settings.vocab,
        "end_of_text": END_OF_TEXT, "end_of_text_id": tokenizer.token_to_id(END_OF_TEXT),
        "trained_on_mb": settings.tokenizer_mb, "train_seconds": round(tokenizer_s, 2),
        "encode_seconds": round(encode_s, 2),
        "bytes_per_token_train": round(info["bytes"]["train"] / max(1, len(train_stream)), 3),
        "file": TOKENIZER_FILE,
    }
    del corpus  # the texts: up to a few hundred MB
    log(f"tokenizer: {tokenizer_info['vocab_size']} entries in {tokenizer_s:.0f} s; "
        f"{train_stream.numel() / 1e6:.1f}M + {held_out_stream.numel() / 1e6:.2f}M tokens "
        f"in {encode_s:.0f} s")

    config = GPTConfig(max(settings.vocab, tokenizer.get_vocab_size()), settings.width,
                       settings.layers, settings.heads, settings.seq_len)
    model = GPT(config).to(device)
    parameters = sum(p.numel() for p in model.parameters())
    log(f"model: {parameters / 1e6:.1f}M parameters, {config}, on {_device_name(device)}")
    training = train(model, train_stream.to(device), held_out_stream.to(device), settings,
                     device, log)

    rows = extract_rows(model, held_out_stream, settings.n, device)
    E = rows["hidden"].to(torch.bfloat16)
    C = model.head.weight.detach().to(torch.bfloat16)
    y = rows["targets"]
    softmax = softmax_shape(E, C, y)
    log(f"rows: N={settings.n}, model loss {float(rows['model_loss'].mean()):.3f}, E·Cᵀ loss "
        f"{softmax['mean_loss']:.3f}; entries > 2^-12 per row: mean "
        f"{softmax['entries_above_threshold_mean']:.1f}, median "
        f"{softmax['entries_above_threshold_median']:.0f}; mass outside top "
        + ", ".join(f"{k}: {v:.3f}" for k, v in softmax["mass_outside_top"].items()))

    metadata = {
        "format": FORMAT_VERSION, "regime": TRAINED_REGIME,
        "shapes": {"E": list(E.shape), "C": list(C.shape), "y": [y.numel()]},
        "dtypes": {"E": "bfloat16", "C": "bfloat16", "y": "int64", "x": "int64"},
        "rows": {
            "n": settings.n,
            "source": "held-out text: ceil(N / seq_len) windows of the training length spread "
            "evenly over the held-out token stream, all their positions in order, cut at N",
            "seq_len": settings.seq_len, "window_starts": rows["starts"],
            "E": "final LayerNorm output (the head's input)",
            "y": "next token: row j of window w reads stream[start_w + j] (x) and predicts "
            "stream[start_w + j + 1] (y)",
            "C": "the head's weight",
            "model_loss": float(rows["model_loss"].double().mean()),
            "model_loss_precision": precision(device),
        },
        "softmax": softmax, "corpus": info, "tokenizer": tokenizer_info,
        "model": {**asdict(config), "head": "untied", "positions": "learned",
                  "norm": "LayerNorm without bias, pre-norm blocks, final LayerNorm",
                  "mlp": "4× GELU",
                  "attention": "causal torch.nn.functional.scaled_dot_product_attention",
                  "bias": False, "parameters": parameters},
        "training": training,
        "settings": json.loads(json.dumps(asdict(settings), default=str)),
        "command": " ".join(["python -m benchmarks.trained_lm", *(argv or [])]),
        "seconds_total": round(time.perf_counter() - began, 1),
        "device": _device_name(device), "torch": torch.__version__, "cuda": torch.version.cuda,
        "tokenizers": tokenizers.__version__, "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    # Plain JSON types only (torch.__version__ is a str subclass that weights_only rejects).
    metadata = json.loads(json.dumps(metadata))
    path = out / TRAINED_LM_FILE
    torch.save({"E": E.cpu(), "C": C.cpu(), "y": y.cpu(), "x": rows["inputs"].cpu(),
                "metadata": metadata}, path)
    (out / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n", encoding="utf-8")
    if settings.save_model:
        state = {name: value.detach().cpu() for name, value in model.state_dict().items()}
        torch.save({"config": asdict(config), "state_dict": state}, out / MODEL_FILE)
    log(f"wrote {path} ({path.stat().st_size / MB:.1f} MB) and {out / METADATA_FILE}")
    return path


def load_model(path: str | os.PathLike[str], device: str | torch.device = "cpu") -> GPT:
    """The model ``Settings.save_model`` wrote (``path``: DIR or DIR/model.pt)."""
    file = Path(path)
    if file.is_dir():
        file = file / MODEL_FILE
    payload = torch.load(file, map_location="cpu", weights_only=True)
    model = GPT(GPTConfig(**payload["config"]))
    model.load_state_dict(payload["state_dict"])
    return model.to(device).eval()


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trained_lm", description=(
        "Train a small GPT on this machine's Python packages; save its held-out E, C, y."))
    add = parser.add_argument
    add("--out", type=Path, required=True, help="output directory")
    add("--quick", action="store_true", help="tiny CPU run in seconds (tests); flags override")
    add("--minutes", type=float, help="training wall clock after the first step (default 4)")
    add("--steps", type=int, help="train this many steps instead of --minutes")
    add("--device", help="torch device (default: cuda when available; cpu with --quick)")
    add("--seed", type=int, help="seed of file order, initialization and batches (default 0)")
    args = parser.parse_args(argv)
    values = dict(QUICK) if args.quick else {}
    names = {f.name for f in fields(Settings)}
    values.update({k: v for k, v in vars(args).items() if k in names and v is not None})
    if args.minutes is not None and args.steps is None:
        values["steps"] = None  # an explicit time budget beats --quick's step count
    settings = replace(Settings(out=args.out), **values)
    if (settings.steps is not None and settings.steps < 1) or settings.minutes <= 0:
        parser.error("--steps must be ≥ 1 and --minutes > 0")
    return settings


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    build(parse_args(argv), argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
