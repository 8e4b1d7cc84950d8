"""Suite ``retrieval``: sentence-transformers training steps with its in-batch-negatives losses
and with fusedloss's, side by side (definitions: benchmarks/README.md)."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from typing import Any

import torch

from benchmarks import common
from benchmarks.common import column
from benchmarks.suites import Suite

METHODS = ("st-plain", "fused-plain", "st-cached", "fused-cached")
BATCHES, QUICK_BATCHES = (1024, 8192, 65536), (16, 32)


def make_model(layers: int, width: int, device, seed: int, attention: str = "sdpa"):
    """A SentenceTransformer (BERT of ``layers`` × ``width``, mean pooling, normalize) from a
    config, its tokenizer a made-up vocabulary saved to a temporary directory."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    path = tempfile.mkdtemp(prefix="fusedloss-bert-")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(1000)]
    with open(os.path.join(path, "vocab.txt"), "w") as f:
        f.write("\n".join(words))
    BertTokenizerFast(vocab_file=os.path.join(path, "vocab.txt")).save_pretrained(path)
    torch.manual_seed(seed)
    BertModel(BertConfig(vocab_size=len(words), hidden_size=width, num_hidden_layers=layers,
                         num_attention_heads=max(1, width // 64),
                         intermediate_size=4 * width)).save_pretrained(path)
    encoder = Transformer(path, model_kwargs=dict(attn_implementation=attention))
    return SentenceTransformer(modules=[encoder, Pooling(width, "mean"), Normalize()],
                               device=str(device))


def make_loss(method: str, model, mini_batch_size: int):
    from sentence_transformers import losses

    from fusedloss.integrations import sentence_transformers as fused

    plain, cached = ((fused.FusedMultipleNegativesRankingLoss,
                      fused.FusedCachedMultipleNegativesRankingLoss) if method.startswith("fused")
                     else (losses.MultipleNegativesRankingLoss,
                           losses.CachedMultipleNegativesRankingLoss))
    if method.endswith("plain"):
        return plain(model, scale=20.0)
    return cached(model, scale=20.0, mini_batch_size=mini_batch_size)


def batch_features(batch: int, tokens: int, device, step: int) -> list[dict[str, torch.Tensor]]:
    """(anchor, positive) features of random token ids (ids ≥ 5: no special tokens)."""
    g = torch.Generator().manual_seed(step)
    return [{"input_ids": torch.randint(5, 1005, (batch, tokens), generator=g).to(device),
             "attention_mask": torch.ones(batch, tokens, dtype=torch.long, device=device),
             "token_type_ids": torch.zeros(batch, tokens, dtype=torch.long, device=device)}
            for _ in range(2)]


def run_steps(method: str, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up plus ``args.steps`` steps: their losses, median ms and peak MiB."""
    model = make_model(args.layers, args.width, args.device, args.seed, args.attention)
    model.train()
    loss_fn = make_loss(method, model, args.mini_batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses, times = [], []
    common.release_memory(args.device)
    if common.uses_cuda(args.device):
        torch.cuda.reset_peak_memory_stats(args.device)
    for step in range(args.steps + 1):
        features = batch_features(batch, args.tokens, args.device, step)
        torch.manual_seed(args.seed + step)  # dropout: the same masks for every method

        def train_step(features=features):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(features, None)
            loss.backward()
            optimizer.step()
            return loss.detach()
        ms, loss = common.timed(train_step, torch.device(args.device))
        losses.append(float(loss))
        if step:  # the first step compiles and allocates
            times.append(ms)
    mib = (torch.cuda.max_memory_allocated(args.device) / common.MIB
           if common.uses_cuda(args.device) else None)
    return dict(method=method, batch=batch, ms=statistics.median(times), mib=mib, losses=losses)


def measure(method: str, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    try:
        row = run_steps(method, batch, args)
    except Exception as error:  # out of memory: a hole in the table, the run goes on
        row = dict(method=method, batch=batch, error=common.describe_error(error))
    common.release_memory(args.device)
    print(method, batch, row.get("error") or f"{row['ms']:.1f} ms, "
          f"{common.format_mib(row['mib'])} MiB", flush=True)
    return row


def largest_batch(method: str, args: argparse.Namespace) -> int | None:
    """The largest batch, doubling from ``args.batches[0]``, one step of ``method`` completes."""
    batch, largest = args.batches[0], None
    quick = argparse.Namespace(**{**vars(args), "steps": 1})
    while batch <= args.largest_cap:
        if "error" in measure(method, batch, quick):
            break
        largest, batch = batch, 2 * batch
    return largest


def run(args: argparse.Namespace) -> int:
    args.device = common.pick_device(args.device)
    env = common.collect_environment(args.device)
    if args.quick:
        args.batches, args.layers, args.width, args.tokens = QUICK_BATCHES, 1, 32, 8
        args.mini_batch, args.steps = 8, 2
    rows = [measure(m, b, args) for b in args.batches for m in args.methods]
    # each fused loss against sentence-transformers' same loss (plain or cached: their dropout
    # masks differ between the two, the same seed giving the same masks within each)
    losses = {(r["batch"], r["method"]): r["losses"] for r in rows if "losses" in r}
    for r in rows:
        ref = losses.get((r["batch"], r["method"].replace("fused", "st")))
        if "losses" in r and ref is not None:
            r["loss_gap"] = max(abs(a - b) for a, b in zip(r["losses"], ref, strict=True))
    if args.plot:
        panels = [(f"global batch {b}", "step", "loss",
                   [(m, list(range(len(v))), v) for (b2, m), v in losses.items() if b2 == b])
                  for b in args.batches]
        path = common.results_path(args.out, "retrieval", env, args.tag, "_losses.png")
        common.save_plot(path, panels, columns=len(panels), size=(4, 3), marker="o")
    largest = ({m: largest_batch(m, args) for m in ("st-plain", "fused-plain")}
               if args.largest else {})
    columns = [column("batch", "batch"), column("method", "method"),
               column("step ms", "ms", common.format_ms),
               column("peak MiB", "mib", common.format_mib),
               column("max |loss − ST's|", "loss_gap", common.format_error),
               ("status", lambda r: r.get("error", "ok"))]
    tables = common.table(columns, rows)
    lines = [f"BERT {args.layers} × {args.width} from a config ({args.attention} attention), "
             f"{args.tokens} tokens per text, (anchor, positive) pairs, scale 20, cached "
             f"mini-batches of {args.mini_batch}; median of {args.steps} steps (forward, "
             "backward, AdamW) after one warm-up step. See benchmarks/README.md.", "", tables]
    if largest:
        lines += ["", "Largest batch one plain step completes (doubling from "
                  f"{args.batches[0]}, up to {args.largest_cap}): " + ", ".join(
                      f"{m} {b}" for m, b in largest.items())]
    settings = dict(layers=args.layers, width=args.width, attention=args.attention,
                    tokens=args.tokens, mini_batch=args.mini_batch)
    common.write_report(args.out, "retrieval", args.tag, env,
                        "sentence-transformers training steps", common.environment_rows(env, {}),
                        [*lines, ""], dict(environment=env, rows=rows, largest=largest,
                                           settings=settings), tables,
                        notes=[common.QUICK_NOTE] if args.quick else [])
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    common.add_list(parser, "--methods", METHODS, METHODS)
    add("--batches", type=common.int_list, default=list(BATCHES),
        help="global batches (default 1024,8192,65536)")
    add("--layers", type=int, default=4)
    add("--width", type=int, default=384)
    add("--attention", choices=("sdpa", "eager"), default="sdpa",
        help="the encoder's attention (sdpa's kernels refuse batches > 65535)")
    add("--tokens", type=int, default=32, help="tokens per text (default 32)")
    add("--mini-batch", type=int, default=512,
        help="the cached losses' mini_batch_size (default 512)")
    add("--steps", type=int, default=3, help="timed steps (default 3)")
    add("--largest", action="store_true",
        help="also the largest batch each plain loss completes a step at")
    add("--largest-cap", type=int, default=1 << 20)
    add("--plot", action="store_true",
        help="also <results>_losses.png: each method's loss per step")
    common.add_common_arguments(parser, "a tiny encoder and batches 16, 32", dtype=False)


SUITE = Suite("retrieval", "sentence-transformers' in-batch-negatives losses against fusedloss's "
              "in training steps of a small encoder", add_arguments, run)
