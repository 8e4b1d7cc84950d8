"""Suite ``train``: one full training step of real architectures, per method of computing the loss.

A step is forward, backward and ``torch.optim.AdamW.step()`` of a Hugging Face causal LM built
with random weights from its published config (no download): bf16 weights, gradient
checkpointing on, fixed random token data from the seed. Methods (``--methods``):

- ``hf``: the unpatched model; ``hf-compile``: the same under ``torch.compile(model)``;
- ``liger``: ``apply_liger_kernel_to_<family>`` with fused linear cross-entropy and liger's
  other default kernels on (more of the step than the loss differs); ``liger-flce``: the same
  with every other kernel off (only the loss differs);
- ``cce`` / ``cce-exact``: :func:`patch_cce` (``linear_cross_entropy`` on the final hidden
  states; ``cce-exact`` with its gradient filter off);
- ``fusedloss``: ``apply_fusedloss(model)``; ``fusedloss-compile``: under ``torch.compile``.

Same seed and batches for every method, so the losses must agree within bf16 noise (checked
against ``hf``). Per method: median step time, tokens/s, peak memory, the losses; with
``--find-max-batch``, the largest batch that fits and the figures of every batch tried.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import inspect
import math
import statistics
import time
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks import common
from benchmarks.common import NOT_INSTALLED, OK, UNAVAILABLE
from benchmarks.suites import Suite

NAME = "train"
RESULTS_PREFIX = "train"
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
PEER_MODULES = {LIGER: "liger_kernel", LIGER_FLCE: "liger_kernel", CCE: "cut_cross_entropy",
                CCE_EXACT: "cut_cross_entropy"}
INSTALL_HINT = "pip install cut-cross-entropy==25.1.1 liger-kernel==0.8.5 --no-deps"

DEFAULT_SEQ, DEFAULT_BATCH, DEFAULT_STEPS, DEFAULT_WARMUP = 4096, 2, 5, 2
QUICK_SEQ, QUICK_BATCH, QUICK_STEPS, QUICK_WARMUP = 32, 2, 2, 1
MAX_BATCH_LIMIT, QUICK_MAX_BATCH_LIMIT = 256, 8  # largest batch --find-max-batch tries
LR = 1e-4  # AdamW

# Losses of the methods against hf's (same init, same data): first step (forward only differs)
# and last step (after the AdamW updates, which amplify bf16 differences a little).
FIRST_LOSS_TOLERANCE = 1e-2  # × max(1, |reference|)
LAST_LOSS_TOLERANCE = 3e-2


# ----------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelSpec:
    name: str  # command-line key
    title: str
    model_type: str  # transformers model_type
    liger_family: str  # apply_liger_kernel_to_<liger_family>
    config: dict[str, Any]  # the published config's architecture fields
    source: str  # where the numbers come from


# The architecture fields of the published config.json files (Hugging Face Hub, the model
# repositories named in ``source``); the values are those files', copied here so that nothing
# is downloaded. Token ids and generation settings are left out: they do not change a step.
MODEL_SPECS: dict[str, ModelSpec] = {
    "llama3.2-1b": ModelSpec(
        name="llama3.2-1b",
        title="Llama-3.2-1B",
        model_type="llama",
        liger_family="llama",
        config=dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            hidden_act="silu",
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling={
                "factor": 32.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=True,
            initializer_range=0.02,
        ),
        source="meta-llama/Llama-3.2-1B config.json",
    ),
    "gemma2-2b": ModelSpec(
        name="gemma2-2b",
        title="Gemma-2-2B",
        model_type="gemma2",
        liger_family="gemma2",
        config=dict(
            vocab_size=256000,
            hidden_size=2304,
            intermediate_size=9216,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            hidden_activation="gelu_pytorch_tanh",
            max_position_embeddings=8192,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            query_pre_attn_scalar=256,
            sliding_window=4096,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            attention_bias=False,
            tie_word_embeddings=True,
            initializer_range=0.02,
        ),
        source="google/gemma-2-2b config.json",
    ),
    "qwen2.5-1.5b": ModelSpec(
        name="qwen2.5-1.5b",
        title="Qwen2.5-1.5B",
        model_type="qwen2",
        liger_family="qwen2",
        config=dict(
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            hidden_act="silu",
            max_position_embeddings=131072,
            max_window_layers=28,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            use_sliding_window=False,
            sliding_window=131072,
            tie_word_embeddings=True,
            initializer_range=0.02,
        ),
        source="Qwen/Qwen2.5-1.5B config.json",
    ),
}

# --quick: every model shrunk to these sizes (the family's other fields, e.g. Gemma 2's
# softcaps, stay), so that a step takes milliseconds on a CPU.
QUICK_SIZES = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=16,
    max_window_layers=2,
)


def config_kwargs(spec: ModelSpec, quick: bool, layers: int | None = None) -> dict[str, Any]:
    """The keyword arguments of ``AutoConfig.for_model(spec.model_type, ...)``; ``layers``:
    that many decoder layers instead of the model's (the real vocabulary and width kept)."""
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
    """The model with random weights from ``seed`` (the same for every method), bf16, on the
    device, in training mode with (non-reentrant) gradient checkpointing."""
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
    """Token ids (batch, seq) of step ``step``: uniform over the vocabulary, from the seed."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=generator)
    return ids.to(device)


# ----------------------------------------------------------------------------- methods


class Unavailable(Exception):
    """The method cannot run here (package missing, no CUDA); the message says why."""


@contextlib.contextmanager
def module_patches_undone(module: Any) -> Iterator[None]:
    """Undoes, on exit, what a patch changed in ``module``'s globals and in its classes'
    attributes (liger patches the modeling module and the ``*ForCausalLM`` class, not only
    the instance): later methods must see the original transformers."""
    saved = dict(vars(module))
    classes = {
        name: dict(vars(obj))
        for name, obj in saved.items()
        if isinstance(obj, type) and obj.__module__ == module.__name__
    }
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
    """``apply_liger_kernel_to_<family>(..., model=model)`` with the method's flags; returns the
    model and the call's text.

    ``liger``: only the loss flags are set (fused linear cross-entropy on, plain cross-entropy
    off); the function's other kernels keep their defaults (on). ``liger-flce``: every other
    boolean flag of the function is set False, read from its signature so that a kernel flag
    a family adds is switched off too."""
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
    """Replaces this model instance's forward by one whose training loss is
    ``cut_cross_entropy.linear_cross_entropy`` of the final hidden states and
    ``lm_head.weight`` (the logits are never built); returns the model and the call's text.
    ``exact``: with ``filter_eps=None`` (its gradient filter off), else its default filter.

    With ``labels`` in training mode: the base model (``model.model``) runs with every other
    argument, as in the family's forward, then the loss is HF's ``ForCausalLMLoss``: the labels
    shifted by one (or the caller's ``shift_labels`` as they are), ``ignore_index`` (-100), the
    mean over the valid tokens, or with ``num_items_in_batch`` their sum divided by it; the
    config's ``final_logit_softcapping`` (Gemma 2) is cut-cross-entropy's ``softcap``. Returns
    the family's ``CausalLMOutputWithPast`` with ``logits=None``. Otherwise (no labels,
    evaluation, ``logits_to_keep``): the class's forward. Not cut-cross-entropy's own
    ``cce_patch``: it does not import under transformers 5."""
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
        # As the family's forward: every argument goes to the base model, and the loss reads
        # num_items_in_batch, ignore_index and shift_labels from the same keyword arguments.
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


def prepare_method(
    method: str, model: Any, spec: ModelSpec, device: torch.device
) -> tuple[Callable[..., Any], str]:
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
        text = ", ".join(f"{k}={v!r}" for k, v in options.items())
        call = f"apply_fusedloss(model{', ' + text if text else ''})"
    if method in COMPILED:
        import torch._dynamo as dynamo

        dynamo.reset()
        return torch.compile(model), f"torch.compile({call})"
    return model, call


# ----------------------------------------------------------------------------- measurement


@dataclass
class SweepPoint:
    """One batch size tried by the max-batch search (or the fixed batch)."""

    batch: int
    tokens: int
    status: str = OK
    ms: float | None = None
    tokens_per_s: float | None = None
    peak_gib: float | None = None
    note: str = ""


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
    sweep: list[SweepPoint] = field(default_factory=list)

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


class Trainer:
    """A model (as the method prepared it) and its AdamW; runs timed steps."""

    def __init__(self, call: Callable[..., Any], model: Any, device: torch.device):
        self.call, self.model, self.device = call, model, device
        fused = common.uses_cuda(device)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=fused)

    def step(self, ids: Any) -> Any:
        output = self.call(input_ids=ids, labels=ids, use_cache=False)
        loss = output.loss
        del output  # the logits (if any) go before the backward, as in a training loop
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def run(
        self, batches: Sequence[Any], warmup: int
    ) -> tuple[list[float], list[float], float | None]:
        """Steps over ``batches``; returns (ms of the steps after ``warmup``, every step's loss,
        peak GiB since the first step)."""
        if common.uses_cuda(self.device):
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        times, losses = [], []
        for index, ids in enumerate(batches):
            ms, loss = timed(self.step, self.device, ids)
            losses.append(loss)
            if index >= warmup:
                times.append(ms)
        peak = None
        if common.uses_cuda(self.device):
            peak = torch.cuda.max_memory_allocated(self.device) / GIB
        return times, [float(v) for v in losses], peak

    def free_step_memory(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        common.release_memory(self.device)


def timed(fn: Callable[..., Any], device: torch.device, *args: Any) -> tuple[float, Any]:
    """(ms, result) of ``fn(*args)``: CUDA events around it (wall clock without CUDA)."""
    if common.uses_cuda(device):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        value = fn(*args)
        end.record()
        torch.cuda.synchronize(device)
        return float(start.elapsed_time(end)), value
    begin = time.perf_counter()
    value = fn(*args)
    return (time.perf_counter() - begin) * 1e3, value


def find_max_batch(
    fits: Callable[[int], bool], start: int, limit: int
) -> tuple[int | None, bool]:
    """The largest batch ≤ ``limit`` for which ``fits(batch)`` holds, assuming fitting is
    monotone: doubling from ``start`` until a batch fails or the limit is reached, then
    bisecting between the last success and the first failure. Returns (batch or None when
    even 1 fails, whether the search stopped at the limit without a failure)."""
    start = max(1, min(start, limit))
    good, bad = None, None
    batch = start
    while True:
        if fits(batch):
            good = batch
            if batch >= limit:
                return good, True
            batch = min(batch * 2, limit)
        else:
            bad = batch
            break
    if good is None:  # the start failed: search below it
        low, high = 0, bad
        while high - low > 1:
            middle = (low + high) // 2
            if fits(middle):
                low = middle
            else:
                high = middle
        return (low or None), False
    low, high = good, bad
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low, False


def versioned_label(method: str, version: str | None) -> str:
    """The method's label with the peer's version after its name: "liger-kernel 0.8.5 (loss
    only)"."""
    label = LABELS[method]
    if not version:
        return label
    name, parenthesis, rest = label.partition(" (")
    return f"{name} {version}{parenthesis}{rest}"


def run_method(
    spec: ModelSpec, method: str, settings: Settings, device: torch.device, log=print
) -> MethodResult:
    result = MethodResult(model=spec.name, method=method, label=LABELS[method],
                          batch=settings.batch, seq=settings.seq,
                          tokens_per_step=settings.batch * settings.seq)
    if method in PEERS:
        result.label = versioned_label(method, common.package_version(PEERS[method]))
    if method in COMPILED and not common.uses_cuda(device) and settings.quick:
        result.status, result.note = UNAVAILABLE, "torch.compile skipped on the CPU (--quick)"
        return result
    family = importlib.import_module(
        f"transformers.models.{spec.model_type}.modeling_{spec.model_type}")
    trainer = None
    try:
        with module_patches_undone(family):
            model = build_model(spec, settings.quick, settings.seed, device, settings.layers)
            try:
                call, result.call = prepare_method(method, model, spec, device)
            except Unavailable as error:
                missing = "not importable" in str(error)
                result.status = NOT_INSTALLED if missing else UNAVAILABLE
                result.note = str(error)
                return result
            trainer = Trainer(call, model, device)
            if common.uses_cuda(device):
                result.static_gib = torch.cuda.memory_allocated(device) / GIB
            vocab = model.config.vocab_size
            batches = [
                make_batch(vocab, settings.batch, settings.seq, settings.seed, step, device)
                for step in range(settings.warmup_steps + settings.steps)
            ]
            times, result.losses, result.peak_gib = trainer.run(batches, settings.warmup_steps)
            del batches
            result.step_ms = times
            result.ms = statistics.median(times)
            result.tokens_per_s = result.tokens_per_step / (result.ms * 1e-3)
            result.sweep.append(SweepPoint(settings.batch, result.tokens_per_step, OK, result.ms,
                                           result.tokens_per_s, result.peak_gib))
            if settings.find_max_batch:
                _search_max_batch(result, trainer, vocab, settings, device, log)
    except Exception as error:  # report and go on with the next method
        result.status = common.OUT_OF_MEMORY if common.is_out_of_memory(error) else common.FAILED
        result.note = common.describe_error(error)
    finally:
        trainer = model = call = None  # noqa: F841 (drop the references before freeing)
        if method in COMPILED:
            import torch._dynamo as dynamo

            dynamo.reset()
        common.release_memory(device)
    return result


def _search_max_batch(result: MethodResult, trainer: Trainer, vocab: int, settings: Settings,
                      device: torch.device, log) -> None:
    """Fills ``result.max_batch*`` and ``result.sweep``: each batch tried gets one warm-up step
    (also the recompile of compiled methods) and ``settings.sweep_steps`` timed steps."""
    by_batch = {point.batch: point for point in result.sweep}

    def fits(batch: int) -> bool:
        if batch in by_batch:
            return by_batch[batch].status == OK
        point = SweepPoint(batch, batch * settings.seq)
        failure: str | None = None
        try:
            batches = [make_batch(vocab, batch, settings.seq, settings.seed, 10_000 + i, device)
                       for i in range(1 + settings.sweep_steps)]
            times, _, point.peak_gib = trainer.run(batches, 1)
            point.ms = statistics.median(times)
            point.tokens_per_s = point.tokens / (point.ms * 1e-3)
        except Exception as error:  # leave the except block before freeing (traceback frames)
            failure = common.OUT_OF_MEMORY if common.is_out_of_memory(error) else common.FAILED
            point.note = common.describe_error(error)
        batches = None
        trainer.free_step_memory()
        if failure is not None:  # a failure other than OOM also ends the growth (noted)
            point.status = failure
        by_batch[batch] = point
        log(f"    batch {batch}: {_point_text(point)}")
        return point.status == OK

    result.max_batch, result.max_batch_limited = find_max_batch(
        fits, settings.batch, settings.max_batch_limit)
    result.sweep = sorted(by_batch.values(), key=lambda p: p.batch)
    if result.max_batch is not None:
        best = by_batch[result.max_batch]
        result.max_batch_tokens_per_s, result.max_batch_peak_gib = best.tokens_per_s, best.peak_gib


def _point_text(point: SweepPoint) -> str:
    if point.status != OK:
        return point.status
    return (f"{common.format_ms(point.ms)} ms, {count_text(point.tokens_per_s)} tokens/s, "
            f"peak {gib_text(point.peak_gib)} GiB")


def check_losses(results: Sequence[MethodResult]) -> None:
    """Marks as wrong a measured method whose first or last loss differs from the reference's
    (hf's, else the first measured method's) by more than the bf16 tolerances."""
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


def gib_text(value: float | None) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.2f}"


def count_text(value: float | None) -> str:
    """A rate (tokens/s, images/s): thousands separated, 3 significant digits below 100."""
    if value is None or not math.isfinite(value):
        return "—"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def loss_text(value: float | None) -> str:
    return "—" if value is None else f"{value:.4f}"


@dataclass
class RunInfo:
    environment: dict[str, Any]
    settings: Settings
    methods: list[str]
    peer_versions: dict[str, str | None]
    models: dict[str, dict[str, Any]]  # name -> config summary
    calls: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


MEASURE_DEFINITION = (
    f"one step = forward (labels = input ids), backward, AdamW step (lr {LR}, fused on CUDA), "
    "zero_grad; bf16 weights, gradient checkpointing, uniform random tokens from the seed. "
    "ms = median of the timed steps (CUDA events); tokens/s = batch·seq / ms; peak GiB = "
    "torch.cuda.max_memory_allocated() over the steps / 2^30"
)


def render_markdown(info: RunInfo, results: dict[str, list[MethodResult]]) -> str:
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
    lines += [common.markdown_table(["setting", "value"], rows), ""]
    lines += ["## Models", ""]
    rows = [[name, m["title"], m["source"], m["vocab_size"], m["hidden_size"], m["layers"],
             f"{m['parameters'] / 1e6:,.2f} M", m["attn_implementation"]]
            for name, m in info.models.items()]
    lines += [common.markdown_table(["key", "model", "config from", "V", "hidden", "layers",
                                     "parameters", "attention"], rows), ""]
    for model, model_results in results.items():
        lines += [f"## {info.models[model]['title']}", ""]
        rows = []
        for r in model_results:
            rows.append([
                r.label, r.status, r.batch, r.tokens_per_step, common.format_ms(r.ms),
                count_text(r.tokens_per_s), gib_text(r.peak_gib),
                loss_text(r.losses[0] if r.losses else None), loss_text(r.loss),
                common.format_error(r.loss_error),
                "—" if r.max_batch is None else
                f"{r.max_batch}{'+' if r.max_batch_limited else ''} ({r.max_tokens_per_step})",
                count_text(r.max_batch_tokens_per_s), gib_text(r.max_batch_peak_gib), r.note,
            ])
        headers = ["method", "status", "batch", "tokens/step", "ms/step", "tokens/s", "peak GiB",
                   "first loss", "last loss", "|Δ last loss|", "max batch (tokens)",
                   "tokens/s at max", "peak GiB at max", "note"]
        lines += [common.markdown_table(headers, rows), ""]
        sweep_rows = [[r.label, p.batch, p.tokens, p.status, common.format_ms(p.ms),
                       count_text(p.tokens_per_s), gib_text(p.peak_gib)]
                      for r in model_results for p in r.sweep]
        if any(len(r.sweep) > 1 for r in model_results):
            lines += ["Batches tried:", "", common.markdown_table(
                ["method", "batch", "tokens", "status", "ms", "tokens/s", "peak GiB"],
                sweep_rows), ""]
    lines += common.closing_sections(info.calls, info.notes)
    return "\n".join(lines)


def results_json(info: RunInfo, results: dict[str, list[MethodResult]]) -> dict[str, Any]:
    return {
        "suite": NAME,
        "environment": info.environment,
        "settings": asdict(info.settings),
        "methods": info.methods,
        "peer_versions": info.peer_versions,
        "transformers": common.package_version("transformers"),
        "definitions": {"measured": MEASURE_DEFINITION},
        "models": [
            {"model": name, **info.models[name],
             "results": [{**asdict(r), "loss": r.loss, "max_tokens_per_step":
                          r.max_tokens_per_step} for r in model_results]}
            for name, model_results in results.items()
        ],
        "calls": info.calls,
        "notes": info.notes,
    }


def short_tables(results: dict[str, list[MethodResult]]) -> str:
    rows = [[model, r.label, common.format_ms(r.ms) if r.measured else r.status,
             count_text(r.tokens_per_s), gib_text(r.peak_gib), loss_text(r.loss),
             "—" if r.max_batch is None else str(r.max_batch)]
            for model, model_results in results.items() for r in model_results]
    return common.text_table(["model", "method", "ms/step", "tokens/s", "peak GiB", "loss",
                              "max batch"], rows)


def plot_results(path: Path, results: dict[str, list[MethodResult]]) -> Path | None:
    """Peak memory and tokens/s against tokens per step, one line per method, a row of two
    panels per model. ``None`` (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    models = list(results)
    figure, axes = plt.subplots(len(models), 2, figsize=(12, 4 * len(models)), squeeze=False)
    for row, model in enumerate(models):
        memory_axis, speed_axis = axes[row]
        for r in results[model]:
            points = [p for p in r.sweep if p.status == OK]
            if not points:
                continue
            tokens = [p.tokens for p in points]
            if any(p.peak_gib is not None for p in points):
                memory_axis.plot(tokens, [p.peak_gib for p in points], marker="o", label=r.label)
            speed_axis.plot(tokens, [p.tokens_per_s for p in points], marker="o", label=r.label)
        memory_axis.set(title=f"{model}: peak memory", xlabel="tokens per step",
                        ylabel="peak GiB")
        speed_axis.set(title=f"{model}: throughput", xlabel="tokens per step",
                       ylabel="tokens/s")
        for axis in (memory_axis, speed_axis):
            axis.grid(True, alpha=0.3)
            if axis.get_legend_handles_labels()[0]:
                axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


# ----------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=common.comma_list(list(MODEL_SPECS)),
                        default=list(MODEL_SPECS),
                        help=f"comma list of {', '.join(MODEL_SPECS)} (default: all)")
    parser.add_argument("--methods", type=common.comma_list(METHODS), default=list(METHODS),
                        help=f"comma list of {', '.join(METHODS)} (default: all)")
    parser.add_argument("--seq", type=int, default=None,
                        help=f"sequence length (default {DEFAULT_SEQ}; {QUICK_SEQ} with --quick)")
    parser.add_argument("--batch", type=int, default=None,
                        help=f"fixed batch (default {DEFAULT_BATCH}; {QUICK_BATCH} with --quick)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"timed steps (default {DEFAULT_STEPS}; {QUICK_STEPS} with --quick)")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help=f"untimed steps first (default {DEFAULT_WARMUP}; {QUICK_WARMUP} "
                        "with --quick); their losses count")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers instead of each model's (real vocabulary and width)")
    parser.add_argument("--find-max-batch", action="store_true",
                        help=f"also grow the batch until out of memory (then bisect), up to "
                        f"{MAX_BATCH_LIMIT} ({QUICK_MAX_BATCH_LIMIT} with --quick)")
    parser.add_argument("--sweep-steps", type=int, default=2,
                        help="timed steps per batch tried by --find-max-batch (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="tiny configs, seq 32, batch 2, 2 steps: a smoke test that runs on "
                        "the CPU in seconds (compiled methods skipped there)")
    parser.add_argument("--device", default=None,
                        help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR,
                        help="directory for the results (default benchmarks/results)")
    parser.add_argument("--tag", default=None, help="suffix for the results file names")


def settings_from(args: argparse.Namespace) -> Settings:
    quick = bool(args.quick)

    def pick(value, full, small):
        return value if value is not None else (small if quick else full)

    return Settings(
        seq=pick(args.seq, DEFAULT_SEQ, QUICK_SEQ),
        batch=pick(args.batch, DEFAULT_BATCH, QUICK_BATCH),
        steps=max(1, pick(args.steps, DEFAULT_STEPS, QUICK_STEPS)),
        warmup_steps=max(0, pick(args.warmup_steps, DEFAULT_WARMUP, QUICK_WARMUP)),
        seed=args.seed,
        quick=quick,
        layers=args.layers,
        find_max_batch=bool(args.find_max_batch),
        max_batch_limit=QUICK_MAX_BATCH_LIMIT if quick else MAX_BATCH_LIMIT,
        sweep_steps=max(1, args.sweep_steps),
    )


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> int:
    device = common.pick_device(args.device)
    if not common.uses_cuda(device) and not args.quick:
        log("the train suite needs a CUDA device at full size; use --quick for a CPU smoke run")
        return 2
    settings = settings_from(args)
    notes: list[str] = [common.QUICK_NOTE] if settings.quick else []
    environment = common.collect_environment(device)
    log(f"train on {environment['device_name']}: torch {environment['torch']}, transformers "
        f"{common.package_version('transformers')}, seq {settings.seq}, batch {settings.batch}")

    results: dict[str, list[MethodResult]] = {}
    models: dict[str, dict[str, Any]] = {}
    calls: dict[str, str] = {}
    for name in args.models:
        spec = MODEL_SPECS[name]
        config = build_config(spec, settings.quick, settings.layers)
        models[name] = {
            "title": spec.title, "source": spec.source, "model_type": spec.model_type,
            "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
            "layers": config.num_hidden_layers, "parameters": 0,
            "attn_implementation": "—",
            "config": config_kwargs(spec, settings.quick, settings.layers),
        }
        log(f"{spec.title} ({'quick: ' if settings.quick else ''}V {config.vocab_size}, "
            f"hidden {config.hidden_size}, {config.num_hidden_layers} layers)")
        model_results = []
        for method in args.methods:
            result = run_method(spec, method, settings, device, log)
            model_results.append(result)
            if result.call and calls.setdefault(method, result.call) != result.call:
                calls[f"{method}, {name}"] = result.call  # e.g. liger's function per family
            log(f"  {result.label}: " + (
                f"{common.format_ms(result.ms)} ms/step, "
                f"{count_text(result.tokens_per_s)} tokens/s, "
                f"peak {gib_text(result.peak_gib)} GiB, loss {loss_text(result.loss)}"
                + (f", max batch {result.max_batch}" if result.max_batch else "")
                if result.measured else f"{result.status}: {result.note}"))
        check_losses(model_results)
        for result in model_results:
            common.note_problem(notes, name, result)
        results[name] = model_results
        models[name].update(_model_facts(spec, settings.quick, settings.layers))
    info = RunInfo(
        environment=environment, settings=settings, methods=list(args.methods),
        peer_versions={d: common.package_version(d) for d in PEERS.values()},
        models=models, calls=calls, notes=notes,
    )
    stem = common.results_stem(RESULTS_PREFIX, environment["date"], environment["device_slug"],
                               args.tag)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    plot = plot_results(Path(args.out) / f"{stem}.png", results)
    notes.append(f"plot: {plot.name}" if plot else "no plot: matplotlib not installed")
    common.report_results(
        args.out, RESULTS_PREFIX, args.tag, info,
        markdown=render_markdown(info, results),
        payload=results_json(info, results),
        tables=short_tables(results), log=log,
    )
    return 0


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


SUITE = Suite(
    name=NAME,
    help="end-to-end training step of Llama-3.2-1B, Gemma-2-2B, Qwen2.5-1.5B per loss method",
    add_arguments=add_arguments,
    run=run,
)
