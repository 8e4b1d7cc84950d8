"""Suite ``train``: one training step (forward, backward, AdamW) of Hugging Face causal LMs with
random weights from their published configs, per loss method, and the largest batch that fits."""

from __future__ import annotations

import argparse
import importlib
import inspect
import statistics
import types
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from benchmarks import common
from benchmarks.common import OK, column, count_text, format_ms, format_ratio, loss_text
from benchmarks.suites import Suite

NAME = "train"
LABELS = {
    "hf": "HF eager", "hf-compile": "HF torch.compile",
    "liger": "liger-kernel (all kernels)", "liger-flce": "liger-kernel (loss only)",
    "cce": "cut-cross-entropy (loss via a generic forward)",
    "cce-exact": "cut-cross-entropy, filter_eps=None (loss via a generic forward)",
    "fusedloss": "fusedloss", "fusedloss-compile": "fusedloss torch.compile",
}
PEERS = {"liger": "liger-kernel", "liger-flce": "liger-kernel", "cce": "cut-cross-entropy",
         "cce-exact": "cut-cross-entropy"}
INSTALL_HINT = "pip install cut-cross-entropy==25.1.1 liger-kernel==0.8.5 --no-deps"
MAX_BATCH_LIMIT, QUICK_MAX_BATCH_LIMIT = 256, 8  # the largest batch --find-max-batch tries
LR = 1e-4
FIRST_LOSS_TOLERANCE, LAST_LOSS_TOLERANCE = 1e-2, 3e-2  # × max(1, |HF eager's loss|)


# The published config.json's architecture fields, copied exactly (model_type added).
MODEL_CONFIGS = {
    "llama3.2-1b": dict(  # meta-llama/Llama-3.2-1B
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        attention_bias=False, mlp_bias=False, tie_word_embeddings=True, initializer_range=0.02),
    "gemma2-2b": dict(  # google/gemma-2-2b
        model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
        num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192, rms_norm_eps=1e-6,
        rope_theta=10000.0, query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, attention_bias=False,
        tie_word_embeddings=True, initializer_range=0.02),
    "qwen2.5-1.5b": dict(  # Qwen/Qwen2.5-1.5B
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, hidden_act="silu",
        max_position_embeddings=131072, max_window_layers=28, rms_norm_eps=1e-6,
        rope_theta=1000000.0, use_sliding_window=False, sliding_window=131072,
        tie_word_embeddings=True, initializer_range=0.02),
}
# --quick: every model shrunk to these sizes (other fields, e.g. Gemma 2's softcaps, stay).
QUICK_SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   query_pre_attn_scalar=16, max_window_layers=2)


def build_model(name: str, args, device: torch.device | str) -> Any:
    """Random weights from ``--seed``, bf16, training mode, non-reentrant checkpointing; the
    config shrunk by ``--quick``, its depth replaced by ``--layers``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(MODEL_CONFIGS[name], use_cache=False)
    if args.quick:
        kwargs.update({k: v for k, v in QUICK_SIZES.items() if k in kwargs or k == "head_dim"})
    if args.layers is not None:
        kwargs["num_hidden_layers"] = args.layers
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def patch_liger(method: str, model: Any) -> str:
    """``liger``: liger's patch with its loss on; ``liger-flce``: every other kernel off too."""
    name = f"apply_liger_kernel_to_{model.config.model_type}"
    apply = getattr(importlib.import_module("liger_kernel.transformers"), name)
    flags = {"cross_entropy": False}
    if method == "liger-flce":
        flags = {key: False for key, parameter in inspect.signature(apply).parameters.items()
                 if isinstance(parameter.default, bool)}
    flags["fused_linear_cross_entropy"] = True
    apply(**flags, model=model)
    text = ", ".join(f"{key}={value}" for key, value in flags.items())
    return f"liger_kernel.transformers.{name}({text}, model=model)"


def patch_cce(model: Any, exact: bool = False) -> str:
    """A forward computing cut-cross-entropy's loss in training (its cce_patch needs HF 4.x)."""
    from cut_cross_entropy import linear_cross_entropy
    from transformers.modeling_outputs import CausalLMOutputWithPast

    original = type(model).forward
    softcap = getattr(model.config, "final_logit_softcapping", None)
    extra = {"filter_eps": None} if exact else {}

    def forward(self, input_ids=None, labels=None, **kwargs):
        if labels is None or not self.training:
            return original(self, input_ids=input_ids, labels=labels, **kwargs)
        hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
        loss = linear_cross_entropy(hidden, self.lm_head.weight, labels, softcap=softcap,
                                    shift=True, **extra)
        return CausalLMOutputWithPast(loss=loss)

    model.forward = types.MethodType(forward, model)
    return ("patch_cce(model): cut_cross_entropy.linear_cross_entropy(hidden, lm_head.weight, "
            f"labels, softcap={softcap}, shift=True{', filter_eps=None' if exact else ''})")


def prepare_method(method: str, model: Any, cuda: bool) -> tuple[Any, str]:
    """Patches (and compiles) ``model`` for ``method``: what to call, and the call's text."""
    if method in ("cce", "cce-exact"):
        return model, patch_cce(model, exact=method == "cce-exact")
    if method in PEERS:
        return model, patch_liger(method, model)
    call = "model"
    if method.startswith("fusedloss"):
        from fusedloss.integrations.transformers import apply_fusedloss

        options = {} if cuda else {"backend": "torch"}  # no Triton kernels on the CPU
        apply_fusedloss(model, **options)
        call = "apply_fusedloss(model)" if cuda else "apply_fusedloss(model, backend='torch')"
    if method.endswith("-compile"):
        torch._dynamo.reset()
        return torch.compile(model), f"torch.compile({call})"
    return model, call


def _point(row: common.Row, batch: int | None) -> dict[str, Any]:
    """The sweep point of a method's row at ``batch`` ({} if not measured)."""
    return next((p for p in row["sweep"] if p["batch"] == batch), {})


def measure(step, vocab: int, batch: int, args, device: torch.device, first: int,
            warmup: int, steps: int) -> tuple[dict[str, Any], list[float]]:
    """Trains ``warmup + steps`` batches (step numbers from ``first``): a sweep point, losses."""
    cuda = common.uses_cuda(device)
    batches = []
    for i in range(warmup + steps):  # uniform token ids from the seed, the same for every method
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + first + i)
        batches.append(torch.randint(0, vocab, (batch, args.seq), generator=generator).to(device))
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    timed = [common.timed(step, device, ids) for ids in batches]  # (ms, loss) per step
    times, losses = [ms for ms, _ in timed], [float(loss) for _, loss in timed]
    ms = statistics.median(times[warmup:])
    peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    return dict(batch=batch, tokens=batch * args.seq, status=OK, ms=ms, step_ms=times[warmup:],
                tokens_per_s=batch * args.seq / (ms * 1e-3), peak_gib=peak_gib), losses


def find_max_batch(fits, start: int, limit: int) -> tuple[int | None, bool]:
    """(Largest batch ≤ ``limit`` that ``fits``: doubling then bisecting, whether limited)."""
    low, batch = 0, max(1, min(start, limit))
    while fits(batch):
        if batch >= limit:
            return batch, True
        low, batch = batch, min(batch * 2, limit)
    high = batch
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return (low or None), False


def measure_method(row: common.Row, args, device: torch.device, log) -> None:
    """Builds, patches and trains the model at the fixed batch, then at each batch searched."""
    cuda = common.uses_cuda(device)
    model = build_model(row["model"], args, device)
    call, row["call"] = prepare_method(row["method"], model, cuda)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=cuda)

    def step(ids: Any) -> Any:
        loss = call(input_ids=ids, labels=ids, use_cache=False).loss  # logits (if any) freed
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    vocab = model.config.vocab_size
    point, row["losses"] = measure(step, vocab, args.batch, args, device, 0, args.warmup_steps,
                                   args.steps)
    row["ms"], row["sweep"] = point["ms"], [point]
    tried = {args.batch: point}

    def fits(batch: int) -> bool:  # 1 warm-up step (a recompile) and --sweep-steps timed
        if batch not in tried:  # out of memory (or a failure) ends the growth
            failed = {"batch": batch, "tokens": batch * args.seq}
            ok, point = common.stage(failed, lambda: measure(
                step, vocab, batch, args, device, 10_000, 1, args.sweep_steps)[0], device)
            tried[batch] = point if ok else failed
            optimizer.zero_grad(set_to_none=True)
            common.release_memory(device)
            log(f"    batch {batch}: {tried[batch]['status']}")
        return tried[batch]["status"] == OK

    if args.find_max_batch:
        limit = QUICK_MAX_BATCH_LIMIT if args.quick else MAX_BATCH_LIMIT
        row["max_batch"], row["max_batch_limited"] = find_max_batch(fits, args.batch, limit)
        row["sweep"] = sorted(tried.values(), key=lambda p: p["batch"])


def run_method(name: str, method: str, args, device: torch.device, log=print) -> common.Row:
    """One method on one model: every loss at the fixed batch, |last loss − HF eager's|, the
    largest batch (and whether at the limit), a sweep point per batch; failures as its status."""
    version = common.package_version(PEERS[method]) if method in PEERS else None
    label = LABELS[method].replace(" (", f" {version} (", 1) if version else LABELS[method]
    result = common.new_row(method, label, model=name, method=method, batch=args.batch,
                            losses=[], loss_error=None, max_batch=None, max_batch_limited=False,
                            sweep=[])
    if method in PEERS and not version:
        result["status"], result["note"] = common.NOT_INSTALLED, INSTALL_HINT
    elif not common.uses_cuda(device) and (method in PEERS or method.endswith("-compile")):
        result["status"] = common.UNAVAILABLE
        result["note"] = "needs CUDA (Triton kernels, compile)"
    else:
        model_type = MODEL_CONFIGS[name]["model_type"]
        family = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        # liger's patches of the modeling module's globals are undone on leaving
        with mock.patch.dict(vars(family)), common.failures_recorded(result, device):
            measure_method(result, args, device, log)
        torch._dynamo.reset()
        common.release_memory(device)  # what a failure's traceback held is free only now
    return result


def check_losses(results: list[common.Row]) -> None:
    """Marks wrong a method whose first or last loss is off HF eager's (else the first's)."""
    measured = [r for r in results if common.measured(r)]
    reference = next((r for r in measured if r["method"] == "hf"), measured and measured[0])
    for result in measured:
        problems = []
        for step, index, tolerance in (("first", 0, FIRST_LOSS_TOLERANCE),
                                       ("last", -1, LAST_LOSS_TOLERANCE)):  # error: the last's
            result["loss_error"], found = common.check_loss(
                result["losses"][index], reference["losses"][index], tolerance)
            problems += [f"{step}-step {problem} ({reference['label']})" for problem in found]
        common.mark_wrong(result, problems)


COLUMNS = [  # items: run_method()'s rows; the terminal table leaves the note out
    column("model", "model"), column("method", "label"), column("status", "status"),
    column("batch", "batch"), column("ms/step", "ms", format_ms),
    ("tokens/s", lambda r: count_text(_point(r, r["batch"]).get("tokens_per_s"))),
    ("peak GiB", lambda r: format_ratio(_point(r, r["batch"]).get("peak_gib"))),
    ("first loss", lambda r: loss_text(r["losses"][0] if r["losses"] else None)),
    ("last loss", lambda r: loss_text(r["losses"][-1] if r["losses"] else None)),
    column("|Δ last loss|", "loss_error", common.format_error),
    ("max batch (tokens)", lambda r: "—" if r["max_batch"] is None else
     f"{r['max_batch']}{'+' if r['max_batch_limited'] else ''} "
     f"({_point(r, r['max_batch'])['tokens']})"),
    ("tokens/s at max", lambda r: count_text(_point(r, r["max_batch"]).get("tokens_per_s"))),
    ("peak GiB at max", lambda r: format_ratio(_point(r, r["max_batch"]).get("peak_gib"))),
    column("note", "note"),
]
SWEEP_COLUMNS = [  # items: (run_method()'s row, sweep point)
    ("model", lambda i: i[0]["model"]), ("method", lambda i: i[0]["label"]),
    ("batch", lambda i: i[1]["batch"]), ("tokens", lambda i: i[1]["tokens"]),
    ("status", lambda i: i[1]["status"]), ("ms", lambda i: format_ms(i[1].get("ms"))),
    ("tokens/s", lambda i: count_text(i[1].get("tokens_per_s"))),
    ("peak GiB", lambda i: format_ratio(i[1].get("peak_gib"))),
]


def plot_results(path: Path, results: list[common.Row]) -> Path | None:
    """Peak memory and tokens/s against tokens per step, one line per method, per model."""
    panels = []
    for model in dict.fromkeys(r["model"] for r in results):
        ok = [(r["label"], [p for p in r["sweep"] if p["status"] == OK]) for r in results
              if r["model"] == model]
        for title, key, unit in (("peak memory", "peak_gib", "peak GiB"),
                                 ("throughput", "tokens_per_s", "tokens/s")):
            lines = [(label, [p["tokens"] for p in points], [p[key] for p in points])
                     for label, points in ok if any(p[key] is not None for p in points)]
            panels.append((f"{model}: {title}", "tokens per step", unit, lines))
    return common.save_plot(path, panels, columns=2, size=(6, 4), marker="o")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    common.add_list(parser, "--models", MODEL_CONFIGS, MODEL_CONFIGS)
    common.add_list(parser, "--methods", LABELS, LABELS)
    add("--seq", type=int, default=None, help="tokens per sequence (4096; 32 with --quick)")
    add("--batch", type=int, default=2, help="the fixed batch (default 2)")
    add("--steps", type=int, default=5, help="timed steps (default 5)")
    add("--warmup-steps", type=int, default=2, help="untimed first steps (default 2)")
    add("--layers", type=int, default=None, help="decoder layers instead of the model's")
    add("--find-max-batch", action="store_true", help="also double the batch until out of "
        f"memory or {MAX_BATCH_LIMIT} ({QUICK_MAX_BATCH_LIMIT} with --quick), then bisect")
    add("--sweep-steps", type=int, default=2, help="timed steps per batch tried (default 2)")
    common.add_common_arguments(parser, "tiny configs, seq 32: a CPU smoke test in seconds (hf "
                                "and fusedloss; the compiled methods and the peers need CUDA)",
                                dtype=False, timing=False)


def run(args: argparse.Namespace, log=print) -> int:
    device = common.run_device(args, NAME, log)
    if device is None:
        return 2
    args.seq = args.seq or (32 if args.quick else 4096)
    settings = {key: value for key, value in vars(args).items() if key not in ("out", "device")}
    settings["max_batch_limit"] = QUICK_MAX_BATCH_LIMIT if args.quick else MAX_BATCH_LIMIT
    notes = [common.QUICK_NOTE] if args.quick else []
    env = common.collect_environment(device)
    results, calls = [], {}
    for name in args.models:
        log(f"{name}, seq {args.seq}, batch {args.batch}:")
        model_results = [run_method(name, method, args, device, log) for method in args.methods]
        check_losses(model_results)
        for result in model_results:
            log(f"  {result['label']}: " + common.progress_line(result, lambda r: (
                f"{format_ms(r['ms'])} ms/step, loss {loss_text(r['losses'][-1])}")))
            common.note_problem(notes, name, result)
            call, method = result["call"], result["method"]
            if call and calls.setdefault(method, call) != call:
                calls[f"{method} ({name})"] = call  # liger's function per family
        results += model_results
    plot = plot_results(common.results_path(args.out, NAME, env, args.tag, ".png"), results)
    notes.append(f"plot: {plot.name}" if plot else "no plot: matplotlib not installed")
    payload = {"suite": NAME, "environment": env, "settings": settings, "calls": calls,
               "transformers": common.package_version("transformers"), "notes": notes,
               "results": results}
    body = common.section("Results", "Definitions: benchmarks/README.md, the `train` suite.",
                          COLUMNS, results)
    if any(len(r["sweep"]) > 1 for r in results):
        body += common.section("Batches tried", "", SWEEP_COLUMNS,
                               [(r, point) for r in results for point in r["sweep"]])
    a = args
    rows = [
        *common.environment_rows(env, {p: common.package_version(p) for p in PEERS.values()}),
        ("transformers", common.package_version("transformers")),
        ("settings", f"seq {a.seq}, batch {a.batch}, {a.warmup_steps} warm-up + {a.steps} timed "
         f"steps, seed {a.seed}, AdamW lr {LR}, layers {a.layers or 'all'}"
         f"{', --quick' if a.quick else ''}"),
        ("max-batch search", f"limit {settings['max_batch_limit']}, 1 warm-up + {a.sweep_steps} "
         "timed steps per batch" if a.find_max_batch else "off")]
    common.write_report(args.out, NAME, args.tag, env, "End-to-end training step", rows, body,
                        payload, common.table(COLUMNS[:-1], results, text=True), calls=calls,
                        notes=notes, log=log)
    return 0


SUITE = Suite(NAME, "a Hugging Face training step (Llama-3.2-1B, Gemma-2-2B, Qwen2.5-1.5B) per "
              "loss method", add_arguments, run)
