"""The "trained" LM-head regime (benchmarks/README.md): E, C, y of a small GPT trained on the
``.py`` files of site-packages, on held-out text. ``python -m benchmarks.trained_lm --out DIR``
writes trained_lm.pt ({"E", "C", "y", "x", "metadata"}), trained_lm.json and tokenizer.json."""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import site
import sys
import sysconfig
import time
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.common import collect_environment
from benchmarks.inputs import TRAINED_LM_FILE, TRAINED_REGIME

END_OF_TEXT = "<|endoftext|>"
METADATA_FILE = "trained_lm.json"
TOKENIZER_FILE = "tokenizer.json"
SOFTMAX_THRESHOLD = 2.0**-12  # the "below bf16 precision" level of gradient filtering
SOFTMAX_TOP = (50, 1000, 10000)
MB = 1_000_000


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
    held_out_fraction: float = 0.02
    max_file_kb: float = 1024.0  # larger files (mostly generated tables) are skipped
    roots: tuple[str, ...] = ()  # empty: the interpreter's site-packages
    lr: float = 1e-3
    warmup: float = 0.05  # fraction of the budget
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    device: str = ""  # empty: cuda when available, else cpu
    seed: int = 0


QUICK = dict(steps=20, vocab=512, width=32, layers=1, heads=2, seq_len=64, batch_size=8, n=96,
             corpus_mb=0.2, tokenizer_mb=0.2, held_out_fraction=0.1, max_file_kb=64.0, lr=1e-2,
             warmup=0.1, device="cpu")  # --quick: tiny, CPU, seconds


def default_roots() -> list[str]:
    """Existing site-/dist-packages directories (no repeats), torch's own included."""
    candidates = [*site.getsitepackages(), sysconfig.get_paths()["purelib"],
                  site.getusersitepackages(), str(Path(torch.__file__).resolve().parents[1]),
                  *(p for p in sys.path if os.path.basename(p) in ("site-packages",
                                                                    "dist-packages"))]
    roots: dict[str, str] = {}  # real path: the first spelling of it
    for candidate in filter(os.path.isdir, candidates):
        roots.setdefault(os.path.realpath(candidate), candidate)
    return list(roots.values())


def _digest(text: str) -> int:
    digest = hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big")


def is_held_out(relative_path: str, fraction: float) -> bool:
    """Whether a file is held out: a hash of its path (not the seed) decides."""
    return _digest(relative_path) < fraction * 2.0**64


def collect_corpus(settings: Settings) -> tuple[list[str], list[str], dict[str, Any]]:
    """(train texts, held-out texts, info): files in a seeded hash order of their paths, each
    split filled to its quota."""
    roots = list(settings.roots) or default_roots()
    files = []
    for root in roots:
        for directory, subdirectories, names in os.walk(root):
            subdirectories.sort()
            files += [(root, os.path.relpath(os.path.join(directory, name), root))
                      for name in sorted(names) if name.endswith(".py")]
    held = settings.held_out_fraction
    quota = {"train": (1.0 - held) * settings.corpus_mb * MB,
             "held_out": held * settings.corpus_mb * MB}
    taken, texts = {"train": 0, "held_out": 0}, {"train": [], "held_out": []}
    skipped, seen, max_bytes = Counter(), set(), settings.max_file_kb * 1000
    for root, relative in sorted(files, key=lambda f: (_digest(f"{settings.seed}:{f[1]}"), f)):
        if all(taken[split] >= quota[split] for split in taken):
            break
        split = "held_out" if is_held_out(relative, held) else "train"
        if taken[split] >= quota[split]:
            continue
        try:
            raw = Path(root, relative).read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError) as error:
            skipped["not_utf8" if isinstance(error, UnicodeDecodeError) else "unreadable"] += 1
            continue
        digest = hashlib.sha256(raw).digest()
        reason = ("empty" if not raw.strip() else "too_large" if len(raw) > max_bytes
                  else "duplicate" if digest in seen else None)
        if reason:
            skipped[reason] += 1
            continue
        seen.add(digest)
        texts[split].append(text)
        taken[split] += len(raw)
    if not texts["train"] or not texts["held_out"]:
        raise RuntimeError(f"too little text under {roots}: {len(texts['train'])} training and "
                           f"{len(texts['held_out'])} held-out files")
    info = {"roots": roots, "python_files_found": len(files),
            "files": {split: len(texts[split]) for split in texts}, "bytes": taken,
            "skipped_files": dict(skipped)}
    return texts["train"], texts["held_out"], info


def train_tokenizer(texts: Sequence[str], vocab_size: int, max_bytes: float) -> Any:
    """Byte-level BPE of ≤ ``vocab_size`` entries, trained on the first ~``max_bytes``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    before = itertools.accumulate((len(text) for text in texts), initial=0)  # text before each
    sample = [text for text, size in zip(texts, before, strict=False) if size < max_bytes]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(sample, trainer, length=len(sample))
    return tokenizer


def token_stream(tokenizer: Any, texts: Sequence[str]) -> Tensor:
    """int32 ids of ``texts``, each followed by END_OF_TEXT, as one stream."""
    end = tokenizer.token_to_id(END_OF_TEXT)
    ids = array("i")
    for start in range(0, len(texts), 512):
        for encoding in tokenizer.encode_batch_fast(list(texts[start : start + 512])):
            ids.extend(encoding.ids)
            ids.append(end)
    return torch.frombuffer(ids, dtype=torch.int32).clone()


class Block(nn.Module):
    """Pre-norm block: causal self-attention, then a 4× GELU MLP; no biases."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
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
    """Decoder-only LM of the settings' size: learned positions, untied head."""

    def __init__(self, vocab_size: int, settings: Settings) -> None:
        super().__init__()
        width, layers = settings.width, settings.layers
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.position_embedding = nn.Embedding(settings.seq_len, width)
        self.blocks = nn.ModuleList(Block(width, settings.heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width, bias=False)
        self.head = nn.Linear(width, vocab_size, bias=False)
        # GPT-2's initialization: N(0, 0.02), residual outputs scaled by 1/√(2·layers).
        for name, parameter in self.named_parameters():
            if parameter.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("_out.weight") else 0.02
                nn.init.normal_(parameter, std=std)

    def hidden(self, tokens: Tensor) -> Tensor:  # the final normed states, the head's input
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def autocast(device: torch.device) -> torch.autocast:  # bf16 on CUDA, float32 elsewhere
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def learning_rate(settings: Settings, progress: float) -> float:
    """Linear warm-up over ``settings.warmup`` of the budget, then cosine to the floor."""
    if progress < settings.warmup:
        return settings.lr * progress / settings.warmup
    decay = min(1.0, (progress - settings.warmup) / max(1e-9, 1.0 - settings.warmup))
    floor = settings.min_lr_ratio
    return settings.lr * (floor + 0.5 * (1.0 - floor) * (1.0 + math.cos(math.pi * decay)))


def train(model: GPT, train_stream: Tensor, settings: Settings) -> dict[str, Any]:
    """Trains ``model`` in place (AdamW, gradient clip 1, random windows): the record."""
    device, seq_len = train_stream.device, settings.seq_len
    groups = [{"params": [p for p in model.parameters() if (p.dim() >= 2) == matrix],
               "weight_decay": settings.weight_decay if matrix else 0.0}
              for matrix in (True, False)]
    optimizer = torch.optim.AdamW(groups, lr=0.0, betas=(0.9, 0.95), fused=device.type == "cuda")
    generator = torch.Generator(device=device).manual_seed(settings.seed)
    offsets = torch.arange(seq_len + 1, device=device)

    def step(lr: float) -> Tensor:
        starts = torch.randint(0, train_stream.numel() - seq_len, (settings.batch_size,),
                               device=device, generator=generator)
        chunk = train_stream[starts[:, None] + offsets].long()
        for group in optimizer.param_groups:
            group["lr"] = lr
        with autocast(device):
            logits = model.head(model.hidden(chunk[:, :-1]))
            loss = F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    losses = [step(0.0)]  # learning rate 0, the kernels' first launches: outside the budget
    float(losses[0])  # waits for the step
    clock = time.perf_counter()
    while True:
        if settings.steps is not None:
            if len(losses) >= settings.steps:
                break
            progress = (len(losses) - 1) / max(1, settings.steps - 1)
        else:
            progress = (time.perf_counter() - clock) / (settings.minutes * 60.0)
            if progress >= 1.0:
                break
        losses.append(step(learning_rate(settings, progress)))
    final_train = float(torch.stack(losses[-max(1, len(losses) // 10) :]).mean())
    seconds, tokens = time.perf_counter() - clock, settings.batch_size * seq_len
    print(f"{len(losses)} steps in {seconds:.0f} s: train loss {final_train:.3f} (the last "
          "tenth of the steps)", flush=True)
    return {"steps": len(losses), "tokens": len(losses) * tokens, "seconds": round(seconds, 2),
            "tokens_per_second": round((len(losses) - 1) * tokens / seconds),
            "precision": "bf16 autocast, float32 weights" if device.type == "cuda" else "float32",
            "final_train_loss": final_train}


@torch.no_grad()
def extract_rows(model: GPT, stream: Tensor, n: int, seq_len: int
                 ) -> tuple[list[int], Tensor, Tensor, Tensor]:
    """(window starts, E in float32, x, y): the first ``n`` positions of ceil(n / seq_len)
    windows spread evenly over ``stream``; row j of window w reads stream[start_w + j]."""
    count = math.ceil(n / seq_len)
    last = stream.numel() - seq_len - 1
    starts = torch.linspace(0, last, count, dtype=torch.float64, device=stream.device).long()
    chunk = stream[starts[:, None] + torch.arange(seq_len + 1, device=stream.device)].long()
    inputs, hidden = chunk[:, :-1], []
    for start in range(0, count, 8):
        with autocast(stream.device):
            hidden.append(model.hidden(inputs[start : start + 8]).float().flatten(0, 1))
    return starts.tolist(), torch.cat(hidden)[:n], inputs.flatten()[:n], chunk[:, 1:].flatten()[:n]


@torch.no_grad()
def softmax_shape(hidden: Tensor, classifier: Tensor, labels: Tensor,
                  rows_per_block: int = 0) -> dict[str, Any]:
    """Per-row statistics of softmax(hidden @ classifier.T), float32, ≤ 2^26 logits a block."""
    n, vocab = hidden.shape[0], classifier.shape[0]
    rows_per_block = rows_per_block or max(1, min(n, (1 << 26) // vocab))
    weight = classifier.float()
    counts, losses, outside = [], [], {k: [] for k in SOFTMAX_TOP}
    for start in range(0, n, rows_per_block):
        log_p = torch.log_softmax(hidden[start : start + rows_per_block].float() @ weight.T, 1)
        y = labels[start : start + rows_per_block]
        losses.append(-log_p.gather(1, y[:, None]).squeeze(1))
        p = log_p.exp_()
        counts.append((p > SOFTMAX_THRESHOLD).sum(dim=1))
        # mass outside the top k = sum of the V − k smallest, summed from the small end
        tail = p.sort(dim=1).values.cumsum_(dim=1)
        for k in SOFTMAX_TOP:
            outside[k].append(tail[:, vocab - k - 1] if k < vocab else torch.zeros_like(losses[-1]))
        del p, tail, log_p
    count, loss = torch.cat(counts).double(), torch.cat(losses)
    return {"rows": n, "vocab": vocab, "threshold": SOFTMAX_THRESHOLD,
            "entries_above_threshold_mean": float(count.mean()),
            "entries_above_threshold_median": float(count.quantile(0.5)),
            "mass_outside_top": {str(k): float(torch.cat(outside[k]).double().mean())
                                 for k in SOFTMAX_TOP},
            "mean_loss": float(loss.double().mean()),
            "mean_p_target": float(torch.exp(-loss).double().mean())}


def build(settings: Settings, argv: Sequence[str] = ()) -> GPT:
    """Runs every step and writes the files into ``settings.out``; returns the trained model."""
    import tokenizers

    device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(settings.seed)
    settings.out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    train_texts, held_out_texts, corpus = collect_corpus(settings)
    tokenizer = train_tokenizer(train_texts, settings.vocab, settings.tokenizer_mb * MB)
    tokenizer.save(str(settings.out / TOKENIZER_FILE))
    train_stream = token_stream(tokenizer, train_texts)
    held_out_stream = token_stream(tokenizer, held_out_texts)
    del train_texts, held_out_texts  # up to a few hundred MB
    corpus["tokens"] = {"train": train_stream.numel(), "held_out": held_out_stream.numel()}
    print(f"corpus from {', '.join(corpus['roots'])}: files {corpus['files']}, bytes "
          f"{corpus['bytes']}, tokens {corpus['tokens']}", flush=True)
    windows = math.ceil(settings.n / settings.seq_len)  # held-out windows of the saved rows
    if (train_stream.numel() < settings.seq_len + 2
            or held_out_stream.numel() <= windows * settings.seq_len):
        raise RuntimeError(f"too few tokens for {settings.n} held-out rows: raise corpus_mb or "
                           "held_out_fraction, or lower n")

    model = GPT(max(settings.vocab, tokenizer.get_vocab_size()), settings).to(device)
    training = train(model.train(), train_stream.to(device), settings)
    starts, hidden, x, y = extract_rows(model.eval(), held_out_stream.to(device), settings.n,
                                        settings.seq_len)
    E, C = hidden.to(torch.bfloat16), model.head.weight.detach().to(torch.bfloat16)
    softmax = softmax_shape(E, C, y)
    print(f"rows: N={settings.n}, held-out loss {softmax['mean_loss']:.3f} (log V = "
          f"{math.log(C.shape[0]):.3f})", flush=True)
    metadata = {
        "format": 1, "regime": TRAINED_REGIME,
        "shapes": {"E": list(E.shape), "C": list(C.shape), "y": [y.numel()]},
        "rows": {"n": settings.n, "seq_len": settings.seq_len, "window_starts": starts},
        "softmax": softmax, "corpus": corpus,
        "tokenizer_vocab_size": tokenizer.get_vocab_size(),
        "model_parameters": sum(p.numel() for p in model.parameters()), "training": training,
        "settings": asdict(settings),
        "command": " ".join(["python -m benchmarks.trained_lm", *argv]),
        "seconds_total": round(time.perf_counter() - began, 1),
        "environment": {**collect_environment(device), "tokenizers": tokenizers.__version__},
    }
    # Plain JSON types only (torch.__version__ is a str subclass that weights_only rejects).
    metadata = json.loads(json.dumps(metadata, default=str))
    torch.save({"E": E.cpu(), "C": C.cpu(), "y": y.cpu(), "x": x.cpu(), "metadata": metadata},
               settings.out / TRAINED_LM_FILE)
    (settings.out / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n", "utf-8")
    print(f"wrote {settings.out / TRAINED_LM_FILE} and {METADATA_FILE}", flush=True)
    return model


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    """Settings of the command line: the defaults, or QUICK's with ``--quick``; flags win."""
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
    values.update({k: v for k, v in vars(args).items() if k != "quick" and v is not None})
    if args.minutes is not None and args.steps is None:
        values["steps"] = None  # an explicit time budget beats --quick's step count
    settings = Settings(**values)
    if (settings.steps is not None and settings.steps < 1) or settings.minutes <= 0:
        parser.error("--steps must be ≥ 1 and --minutes > 0")
    return settings


if __name__ == "__main__":
    build(parse_args(), sys.argv[1:])
