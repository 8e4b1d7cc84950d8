"""Suite ``train``: one training step (forward, backward, AdamW) of real causal LMs per loss method.

Models: published Hugging Face configs with random weights (no download), bf16, gradient
checkpointing, random tokens from the seed. Methods: ``hf`` / ``hf-compile`` (unpatched, eager or
``torch.compile``), ``liger`` (liger's default kernels + fused linear CE), ``liger-flce`` (only its
loss), ``cce`` / ``cce-exact`` (:func:`patch_cce`; exact: ``filter_eps=None``), ``fusedloss`` /
``fusedloss-compile`` (``apply_fusedloss``). Same batches for all; losses checked against hf's.
Figures are defined in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import inspect
import statistics
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks import common
from benchmarks.common import (
    NOT_INSTALLED,
    OK,
    UNAVAILABLE,
    count_text,
    gib_text,
    loss_text,
    save_plot,
    table,
    timed,
)
from benchmarks.suites import Suite

NAME = RESULTS_PREFIX = "train"
GIB = float(1 << 30)

HF, HF_COMPILE, LIGER, LIGER_FLCE, CCE = "hf", "hf-compile", "liger", "liger-flce", "cce"
CCE_EXACT = "cce-exact"
FUSEDLOSS, FUSEDLOSS_COMPILE = "fusedloss", "fusedloss-compile"
METHODS = (HF, HF_COMPILE, LIGER, LIGER_FLCE, CCE, CCE_EXACT, FUSEDLOSS, FUSEDLOSS_COMPILE)
COMPILED = (HF_COMPILE, FUSEDLOSS_COMPILE)
OURS = (FUSEDLOSS, FUSEDLOSS_COMPILE)
LABELS = {
    HF: "HF eager",
    HF_COMPILE: "HF torch.compile",
    LIGER: "liger-kernel (all kernels)",
    LIGER_FLCE: "liger-kernel (loss only)",
    CCE: "cut-cross-entropy (loss via a generic forward)",
    CCE_EXACT: "cut-cross-entropy, filter_eps=None (loss via a generic forward)",
    FUSEDLOSS: "fusedloss",
    FUSEDLOSS_COMPILE: "fusedloss torch.compile",
}
PEERS = {LIGER: "liger-kernel", LIGER_FLCE: "liger-kernel", CCE: "cut-cross-entropy",
         CCE_EXACT: "cut-cross-entropy"}
PEER_MODULES = {method: name.replace("-", "_") for method, name in PEERS.items()}
INSTALL_HINT = "pip install cut-cross-entropy==25.1.1 liger-kernel==0.8.5 --no-deps"

DEFAULT_SEQ, DEFAULT_BATCH, DEFAULT_STEPS, DEFAULT_WARMUP = 4096, 2, 5, 2
QUICK_SEQ, QUICK_BATCH, QUICK_STEPS, QUICK_WARMUP = 32, 2, 2, 1
MAX_BATCH_LIMIT, QUICK_MAX_BATCH_LIMIT = 256, 8  # largest batch --find-max-batch tries
LR = 1e-4  # AdamW
# Loss tolerances against hf's (× max(1, |ref|)): first step, and last (after AdamW updates).
FIRST_LOSS_TOLERANCE = 1e-2
LAST_LOSS_TOLERANCE = 3e-2


# ----------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelSpec:
    name: str  # command-line key
    title: str
    model_type: str  # transformers model_type
    liger_family: str  # apply_liger_kernel_to_<liger_family>
    config: dict[str, Any]  # the published config.json's architecture fields, copied exactly
    source: str


MODEL_SPECS: dict[str, ModelSpec] = {
    "llama3.2-1b": ModelSpec(
        "llama3.2-1b", "Llama-3.2-1B", "llama", "llama",
        dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64, hidden_act="silu",
             max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
             rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                           "original_max_position_embeddings": 8192, "rope_type": "llama3"},
             attention_bias=False, mlp_bias=False, tie_word_embeddings=True,
             initializer_range=0.02),
        "meta-llama/Llama-3.2-1B config.json"),
    "gemma2-2b": ModelSpec(
        "gemma2-2b", "Gemma-2-2B", "gemma2", "gemma2",
        dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
             num_attention_heads=8, num_key_value_heads=4, head_dim=256,
             hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
             rms_norm_eps=1e-6, rope_theta=10000.0, query_pre_attn_scalar=256,
             sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
             attention_bias=False, tie_word_embeddings=True, initializer_range=0.02),
        "google/gemma-2-2b config.json"),
    "qwen2.5-1.5b": ModelSpec(
        "qwen2.5-1.5b", "Qwen2.5-1.5B", "qwen2", "qwen2",
        dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
             num_attention_heads=12, num_key_value_heads=2, hidden_act="silu",
             max_position_embeddings=131072, max_window_layers=28, rms_norm_eps=1e-6,
             rope_theta=1000000.0, use_sliding_window=False, sliding_window=131072,
             tie_word_embeddings=True, initializer_range=0.02),
        "Qwen/Qwen2.5-1.5B config.json"),
}

# --quick: every model shrunk to these sizes (other fields, e.g. Gemma 2's softcaps, stay).
QUICK_SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   query_pre_attn_scalar=16, max_window_layers=2)


def config_kwargs(spec: ModelSpec, quick: bool, layers: int | None = None) -> dict[str, Any]:
    """``AutoConfig.for_model`` keywords; ``layers`` replaces the depth only."""
    kwargs = dict(spec.config)
    if quick:
        kwargs.update({k: v for k, v in QUICK_SIZES.items() if k in kwargs or k == "head_dim"})
    if layers is not None:
        kwargs["num_hidden_layers"] = layers
    kwargs["use_cache"] = False
    return kwargs


def build_config(spec: ModelSpec, quick: bool, layers: int | None = None) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(spec.model_type, **config_kwargs(spec, quick, layers))


def build_model(spec: ModelSpec, quick: bool, seed: int, device: torch.device,
                layers: int | None = None) -> Any:
    """Random weights from ``seed``, bf16, training mode, non-reentrant checkpointing."""
    from transformers import AutoModelForCausalLM

    config = build_config(spec, quick, layers)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def parameter_count(model: Any) -> int:
    """Parameters, tied ones once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def make_batch(vocab_size: int, batch: int, seq: int, seed: int, step: int, device) -> Any:
    """Token ids (batch, seq) of step ``step``, uniform, from the seed."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, vocab_size, (batch, seq), generator=generator).to(device)


def _model_facts(spec: ModelSpec, quick: bool, layers: int | None = None) -> dict[str, Any]:
    """Parameter count and attention implementation, from a model on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_config(spec, quick, layers),
                                                 dtype=torch.bfloat16)
    facts = {"parameters": parameter_count(model),
             "attn_implementation": str(model.config._attn_implementation)}
    del model
    gc.collect()
    return facts


# ----------------------------------------------------------------------------- methods


class Unavailable(Exception):
    """The method cannot run here (package missing, no CUDA); the message says why."""


@contextlib.contextmanager
def module_patches_undone(module: Any) -> Iterator[None]:
    """Undoes on exit what a patch changed in ``module``'s globals and its classes' attributes
    (liger patches the modeling module and classes): later methods see the original."""
    saved = dict(vars(module))
    classes = {name: dict(vars(obj)) for name, obj in saved.items()
               if isinstance(obj, type) and obj.__module__ == module.__name__}
    try:
        yield
    finally:
        for name, attributes in classes.items():
            cls = saved[name]
            for key in [k for k in vars(cls) if k not in attributes and not _dunder(k)]:
                delattr(cls, key)
            for key, value in attributes.items():
                if not _dunder(key) and vars(cls).get(key) is not value:
                    setattr(cls, key, value)
        for key in [k for k in vars(module) if k not in saved]:
            delattr(module, key)
        for key, value in saved.items():
            if vars(module).get(key) is not value:
                setattr(module, key, value)


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _import_peer(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise Unavailable(f"{module} not importable: {error} ({INSTALL_HINT})") from error


def patch_liger(method: str, model: Any, spec: ModelSpec) -> tuple[Any, str]:
    """``apply_liger_kernel_to_<family>(..., model=model)``; returns the model and the call.
    ``liger``: loss flags only (other kernels keep their defaults); ``liger-flce``: every other
    boolean flag of the signature False."""
    module = _import_peer("liger_kernel.transformers")
    name = f"apply_liger_kernel_to_{spec.liger_family}"
    apply = getattr(module, name, None)
    if apply is None:
        raise Unavailable(f"liger_kernel.transformers has no {name}")
    accepted = inspect.signature(apply).parameters
    for required in ("fused_linear_cross_entropy", "model"):
        if required not in accepted:
            raise Unavailable(f"{name} has no {required} argument")
    if method == LIGER_FLCE:
        flags = {key: False for key, parameter in accepted.items()
                 if isinstance(parameter.default, bool)}
    else:
        flags = {"cross_entropy": False} if "cross_entropy" in accepted else {}
    flags["fused_linear_cross_entropy"] = True
    apply(**flags, model=model)
    text = ", ".join(f"{key}={value}" for key, value in flags.items())
    return model, f"liger_kernel.transformers.{name}({text}, model=model)"


def patch_cce(model: Any, exact: bool = False) -> tuple[Any, str]:
    """Replaces the instance's forward: in training with labels, the base model then
    ``cut_cross_entropy.linear_cross_entropy(hidden, lm_head.weight, ...)`` with HF's loss
    conventions (shift or ``shift_labels``, ignore_index, ``num_items_in_batch``; Gemma 2's final
    softcap), ``logits=None``; otherwise the class's forward. ``exact``: ``filter_eps=None``.
    Not cce's own ``cce_patch``, which does not import under transformers 5."""
    module = _import_peer("cut_cross_entropy")
    linear_cross_entropy = getattr(module, "linear_cross_entropy", None)
    if linear_cross_entropy is None:
        raise Unavailable("cut_cross_entropy has no linear_cross_entropy")
    if getattr(model.lm_head, "bias", None) is not None:
        raise Unavailable("lm_head has a bias, which this forward does not pass")
    from transformers.modeling_outputs import CausalLMOutputWithPast

    original = type(model).forward
    softcap = getattr(model.config, "final_logit_softcapping", None)
    extra: dict[str, Any] = {}
    if exact:
        if "filter_eps" not in inspect.signature(linear_cross_entropy).parameters:
            raise Unavailable("this cut_cross_entropy has no filter_eps argument")
        extra["filter_eps"] = None

    def forward(self, input_ids=None, labels=None, logits_to_keep=0, **kwargs):
        if labels is None or not self.training or not isinstance(logits_to_keep, int) \
                or logits_to_keep != 0:
            return original(self, input_ids=input_ids, labels=labels,
                            logits_to_keep=logits_to_keep, **kwargs)
        num_items = kwargs.get("num_items_in_batch")
        shift_labels = kwargs.get("shift_labels")
        outputs = self.model(input_ids=input_ids, **kwargs)
        hidden = outputs.last_hidden_state
        targets = labels if shift_labels is None else shift_labels
        loss = linear_cross_entropy(
            hidden, self.lm_head.weight, targets.to(hidden.device),
            ignore_index=kwargs.get("ignore_index", -100), softcap=softcap,
            reduction="mean" if num_items is None else "sum", shift=shift_labels is None,
            **extra)
        if num_items is not None:
            loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
        return CausalLMOutputWithPast(
            loss=loss, logits=None, past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states, attentions=outputs.attentions)

    model.forward = types.MethodType(forward, model)
    filter_text = ", filter_eps=None" if exact else ""
    return model, (f"patch_cce(model): cut_cross_entropy.linear_cross_entropy(hidden, "
                   f"lm_head.weight, labels, shift=True, reduction='mean', softcap={softcap}"
                   f"{filter_text})")


def prepare_method(method: str, model: Any, spec: ModelSpec,
                   device: torch.device) -> tuple[Callable[..., Any], str]:
    """Patches/compiles ``model`` for ``method``; returns what to call and the call's text."""
    on_cuda = common.uses_cuda(device)
    if method in PEERS:
        if not on_cuda:  # their Triton kernels do not run in Triton's interpreter either
            _import_peer(PEER_MODULES[method])
            raise Unavailable("needs CUDA (Triton kernels)")
        if method in (CCE, CCE_EXACT):
            return patch_cce(model, exact=method == CCE_EXACT)
        return patch_liger(method, model, spec)
    call = "model"
    if method in OURS:
        from fusedloss.integrations.transformers import apply_fusedloss

        options = {} if on_cuda else {"backend": "torch"}
        apply_fusedloss(model, **options)
        call = "apply_fusedloss(model" + "".join(f", {k}={v!r}" for k, v in options.items()) + ")"
    if method in COMPILED:
        import torch._dynamo as dynamo

        dynamo.reset()
        return torch.compile(model), f"torch.compile({call})"
    return model, call


# ----------------------------------------------------------------------------- measurement


@dataclass
class MethodResult:
    model: str
    method: str
    label: str
    status: str = OK
    note: str = ""
    call: str = ""
    batch: int = 0
    seq: int = 0
    tokens_per_step: int = 0
    ms: float | None = None  # median step time at the fixed batch
    step_ms: list[float] = field(default_factory=list)
    tokens_per_s: float | None = None
    peak_gib: float | None = None  # max_memory_allocated over the fixed-batch steps
    static_gib: float | None = None  # memory_allocated after the model and optimizer are built
    losses: list[float] = field(default_factory=list)
    loss_error: float | None = None  # |last loss − reference's|
    first_loss_error: float | None = None
    max_batch: int | None = None
    max_batch_limited: bool = False  # the search stopped at the batch limit, not at OOM
    max_batch_tokens_per_s: float | None = None
    max_batch_peak_gib: float | None = None
    # every batch tried: dicts of batch, tokens, status, ms, tokens_per_s, peak_gib, note
    sweep: list[dict[str, Any]] = field(default_factory=list)

    @property
    def measured(self) -> bool:
        return self.status in common.MEASURED and self.ms is not None

    @property
    def loss(self) -> float | None:
        return self.losses[-1] if self.losses else None

    @property
    def max_tokens_per_step(self) -> int | None:
        return None if self.max_batch is None else self.max_batch * self.seq


@dataclass(frozen=True)
class Settings:
    seq: int
    batch: int
    steps: int
    warmup_steps: int
    seed: int
    quick: bool
    layers: int | None  # decoder layers instead of the model's
    find_max_batch: bool
    max_batch_limit: int
    sweep_steps: int





def train_steps(step: Callable[[Any], Any], batches: Sequence[Any], warmup: int,
                device: torch.device) -> tuple[list[float], list[float], float | None]:
    """(ms of the steps after ``warmup``, every loss, peak GiB since the first step)."""
    cuda = common.uses_cuda(device)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for index, ids in enumerate(batches):
        ms, loss = timed(step, device, ids)
        losses.append(loss)
        if index >= warmup:
            times.append(ms)
    peak = torch.cuda.max_memory_allocated(device) / GIB if cuda else None
    return times, [float(v) for v in losses], peak


def find_max_batch(fits: Callable[[int], bool], start: int,
                   limit: int) -> tuple[int | None, bool]:
    """Largest batch ≤ ``limit`` with ``fits`` (assumed monotone): doubling from ``start``, then
    bisecting. Returns (batch or None, whether the search stopped at the limit)."""
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


def versioned_label(method: str, version: str | None) -> str:
    """"liger-kernel 0.8.5 (loss only)": the peer's version after its name."""
    name, parenthesis, rest = LABELS[method].partition(" (")
    return f"{name} {version}{parenthesis}{rest}" if version else LABELS[method]


def run_method(spec: ModelSpec, method: str, settings: Settings, device: torch.device,
               log=print) -> MethodResult:
    s = settings
    result = MethodResult(model=spec.name, method=method, label=LABELS[method], batch=s.batch,
                          seq=s.seq, tokens_per_step=s.batch * s.seq)
    if method in PEERS:
        result.label = versioned_label(method, common.package_version(PEERS[method]))
    if method in COMPILED and not common.uses_cuda(device) and s.quick:
        result.status, result.note = UNAVAILABLE, "torch.compile skipped on the CPU (--quick)"
        return result
    family = importlib.import_module(
        f"transformers.models.{spec.model_type}.modeling_{spec.model_type}")
    model = call = optimizer = step = None
    try:
        with module_patches_undone(family):
            model = build_model(spec, s.quick, s.seed, device, s.layers)
            try:
                call, result.call = prepare_method(method, model, spec, device)
            except Unavailable as error:
                missing = "not importable" in str(error)
                result.status = NOT_INSTALLED if missing else UNAVAILABLE
                result.note = str(error)
                return result
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR,
                                          fused=common.uses_cuda(device))

            def step(ids: Any) -> Any:
                output = call(input_ids=ids, labels=ids, use_cache=False)
                loss = output.loss
                del output  # the logits (if any) go before the backward, as in a training loop
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                return loss.detach()

            if common.uses_cuda(device):
                result.static_gib = torch.cuda.memory_allocated(device) / GIB
            vocab = model.config.vocab_size
            batches = [make_batch(vocab, s.batch, s.seq, s.seed, i, device)
                       for i in range(s.warmup_steps + s.steps)]
            result.step_ms, result.losses, result.peak_gib = train_steps(
                step, batches, s.warmup_steps, device)
            del batches
            result.ms = statistics.median(result.step_ms)
            result.tokens_per_s = result.tokens_per_step / (result.ms * 1e-3)
            result.sweep.append(_point(s.batch, s.seq, result.ms, result.peak_gib))
            if s.find_max_batch:
                _search_max_batch(result, step, optimizer, vocab, s, device, log)
    except Exception as error:  # report and go on with the next method
        result.status = common.OUT_OF_MEMORY if common.is_out_of_memory(error) else common.FAILED
        result.note = common.describe_error(error)
    finally:
        model = call = optimizer = step = None  # noqa: F841 (drop the references before freeing)
        if method in COMPILED:
            import torch._dynamo as dynamo

            dynamo.reset()
        common.release_memory(device)
    return result


def _point(batch: int, seq: int, ms: float | None = None,
           peak_gib: float | None = None) -> dict[str, Any]:
    """One batch tried (or the fixed batch): an entry of ``MethodResult.sweep``."""
    return dict(batch=batch, tokens=batch * seq, status=OK, ms=ms,
                tokens_per_s=None if ms is None else batch * seq / (ms * 1e-3),
                peak_gib=peak_gib, note="")


def _search_max_batch(result: MethodResult, step, optimizer, vocab: int, s: Settings,
                      device: torch.device, log) -> None:
    """Fills ``result.max_batch*`` and ``result.sweep``: per batch tried, one warm-up step
    (also the recompile of compiled methods) and ``s.sweep_steps`` timed steps."""
    by_batch = {point["batch"]: point for point in result.sweep}

    def fits(batch: int) -> bool:
        if batch in by_batch:
            return by_batch[batch]["status"] == OK
        point = _point(batch, s.seq)
        failure: str | None = None
        try:
            batches = [make_batch(vocab, batch, s.seq, s.seed, 10_000 + i, device)
                       for i in range(1 + s.sweep_steps)]
            times, _, point["peak_gib"] = train_steps(step, batches, 1, device)
            point.update(_point(batch, s.seq, statistics.median(times), point["peak_gib"]))
        except Exception as error:  # leave the except block before freeing (traceback frames)
            failure = common.OUT_OF_MEMORY if common.is_out_of_memory(error) else common.FAILED
            point["note"] = common.describe_error(error)
        batches = None
        optimizer.zero_grad(set_to_none=True)
        common.release_memory(device)
        if failure is not None:  # a failure other than OOM also ends the growth (noted)
            point["status"] = failure
        by_batch[batch] = point
        log(f"    batch {batch}: " + (point["status"] if failure else
                                      f"{common.format_ms(point['ms'])} ms, "
                                      f"{count_text(point['tokens_per_s'])} tokens/s, "
                                      f"peak {gib_text(point['peak_gib'])} GiB"))
        return failure is None

    result.max_batch, result.max_batch_limited = find_max_batch(fits, s.batch, s.max_batch_limit)
    result.sweep = sorted(by_batch.values(), key=lambda p: p["batch"])
    if result.max_batch is not None:
        best = by_batch[result.max_batch]
        result.max_batch_tokens_per_s, result.max_batch_peak_gib = (best["tokens_per_s"],
                                                                    best["peak_gib"])


def check_losses(results: Sequence[MethodResult]) -> None:
    """Marks wrong a measured method whose first or last loss is off the reference's (hf's,
    else the first measured method's) by more than the tolerances."""
    measured = [r for r in results if r.measured and r.losses]
    reference = next((r for r in measured if r.method == HF), measured[0] if measured else None)
    if reference is None:
        return
    for result in measured:
        first, first_problems = common.check_loss(
            result.losses[0], reference.losses[0], FIRST_LOSS_TOLERANCE)
        last, last_problems = common.check_loss(
            result.losses[-1], reference.losses[-1], LAST_LOSS_TOLERANCE)
        result.first_loss_error, result.loss_error = first, last
        problems = [f"first-step {p}" for p in first_problems]
        problems += [f"last-step {p}" for p in last_problems]
        if result is not reference and problems:
            common.mark_wrong(result, [p + f" ({reference.label})" for p in problems])


# ----------------------------------------------------------------------------- reporting


MEASURE_DEFINITION = (
    f"one step = forward (labels = input ids), backward, AdamW step (lr {LR}, fused on CUDA), "
    "zero_grad; bf16 weights, gradient checkpointing, uniform random tokens from the seed. "
    "ms = median of the timed steps (CUDA events); tokens/s = batch·seq / ms; peak GiB = "
    "torch.cuda.max_memory_allocated() over the steps / 2^30"
)

fmt_ms = common.format_ms
RESULT_COLUMNS = [
    ("method", lambda r: r.label), ("status", lambda r: r.status),
    ("batch", lambda r: r.batch), ("tokens/step", lambda r: r.tokens_per_step),
    ("ms/step", lambda r: fmt_ms(r.ms)), ("tokens/s", lambda r: count_text(r.tokens_per_s)),
    ("peak GiB", lambda r: gib_text(r.peak_gib)),
    ("first loss", lambda r: loss_text(r.losses[0] if r.losses else None)),
    ("last loss", lambda r: loss_text(r.loss)),
    ("|Δ last loss|", lambda r: common.format_error(r.loss_error)),
    ("max batch (tokens)", lambda r: "—" if r.max_batch is None else
     f"{r.max_batch}{'+' if r.max_batch_limited else ''} ({r.max_tokens_per_step})"),
    ("tokens/s at max", lambda r: count_text(r.max_batch_tokens_per_s)),
    ("peak GiB at max", lambda r: gib_text(r.max_batch_peak_gib)), ("note", lambda r: r.note),
]
SWEEP_COLUMNS = [  # items: (result, point)
    ("method", lambda i: i[0].label), *[(h, lambda i, k=k: i[1][k]) for h, k in
                                        (("batch", "batch"), ("tokens", "tokens"),
                                         ("status", "status"))],
    ("ms", lambda i: fmt_ms(i[1]["ms"])), ("tokens/s", lambda i: count_text(i[1]["tokens_per_s"])),
    ("peak GiB", lambda i: gib_text(i[1]["peak_gib"])),
]
SHORT_COLUMNS = [  # items: (model, result)
    ("model", lambda i: i[0]), ("method", lambda i: i[1].label),
    ("ms/step", lambda i: fmt_ms(i[1].ms) if i[1].measured else i[1].status),
    ("tokens/s", lambda i: count_text(i[1].tokens_per_s)),
    ("peak GiB", lambda i: gib_text(i[1].peak_gib)), ("loss", lambda i: loss_text(i[1].loss)),
    ("max batch", lambda i: "—" if i[1].max_batch is None else str(i[1].max_batch)),
]


def render_markdown(info: Any, results: dict[str, list[MethodResult]]) -> str:
    env, s = info.environment, info.settings
    lines = [f"# End-to-end training step: {env['device_name']}, {env['date']}", ""]
    if s.quick:
        lines += ["> **--quick run**: tiny configs (V 512, hidden 64, 2 layers); a smoke test of "
                  "the suite, the figures are not representative.", ""]
    rows = [
        *common.environment_rows(env, info.peer_versions),
        ("transformers", common.package_version("transformers") or "unknown"),
        ("sequence, batch, steps", f"seq {s.seq}, batch {s.batch}, {s.warmup_steps} warm-up + "
         f"{s.steps} timed steps, seed {s.seed}"),
        ("max-batch search", f"on, limit {s.max_batch_limit}, 1 warm-up + {s.sweep_steps} timed "
         "steps per batch" if s.find_max_batch else "off"),
        ("measured", MEASURE_DEFINITION),
        ("loss check", f"first-step loss within {FIRST_LOSS_TOLERANCE}·max(1, |ref|) and last "
         f"within {LAST_LOSS_TOLERANCE}·max(1, |ref|) of HF eager's; otherwise 'wrong'"),
    ]
    lines += [common.markdown_table(["setting", "value"], rows), "", "## Models", ""]
    rows = [[name, m["title"], m["source"], m["vocab_size"], m["hidden_size"], m["layers"],
             f"{m['parameters'] / 1e6:,.2f} M", m["attn_implementation"]]
            for name, m in info.models.items()]
    lines += [common.markdown_table(["key", "model", "config from", "V", "hidden", "layers",
                                     "parameters", "attention"], rows), ""]
    for model, model_results in results.items():
        lines += [f"## {info.models[model]['title']}", "", table(RESULT_COLUMNS, model_results),
                  ""]
        if any(len(r.sweep) > 1 for r in model_results):
            points = [(r, p) for r in model_results for p in r.sweep]
            lines += ["Batches tried:", "", table(SWEEP_COLUMNS, points), ""]
    lines += common.closing_sections(info.calls, info.notes)
    return "\n".join(lines)


def results_json(info: Any, results: dict[str, list[MethodResult]]) -> dict[str, Any]:
    return {
        "suite": NAME, "environment": info.environment, "settings": asdict(info.settings),
        "methods": info.methods, "peer_versions": info.peer_versions,
        "transformers": common.package_version("transformers"),
        "definitions": {"measured": MEASURE_DEFINITION},
        "models": [
            {"model": name, **info.models[name],
             "results": [{**asdict(r), "loss": r.loss, "max_tokens_per_step":
                          r.max_tokens_per_step} for r in model_results]}
            for name, model_results in results.items()
        ],
        "calls": info.calls, "notes": info.notes,
    }


def plot_results(path: Path, results: dict[str, list[MethodResult]]) -> Path | None:
    """Peak memory and tokens/s against tokens per step, one line per method, per model."""
    panels = []
    for model, model_results in results.items():
        ok = [(r.label, [p for p in r.sweep if p["status"] == OK]) for r in model_results]
        for title, key, unit in (("peak memory", "peak_gib", "peak GiB"),
                                 ("throughput", "tokens_per_s", "tokens/s")):
            lines = [(label, [p["tokens"] for p in pts], [p[key] for p in pts])
                     for label, pts in ok if pts and any(p[key] is not None for p in pts)]
            panels.append((f"{model}: {title}", "tokens per step", unit, lines))
    return save_plot(path, panels, columns=2, size=(6, 4), marker="o")


# ----------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--models", type=common.comma_list(list(MODEL_SPECS)), default=list(MODEL_SPECS),
        help=f"comma list of {', '.join(MODEL_SPECS)} (default: all)")
    add("--methods", type=common.comma_list(METHODS), default=list(METHODS),
        help=f"comma list of {', '.join(METHODS)} (default: all)")
    add("--seq", type=int, default=None, help=f"default {DEFAULT_SEQ} ({QUICK_SEQ} with --quick)")
    add("--batch", type=int, default=None,
        help=f"fixed batch, default {DEFAULT_BATCH} ({QUICK_BATCH} with --quick)")
    add("--steps", type=int, default=None,
        help=f"timed steps, default {DEFAULT_STEPS} ({QUICK_STEPS} with --quick)")
    add("--warmup-steps", type=int, default=None,
        help=f"untimed first steps, default {DEFAULT_WARMUP} ({QUICK_WARMUP} with --quick)")
    add("--layers", type=int, default=None,
        help="decoder layers instead of each model's (real vocabulary and width)")
    add("--find-max-batch", action="store_true",
        help=f"also grow the batch until out of memory, then bisect (up to {MAX_BATCH_LIMIT}; "
        f"{QUICK_MAX_BATCH_LIMIT} with --quick)")
    add("--sweep-steps", type=int, default=2, help="timed steps per batch tried (default 2)")
    add("--seed", type=int, default=0)
    add("--quick", action="store_true",
        help="tiny configs, seq 32: a CPU smoke test in seconds (compiled methods skipped)")
    add("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    add("--out", type=Path, default=common.RESULTS_DIR,
        help="results directory (default benchmarks/results)")
    add("--tag", default=None, help="suffix for the results file names")


def settings_from(args: argparse.Namespace) -> Settings:
    quick = bool(args.quick)

    def pick(value, full, small):
        return value if value is not None else (small if quick else full)

    return Settings(
        seq=pick(args.seq, DEFAULT_SEQ, QUICK_SEQ), batch=pick(args.batch, DEFAULT_BATCH,
                                                               QUICK_BATCH),
        steps=max(1, pick(args.steps, DEFAULT_STEPS, QUICK_STEPS)),
        warmup_steps=max(0, pick(args.warmup_steps, DEFAULT_WARMUP, QUICK_WARMUP)),
        seed=args.seed, quick=quick, layers=args.layers,
        find_max_batch=bool(args.find_max_batch),
        max_batch_limit=QUICK_MAX_BATCH_LIMIT if quick else MAX_BATCH_LIMIT,
        sweep_steps=max(1, args.sweep_steps),
    )


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> int:
    device = common.pick_device(args.device)
    if not common.uses_cuda(device) and not args.quick:
        log("the train suite needs a CUDA device at full size; use --quick for a CPU smoke run")
        return 2
    s = settings_from(args)
    notes: list[str] = [common.QUICK_NOTE] if s.quick else []
    environment = common.collect_environment(device)
    log(f"train on {environment['device_name']}: torch {environment['torch']}, transformers "
        f"{common.package_version('transformers')}, seq {s.seq}, batch {s.batch}")
    results: dict[str, list[MethodResult]] = {}
    models: dict[str, dict[str, Any]] = {}
    calls: dict[str, str] = {}
    for name in args.models:
        spec = MODEL_SPECS[name]
        config = build_config(spec, s.quick, s.layers)
        models[name] = {
            "title": spec.title, "source": spec.source, "model_type": spec.model_type,
            "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
            "layers": config.num_hidden_layers, "parameters": 0, "attn_implementation": "—",
            "config": config_kwargs(spec, s.quick, s.layers),
        }
        log(f"{spec.title} ({'quick: ' if s.quick else ''}V {config.vocab_size}, "
            f"hidden {config.hidden_size}, {config.num_hidden_layers} layers)")
        results[name] = []
        for method in args.methods:
            r = run_method(spec, method, s, device, log)
            results[name].append(r)
            if r.call and calls.setdefault(method, r.call) != r.call:
                calls[f"{method}, {name}"] = r.call  # e.g. liger's function per family
            log(f"  {r.label}: " + (
                f"{fmt_ms(r.ms)} ms/step, {count_text(r.tokens_per_s)} tokens/s, peak "
                f"{gib_text(r.peak_gib)} GiB, loss {loss_text(r.loss)}"
                + (f", max batch {r.max_batch}" if r.max_batch else "")
                if r.measured else f"{r.status}: {r.note}"))
        check_losses(results[name])
        for r in results[name]:
            common.note_problem(notes, name, r)
        models[name].update(_model_facts(spec, s.quick, s.layers))
    info = types.SimpleNamespace(
        environment=environment, settings=s, methods=list(args.methods),
        peer_versions={d: common.package_version(d) for d in PEERS.values()},
        models=models, calls=calls, notes=notes)
    stem = common.results_stem(RESULTS_PREFIX, environment["date"], environment["device_slug"],
                               args.tag)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    plot = plot_results(Path(args.out) / f"{stem}.png", results)
    notes.append(f"plot: {plot.name}" if plot else "no plot: matplotlib not installed")
    common.report_results(
        args.out, RESULTS_PREFIX, args.tag, info.environment, info.notes,
        markdown=render_markdown(info, results), payload=results_json(info, results),
        tables=table(SHORT_COLUMNS, [(m, r) for m, rs in results.items() for r in rs], True),
        log=log)
    return 0


SUITE = Suite(
    name=NAME,
    help="end-to-end training step of Llama-3.2-1B, Gemma-2-2B, Qwen2.5-1.5B per loss method",
    add_arguments=add_arguments,
    run=run,
)
