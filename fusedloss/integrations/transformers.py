"""Hugging Face transformers integration: a causal LM whose training loss never builds the logits.

transformers 5.x computes ``logits = self.lm_head(hidden_states)`` in every
``*ForCausalLM.forward`` before its loss function sees them, so a custom loss function alone
cannot avoid the (tokens × vocabulary) logits: the forward itself is replaced, on one model
instance, by one generic forward::

    from fusedloss.integrations.transformers import apply_fusedloss, AutoFusedLossForCausalLM

    model = AutoModelForCausalLM.from_pretrained(name)
    apply_fusedloss(model)                     # or, in one step:
    model = AutoFusedLossForCausalLM.from_pretrained(name, filter_eps="auto")

What the patched forward does:

- In training (``model.training``) with ``labels``: runs the base model (``self.model``), and
  computes the loss with :func:`fusedloss.linear_cross_entropy` from the final hidden states
  and ``lm_head.weight`` (its bias, if any); returns the family's output class with
  ``logits=None``. The loss is the family's own (``ForCausalLMLoss``): the labels shifted by one
  (or the caller's ``shift_labels``, as context parallelism passes them), ``ignore_index=-100``,
  the mean over the valid tokens, or with ``num_items_in_batch`` (the Trainer under gradient
  accumulation) their sum divided by that count; Gemma 2/3's ``final_logit_softcapping`` as
  fusedloss's ``softcap``; Cohere's ``logit_scale`` and Granite's ``1 / logits_scaling`` folded
  into the hidden states (and bias); MoE families add ``router_aux_loss_coef × aux_loss`` when
  ``output_router_logits`` is set, as the original does. Tied embeddings need nothing: the
  head's weight *is* the embedding, and its gradient flows to it.
- Otherwise (no labels; evaluation, unless ``fuse_in_eval=True``; a non-zero
  ``logits_to_keep``; ``generate()``): the original forward, unchanged.

The signature (``inspect.signature(model.forward)``, which the Trainer reads) and the output
class are the original's. ``return_dict=False`` returns the tuple (without the ``None``
logits). Only families whose loss and every parameter gradient were checked equal to the
unpatched model's (``tests/test_transformers.py``) are accepted: :data:`SUPPORTED_FAMILIES`.
Anything else is refused with an error naming the class, as are the heads this cannot
reproduce: ``pretraining_tp > 1``, a LoRA (or other PEFT tuner) layer on ``lm_head``, a head that
is not a plain ``nn.Linear`` or has forward hooks (other than FSDP2's, and tensor parallelism's
on a vocab-sharded head), a forward whose head
differs from the family's known one (a newer transformers); and an instance whose forward another
library has already replaced (TRL's SFTTrainer adds its fused LM head so: patch first). PEFT's
``ModulesToSaveWrapper`` on ``lm_head`` (``modules_to_save=["lm_head"]``) is unwrapped at each
call (the active adapter's copy, or the original when adapters are disabled); a ``PeftModel``
is patched through its base model.

Under autocast the head's inputs are cast to the autocast dtype (as ``nn.Linear`` would be);
outside autocast, hidden states whose dtype differs from the head's weight are cast to it.

FSDP: with the head in an enclosing unit (FSDP2 ``fully_shard(model)``, FSDP1 around the
model) that unit's hooks have gathered the full weight before the forward runs. When
``lm_head`` is its own unit (FSDP2 ``fully_shard(model.lm_head)`` or a group with the tied
embedding; FSDP1 wrapping it), the loss runs *as the head module's forward*
(:func:`_loss_through_head`), so FSDP gathers the weight for it, re-gathers it before its
backward and reduce-scatters its gradient, as for ``lm_head(hidden)``.

Tensor parallelism: a head weight that is a DTensor sharded over the vocabulary (``Shard(0)``
on a 1-D device mesh, torch's even ``torch.chunk`` split: ``ColwiseParallel`` on ``lm_head``,
transformers' ``colwise_gather_output`` / ``colwise_rep``) is computed with the
vocabulary-parallel head (:func:`_dtensor_head_loss`): each rank passes its rows, the mesh's
process group and their first row's id; every rank gets the whole head's loss, the hidden
states their full gradient, and the weight its shard's gradient (a ``Shard(0)`` DTensor). A
replicated DTensor weight is used whole. Any other layout still sharded at the loss (another
placement, a multi-dimensional mesh, a flat shard of an unknown unit, DeepSpeed ZeRO-3) is
refused by name.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..losses.cross_entropy import linear_cross_entropy

__all__ = [
    "SUPPORTED_FAMILIES", "AutoFusedLossForCausalLM", "FusedLossUnsupportedError",
    "apply_fusedloss", "is_fusedloss_applied", "remove_fusedloss",
]

# Options of linear_cross_entropy a user may set; the others (shift, reduction, ignore_index,
# softcap, linear_bias, ...) are the family's and are set by the integration.
_LCE_OPTIONS = ("filter_eps", "backend", "vocab_order", "label_smoothing", "z_loss")


class FusedLossUnsupportedError(ValueError):
    """The model (or its head) cannot be patched faithfully."""


@dataclass(frozen=True)
class _Family:
    cls_name: str  # the *ForCausalLM class
    module: str  # transformers.models.<pkg>.modeling_<pkg>
    head: str = "plain"  # "plain" | "softcap" | "logit_scale" | "logits_scaling"
    moe: bool = False  # adds router_aux_loss_coef * load_balancing_loss_func(...)


def _fam(cls_name: str, pkg: str, head: str = "plain", moe: bool = False) -> _Family:
    return _Family(cls_name, f"transformers.models.{pkg}.modeling_{pkg}", head, moe)


# model_type -> family. Each entry passed the equality test (loss and every gradient against
# the unpatched model) with transformers 5.17.0.
SUPPORTED_FAMILIES: dict[str, _Family] = {
    "llama": _fam("LlamaForCausalLM", "llama"),
    "mistral": _fam("MistralForCausalLM", "mistral"),
    "ministral": _fam("MinistralForCausalLM", "ministral"),
    "qwen2": _fam("Qwen2ForCausalLM", "qwen2"),
    "qwen3": _fam("Qwen3ForCausalLM", "qwen3"),
    "gemma": _fam("GemmaForCausalLM", "gemma"),
    "gemma2": _fam("Gemma2ForCausalLM", "gemma2", head="softcap"),
    "gemma3_text": _fam("Gemma3ForCausalLM", "gemma3", head="softcap"),
    "phi3": _fam("Phi3ForCausalLM", "phi3"),
    "olmo2": _fam("Olmo2ForCausalLM", "olmo2"),
    "glm4": _fam("Glm4ForCausalLM", "glm4"),
    "smollm3": _fam("SmolLM3ForCausalLM", "smollm3"),
    "cohere": _fam("CohereForCausalLM", "cohere", head="logit_scale"),
    "granite": _fam("GraniteForCausalLM", "granite", head="logits_scaling"),
    "mixtral": _fam("MixtralForCausalLM", "mixtral", moe=True),
    "qwen3_moe": _fam("Qwen3MoeForCausalLM", "qwen3_moe", moe=True),
    "gpt_oss": _fam("GptOssForCausalLM", "gpt_oss", moe=True),
    # Beyond the list: same forward as one of the above, same equality test.
    "apertus": _fam("ApertusForCausalLM", "apertus"),
    "arcee": _fam("ArceeForCausalLM", "arcee"),
    "cohere2": _fam("Cohere2ForCausalLM", "cohere2", head="logit_scale"),
    "diffllama": _fam("DiffLlamaForCausalLM", "diffllama"),
    "ernie4_5": _fam("Ernie4_5ForCausalLM", "ernie4_5"),
    "exaone4": _fam("Exaone4ForCausalLM", "exaone4"),
    "glm": _fam("GlmForCausalLM", "glm"),
    "glm4_moe": _fam("Glm4MoeForCausalLM", "glm4_moe"),  # no auxiliary loss in its forward
    "granite_swa": _fam("GraniteSWAForCausalLM", "granite_swa", head="logits_scaling"),
    "helium": _fam("HeliumForCausalLM", "helium"),
    "hunyuan_v1_dense": _fam("HunYuanDenseV1ForCausalLM", "hunyuan_v1_dense"),
    "lfm2": _fam("Lfm2ForCausalLM", "lfm2"),
    "minimax": _fam("MiniMaxForCausalLM", "minimax", moe=True),
    "nanochat": _fam("NanoChatForCausalLM", "nanochat", head="softcap"),
    "nemotron": _fam("NemotronForCausalLM", "nemotron"),
    "olmo": _fam("OlmoForCausalLM", "olmo"),
    "olmo3": _fam("Olmo3ForCausalLM", "olmo3"),
    "olmoe": _fam("OlmoeForCausalLM", "olmoe", moe=True),
    "persimmon": _fam("PersimmonForCausalLM", "persimmon"),
    "phi": _fam("PhiForCausalLM", "phi"),
    "phimoe": _fam("PhimoeForCausalLM", "phimoe", moe=True),
    "qwen2_moe": _fam("Qwen2MoeForCausalLM", "qwen2_moe", moe=True),
    "seed_oss": _fam("SeedOssForCausalLM", "seed_oss"),
    "stablelm": _fam("StableLmForCausalLM", "stablelm"),
    "starcoder2": _fam("Starcoder2ForCausalLM", "starcoder2"),
    "vaultgemma": _fam("VaultGemmaForCausalLM", "vaultgemma", head="softcap"),
}

# The lines of each family's forward between the head and the loss (comments and blank lines
# dropped): a newer transformers that changes them is refused rather than silently mismatched.
_HEAD_LINES = {
    "plain": ["logits = self.lm_head(hidden_states[:, slice_indices, :])"],
    "softcap": [
        "logits = self.lm_head(hidden_states[:, slice_indices, :])",
        "if self.config.final_logit_softcapping is not None:",
        "logits = logits / self.config.final_logit_softcapping",
        "logits = torch.tanh(logits)",
        "logits = logits * self.config.final_logit_softcapping",
    ],
    "logit_scale": ["logits = self.lm_head(hidden_states[:, slice_indices, :])",
                    "logits = logits * self.logit_scale"],
    "logits_scaling": ["logits = self.lm_head(hidden_states[:, slice_indices, :])",
                       "logits = logits / self.config.logits_scaling"],
}
_REQUIRED_LINES = (
    "hidden_states = outputs.last_hidden_state",
    "slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) "
    "else logits_to_keep",
)
_MOE_LINES = (
    "loss += self.router_aux_loss_coef * aux_loss.to(loss.device)",
    "aux_loss = load_balancing_loss_func(",
)


@dataclass
class _State:
    original: Any  # the class's forward (a function)
    family: _Family
    arg_names: tuple[str, ...]  # positional parameters after self
    output_cls: type
    load_balancing_loss: Any = None
    fuse_in_eval: bool = False
    options: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# Checks


def _unwrap_peft_model(model: nn.Module) -> nn.Module:
    """A PeftModel's transformers model (PEFT need not be installed: duck typing)."""
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base) and type(model).__module__.startswith("peft"):
        return get_base()
    return model


def _is_peft_tuner(module: nn.Module) -> bool:
    mod = type(module).__module__
    return mod.startswith("peft.tuners") or (
        hasattr(module, "base_layer") and hasattr(module, "active_adapters"))


def _is_modules_to_save_wrapper(module: nn.Module) -> bool:
    return type(module).__name__ == "ModulesToSaveWrapper" and hasattr(module, "original_module")


def _active_head(model: nn.Module) -> nn.Module:
    """The head module the original forward would run (PEFT's ModulesToSaveWrapper unwrapped
    to its active copy, or the original when adapters are disabled)."""
    head = model.lm_head
    if _is_modules_to_save_wrapper(head):
        active = getattr(head, "active_adapters", None)
        if active is None:
            active = getattr(head, "active_adapter", None)
        if isinstance(active, str):
            active = [active]
        copies = getattr(head, "modules_to_save", {})
        if getattr(head, "disable_adapters", False) or not active or active[0] not in copies:
            return head.original_module
        if len(active) > 1:
            raise FusedLossUnsupportedError(
                f"{type(model).__name__}: lm_head is a ModulesToSaveWrapper with several active "
                f"adapters {list(active)}; fusedloss supports one")
        return copies[active[0]]
    return head


def _is_fsdp2_module(module: nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2) made this module its own unit."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without distributed
        return False
    return isinstance(module, FSDPModule)


def _fsdp1_wrapped(module: nn.Module) -> nn.Module | None:
    """The module an FSDP1 ``FullyShardedDataParallel`` wrapper holds, else None."""
    if type(module).__name__ == "FullyShardedDataParallel":
        return getattr(module, "_fsdp_wrapped_module", None)
    return None


def _unsharded_type(module: nn.Module) -> type:
    """The module's class, seen through FSDP2's dynamic ``FSDP<Class>(FSDPModule, Class)``."""
    cls = type(module)
    if _is_fsdp2_module(module):
        from torch.distributed.fsdp import FSDPModule

        cls = next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))
    return cls


def _foreign_hooks(module: nn.Module) -> list:
    """The module's forward (pre-)hooks other than FSDP2's own (which the fused loss runs:
    see :func:`_loss_through_head`)."""
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]

    def owner(hook):  # FSDP2's hooks are FSDPState methods (wrapped for grouped units)
        while hook is not None and getattr(hook, "__self__", None) is None:
            hook = getattr(hook, "__wrapped__", None)
        return getattr(hook, "__self__", None)

    return [h for h in hooks
            if not type(owner(h)).__module__.startswith("torch.distributed.fsdp.")]


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        return False
    return isinstance(t, DTensor)


def _is_tp_style_hook(hook) -> bool:
    """Whether a forward (pre-)hook is one that torch's ``parallelize_module`` installs for a
    ``ColwiseParallel`` or ``RowwiseParallel`` style: ``distribute_module``'s wrapper around the
    style's input or output function."""
    code = getattr(hook, "__code__", None)
    if (code is None or not getattr(hook, "__closure__", None)
            or getattr(hook, "__module__", None) != "torch.distributed.tensor._api"):
        return False
    cells = {}
    for name, cell in zip(code.co_freevars, hook.__closure__, strict=True):
        try:
            cells[name] = cell.cell_contents
        except ValueError:  # an empty cell
            pass
    fn = cells.get("input_fn", cells.get("output_fn"))
    fn = getattr(fn, "func", fn)  # a functools.partial of the style's static method
    return (getattr(fn, "__module__", None) == "torch.distributed.tensor.parallel.style"
            and getattr(fn, "__qualname__", "").split(".")[0] in ("ColwiseParallel",
                                                                  "RowwiseParallel"))


@dataclass(frozen=True)
class _VocabShard:
    """Where this rank's rows of a vocab-sharded DTensor head lie."""

    group: Any  # the mesh's process group
    start: int  # the global id of this rank's first row


def _dtensor_layout(model: nn.Module, weight) -> _VocabShard | None:
    """The layout of a DTensor head weight: None when it is replicated (every rank holds all of
    it), the vocabulary shard when it is ``Shard(0)`` on a 1-D mesh in DTensor's own even split
    (``torch.chunk``: rank r of the mesh holds the rows from r·ceil(V/W), the last ones fewer or
    none); anything else is refused, naming the placements."""
    from torch.distributed.tensor import Shard

    name = type(model).__name__
    placements = tuple(weight.placements)
    mesh = weight.device_mesh
    if all(p.is_replicate() for p in placements):
        return None
    what = (f"lm_head.weight is a DTensor with placements {placements} on a device mesh of "
            f"shape {tuple(mesh.shape)}")
    if mesh.ndim != 1 or type(placements[0]) is not Shard or placements[0].dim != 0:
        raise FusedLossUnsupportedError(
            f"{name}: {what}. Supported: replicated, or sharded over the vocabulary (Shard(0)) "
            f"on a 1-D mesh (ColwiseParallel on lm_head), computed with the vocabulary-parallel "
            f"head")
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise FusedLossUnsupportedError(f"{name}: {what}, and this rank is not in that mesh")
    index, world = coordinate[0], mesh.size()
    v = weight.shape[0]
    start = min(index * -(-v // world), v)
    # Every Shard(0) DTensor that DTensor's own operations make is split so. A hand-built one
    # with other row counts does not tile [0, V) from these starts, which the vocabulary-parallel
    # head checks collectively: every rank raises the same error, none waits for the others.
    return _VocabShard(mesh.get_group(), start)


def _check_head(model: nn.Module) -> None:
    name = type(model).__name__
    head = getattr(model, "lm_head", None)
    if head is None:
        raise FusedLossUnsupportedError(f"{name} has no lm_head")
    if _is_peft_tuner(head):
        raise FusedLossUnsupportedError(
            f"{name}: lm_head is a PEFT tuner layer ({type(head).__module__}."
            f"{type(head).__name__}, e.g. LoRA on the head); fusedloss would drop the adapter. "
            f"Use modules_to_save=['lm_head'] instead, or leave lm_head out of target_modules")
    head = _active_head(model)
    if _is_peft_tuner(head):
        raise FusedLossUnsupportedError(
            f"{name}: lm_head holds a PEFT tuner layer ({type(head).__name__}); not supported")
    head = _fsdp1_wrapped(head) or head  # lm_head as its own FSDP1 unit: the Linear inside
    if _unsharded_type(head) is not nn.Linear:
        raise FusedLossUnsupportedError(
            f"{name}: unknown head transform: lm_head is {type(head).__module__}."
            f"{type(head).__name__}, not a plain torch.nn.Linear (quantized or custom heads are "
            f"not supported)")
    hooks = _foreign_hooks(head)
    if hooks and _is_dtensor(head.weight) and all(_is_tp_style_hook(h) for h in hooks):
        # parallelize_module's ColwiseParallel / RowwiseParallel: the hooks only redistribute
        # lm_head's own input and output, which the fused loss never produces; what matters is
        # the weight's layout, refused here unless the vocabulary-parallel head can take it.
        _dtensor_layout(model, head.weight)
        hooks = []
    if hooks or hasattr(head, "_hf_hook"):
        raise FusedLossUnsupportedError(
            f"{name}: unknown head transform: lm_head has forward hooks (e.g. accelerate's "
            f"device-map offloading), which the fused loss would skip")
    if head.weight.is_meta:
        raise FusedLossUnsupportedError(f"{name}: lm_head.weight is on the meta device")


def _normalized_lines(func) -> list[str]:
    src = inspect.getsource(func)
    src = re.sub(r'[rR]?"""[\s\S]*?"""', "", src)
    return [ln.split("  #")[0].strip() for ln in src.splitlines()
            if ln.strip() and not ln.strip().startswith("#")]


def _check_source(cls: type, family: _Family) -> None:
    """The class's forward still has the head and loss this integration reproduces."""
    try:
        lines = _normalized_lines(cls.forward)
    except (OSError, TypeError):  # no source available (frozen app): trust the whitelist
        return
    problems = [ln for ln in _REQUIRED_LINES if ln not in lines]
    if not problems:
        start = next(i for i, ln in enumerate(lines) if "self.lm_head(" in ln)
        end = next((i for i in range(start, len(lines)) if lines[i] == "loss = None"), None)
        if end is None or lines[start:end] != _HEAD_LINES[family.head]:
            problems.append("the lines between lm_head and the loss: "
                            f"{lines[start:end] if end else lines[start:start + 6]}")
    if family.moe:
        problems += [ln for ln in _MOE_LINES if ln not in lines]
    if problems:
        raise FusedLossUnsupportedError(
            f"{cls.__name__}.forward in this transformers version differs from the one "
            f"fusedloss reproduces (unknown head transform or loss): {problems}")


def _family_of(model: nn.Module) -> _Family:
    name = type(model).__name__
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = SUPPORTED_FAMILIES.get(model_type)
    if family is None:
        raise FusedLossUnsupportedError(
            f"{name} (model_type={model_type!r}) is not a supported family; supported: "
            f"{', '.join(sorted(SUPPORTED_FAMILIES))}")
    expected = getattr(importlib.import_module(family.module), family.cls_name)
    if not isinstance(model, expected) or type(model).forward is not expected.forward:
        raise FusedLossUnsupportedError(
            f"{name}: expected transformers' {family.cls_name} for model_type={model_type!r} "
            f"(subclasses that override forward are not supported)")
    return family


# --------------------------------------------------------------------------------------------
# The patched forward


def _fused_forward(self, *args, **kwargs):
    state: _State = self._fusedloss_state
    if len(args) > len(state.arg_names):
        raise TypeError(f"{type(self).__name__}.forward takes at most {len(state.arg_names)} "
                        f"positional arguments, got {len(args)}")
    kw = dict(zip(state.arg_names[:len(args)], args, strict=True))
    kw.update(kwargs)
    logits_to_keep = kw.get("logits_to_keep", 0)
    if (kw.get("labels") is None or not (self.training or state.fuse_in_eval)
            or not isinstance(logits_to_keep, int) or logits_to_keep != 0):
        return state.original(self, **kw)
    return _loss_forward(self, state, kw)


def _loss_forward(self, state: _State, kw: dict):
    family = state.family
    return_dict = kw.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    labels = kw.pop("labels")
    kw.pop("logits_to_keep", None)
    # As the original: every remaining argument goes to the base model, and the loss
    # function reads num_items_in_batch, shift_labels and ignore_index from the same kwargs.
    num_items = kw.get("num_items_in_batch")
    shift_labels = kw.get("shift_labels")
    ignore_index = kw.get("ignore_index", -100)
    if family.moe:
        if kw.get("output_router_logits") is None:
            kw["output_router_logits"] = self.config.output_router_logits
    outputs = self.model(**kw)

    hidden = outputs.last_hidden_state
    if shift_labels is not None:
        target, shift = shift_labels.to(hidden.device), False
    else:
        target, shift = labels.to(hidden.device), True

    def head_loss(hidden, weight, bias, **vocab_parallel):
        device_type = hidden.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            weight = weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        hidden = hidden.to(device=weight.device, dtype=weight.dtype)
        softcap = None
        if family.head == "softcap":
            softcap = self.config.final_logit_softcapping
        elif family.head == "logit_scale":  # logits * s == (h * s) @ W.T (+ b * s)
            hidden = hidden * self.logit_scale
            bias = bias * self.logit_scale if bias is not None else None
        elif family.head == "logits_scaling":  # logits / s == (h / s) @ W.T (+ b / s)
            hidden = hidden / self.config.logits_scaling
            bias = bias / self.config.logits_scaling if bias is not None else None
        with torch.autocast(device_type, enabled=False):
            return linear_cross_entropy(
                hidden, weight, target.to(hidden.device), linear_bias=bias,
                ignore_index=ignore_index, reduction="mean" if num_items is None else "sum",
                softcap=softcap, shift=shift, **vocab_parallel, **state.options)

    head = _active_head(self)
    if _is_fsdp2_module(head) or _fsdp1_wrapped(head) is not None:
        # The head is its own FSDP unit: its weight is a shard until the unit's hooks gather it.
        loss = _loss_through_head(head, head_loss, hidden)
    elif _is_dtensor(head.weight):
        # Tensor parallelism: the weight stays a DTensor (no hook gathers it).
        loss = _dtensor_head_loss(self, head, head_loss, hidden)
    else:
        # Plain, or managed by an enclosing FSDP unit (fully_shard(model) / FSDP1 around the
        # model), whose pre-forward hook has already gathered the full weight (see
        # _loss_through_head for why the backward then has it too).
        _check_gathered(self, head.weight, hidden)
        loss = head_loss(hidden, head.weight, head.bias)
    if num_items is not None:
        if isinstance(num_items, torch.Tensor):
            num_items = num_items.to(loss.device)
        loss = loss / num_items

    extra = {}
    if family.moe:
        aux_loss = None
        if kw["output_router_logits"]:
            aux_loss = state.load_balancing_loss(
                outputs.router_logits, self.num_experts, self.num_experts_per_tok,
                kw.get("attention_mask"))
            loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
        extra = {"aux_loss": aux_loss, "router_logits": outputs.router_logits}
    out = state.output_cls(
        loss=loss, logits=None, past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states, attentions=outputs.attentions, **extra)
    return out if return_dict else out.to_tuple()


def _loss_through_head(head: nn.Module, head_loss, hidden: torch.Tensor) -> torch.Tensor:
    """``head_loss(hidden, weight, bias)`` run *as the head module's forward*, so that the
    hooks FSDP2 (``fully_shard(lm_head)``) put on the head fire around the fused loss.

    The fused loss never calls ``lm_head``, so without this the head unit's hooks never run:
    ``head.weight`` stays the local shard (a DTensor: a shape mismatch), and nothing would
    re-gather it for the backward. Calling the head module with its forward swapped for the
    loss gives FSDP2 exactly the calls a plain ``lm_head(hidden)`` gives it:

    - pre-forward: all-gathers the weight and swaps the unsharded parameter in, so reading
      ``head.weight`` inside the call gives the full (V, H) weight; it also hooks ``hidden``
      (the call's input) so that the post-backward reduce-scatters the weight's gradient once
      the gradient of ``hidden`` is computed.
    - post-forward: with ``reshard_after_forward=True`` frees the unsharded weight's storage,
      which the fused loss's autograd node has saved; and registers the pre-backward hook on
      the call's *output*, here the loss itself. The backward starts at the loss, so that hook
      re-gathers the weight (into the same storage the saved tensor refers to) before the fused
      backward reads it — as it does before ``nn.Linear``'s backward for the logits.
    - the gradient of the full weight accumulates on the unsharded parameter, and FSDP2's
      post-backward reduce-scatters it to the sharded parameter's ``.grad``, as for a plain
      head.

    FSDP1 (``FullyShardedDataParallel`` wrapping ``lm_head``) does the same in its wrapper's
    forward: the forward of the ``nn.Linear`` inside is swapped, and the wrapper is called.

    The swap is undone in ``finally`` (a forward the instance already had is restored).
    """
    linear = _fsdp1_wrapped(head) or head

    def forward(module, hidden):
        return head_loss(hidden, module.weight, module.bias)

    had = linear.__dict__.get("forward")
    linear.forward = types.MethodType(forward, linear)
    try:
        return head(hidden)
    finally:
        if had is None:
            del linear.forward
        else:
            linear.forward = had


def _dtensor_head_loss(model: nn.Module, head: nn.Module, head_loss, hidden) -> torch.Tensor:
    """``head_loss`` for a head whose weight is a DTensor (tensor parallelism).

    Sharded over the vocabulary (see :func:`_dtensor_layout`): the vocabulary-parallel head on
    this rank's rows, ``weight.to_local()`` (differentiable: the gradient of the rows reaches the
    parameter as a ``Shard(0)`` DTensor), with the mesh's process group and the rows' first id.
    Every rank must pass the same batch (as tensor parallelism has it); each gets the loss of
    the whole head, and the hidden states the full gradient (the head all-reduces it), as
    ``ColwiseParallel``'s input hook gives them. Replicated: the local copy is the whole head.

    Hidden states that arrive as a DTensor are made whole first: a replicated one is its local
    tensor, a sharded one (sequence parallelism) is gathered; both carry the gradient back to
    their layout. The bias, if any, must be laid out as the weight.
    """
    name = type(model).__name__
    weight, bias = head.weight, head.bias
    layout = _dtensor_layout(model, weight)
    if getattr(model.config, "tie_word_embeddings", False):
        embedding = model.get_input_embeddings()
        if getattr(embedding, "weight", None) is not weight:
            raise FusedLossUnsupportedError(
                f"{name}: config.tie_word_embeddings is set, but lm_head.weight (a DTensor with "
                f"placements {tuple(weight.placements)}) is not the input embedding's weight: "
                f"sharding lm_head alone unties them. Shard the embedding the same way (rows: "
                f"RowwiseParallel on the nn.Embedding) and tie them again (lm_head.weight = "
                f"embed_tokens.weight), or untie them in the config")
    if bias is not None:
        if not _is_dtensor(bias) or (
                bias.device_mesh != weight.device_mesh or bias.placements != weight.placements):
            what = (f"a DTensor with placements {tuple(bias.placements)}" if _is_dtensor(bias)
                    else "a plain tensor")
            raise FusedLossUnsupportedError(
                f"{name}: lm_head.weight is a DTensor with placements "
                f"{tuple(weight.placements)} but lm_head.bias is {what}; they must be laid out "
                f"alike")
        bias = bias.to_local()
    if _is_dtensor(hidden):
        replicated = all(p.is_replicate() for p in hidden.placements)
        hidden = hidden.to_local() if replicated else hidden.full_tensor()
    if layout is None:
        return head_loss(hidden, weight.to_local(), bias)
    return head_loss(hidden, weight.to_local(), bias, process_group=layout.group,
                     vocab_start=layout.start)


def _check_gathered(model: nn.Module, weight: torch.Tensor, hidden: torch.Tensor) -> None:
    """A sharded (non-DTensor) head weight that reaches the fused loss is refused by name, not
    left to fail with a shape mismatch deep inside the kernel."""
    if weight.dim() != 2 or weight.shape[-1] != hidden.shape[-1]:
        raise FusedLossUnsupportedError(
            f"{type(model).__name__}: lm_head.weight reaches the fused loss sharded (of shape "
            f"{tuple(weight.shape)}, hidden size {hidden.shape[-1]}). Supported sharding: "
            f"FSDP2 (fully_shard) and FSDP1 (FullyShardedDataParallel) units around the whole "
            f"model (the head in the root unit) or around lm_head; a DTensor weight sharded over "
            f"the vocabulary (Shard(0)) on a 1-D mesh (tensor parallelism). Not supported: an "
            f"FSDP unit between the model and lm_head (e.g. around PEFT's "
            f"ModulesToSaveWrapper), DeepSpeed ZeRO-3")


# --------------------------------------------------------------------------------------------
# Public API


def apply_fusedloss(model: nn.Module, *, fuse_in_eval: bool = False, **options) -> nn.Module:
    """Patch a transformers ``*ForCausalLM`` instance so that its training loss is computed by
    :func:`fusedloss.linear_cross_entropy` without the logits (see the module docstring).

    Args:
        model: a model of a family in :data:`SUPPORTED_FAMILIES`, or a PEFT ``PeftModel``
            around one (its base model is patched). Only this instance changes; calling
            again updates the options.
        fuse_in_eval: also take the fused path in ``model.eval()`` when ``labels`` are given
            (then ``logits`` is None: for evaluation with ``prediction_loss_only``). By
            default evaluation returns the logits, through the original forward.
        **options: passed to :func:`fusedloss.linear_cross_entropy`: ``filter_eps``,
            ``backend``, ``vocab_order``, and (changing the objective, opt-in)
            ``label_smoothing`` and ``z_loss``.

    Returns:
        ``model`` (patched in place).

    Raises:
        FusedLossUnsupportedError: (a ``ValueError``) naming the class, for an unsupported
            family, a subclass overriding ``forward``, ``pretraining_tp > 1``, a PEFT tuner
            layer (LoRA) on ``lm_head``, a head that is not a plain ``nn.Linear``, a
            tensor-parallel head whose weight is not split over the vocabulary, or an
            instance whose forward another library already replaced (build TRL's trainers after
            patching). A head weight laid out so that no hook gathers it and the
            vocabulary-parallel head cannot take it is refused at the first training call.
        TypeError: an option linear_cross_entropy does not take here.
    """
    unknown = sorted(set(options) - set(_LCE_OPTIONS))
    if unknown:
        raise TypeError(f"apply_fusedloss got unknown options {unknown}; it passes only "
                        f"{list(_LCE_OPTIONS)} to linear_cross_entropy (the family sets the rest)")
    target = _unwrap_peft_model(model)
    family = _family_of(target)
    name = type(target).__name__
    if (getattr(target.config, "pretraining_tp", 1) or 1) > 1:
        raise FusedLossUnsupportedError(
            f"{name}: config.pretraining_tp={target.config.pretraining_tp} > 1 is not supported "
            f"(set it to 1)")
    if not isinstance(getattr(target, "model", None), nn.Module):
        raise FusedLossUnsupportedError(f"{name} has no base model at .model")
    _check_head(target)
    cls = type(target)
    _check_source(cls, family)
    if "forward" in target.__dict__ and not is_fusedloss_applied(target):
        # Another library's per-instance forward (TRL's trainers install their fused LM head
        # this way, accelerate its autocast wrapper): replacing it would silently drop it.
        raise FusedLossUnsupportedError(
            f"{name}: this instance's forward was already replaced by another library (e.g. "
            f"TRL's SFTTrainer, which adds its fused LM head when it is built); apply_fusedloss "
            f"would drop that wrapper. Patch the model before building the trainer")

    module = importlib.import_module(family.module)
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    arg_names = tuple(p.name for p in params
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    state = _State(
        original=cls.forward, family=family, arg_names=arg_names,
        output_cls=MoeCausalLMOutputWithPast if family.moe else CausalLMOutputWithPast,
        load_balancing_loss=getattr(module, "load_balancing_loss_func", None),
        fuse_in_eval=bool(fuse_in_eval), options=dict(options))
    if family.moe and state.load_balancing_loss is None:
        raise FusedLossUnsupportedError(f"{name}: {family.module} has no load_balancing_loss_func")
    target._fusedloss_state = state
    if not is_fusedloss_applied(target):
        # functools.wraps keeps the original's signature (inspect follows __wrapped__) and
        # docstring; bound to the instance, it shadows the class's forward for this model only.
        forward = functools.wraps(cls.forward)(
            lambda self, *args, **kwargs: _fused_forward(self, *args, **kwargs))
        forward._fusedloss = True
        target.forward = types.MethodType(forward, target)
    return model


def is_fusedloss_applied(model: nn.Module) -> bool:
    """Whether :func:`apply_fusedloss` patched this model (or a PeftModel's base model)."""
    fwd = _unwrap_peft_model(model).__dict__.get("forward")
    return getattr(getattr(fwd, "__func__", None), "_fusedloss", False)


def remove_fusedloss(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_fusedloss`: the class's forward again."""
    target = _unwrap_peft_model(model)
    if is_fusedloss_applied(target):
        del target.forward
        del target._fusedloss_state
    return model


def _split_options(kwargs: dict) -> tuple[dict, dict]:
    options = {k: kwargs.pop(k) for k in (*_LCE_OPTIONS, "fuse_in_eval") if k in kwargs}
    return options, kwargs


class AutoFusedLossForCausalLM:
    """``AutoModelForCausalLM`` that patches the model it builds with :func:`apply_fusedloss`.

    The keyword arguments of :func:`apply_fusedloss` (``filter_eps``, ``backend``,
    ``vocab_order``, ``label_smoothing``, ``z_loss``, ``fuse_in_eval``) are taken out; the
    rest go to ``AutoModelForCausalLM``::

        model = AutoFusedLossForCausalLM.from_pretrained("Qwen/Qwen2.5-0.5B", dtype="bfloat16")
        model = AutoFusedLossForCausalLM.from_config(config, backend="torch")
    """

    def __init__(self, *args, **kwargs):
        raise OSError("AutoFusedLossForCausalLM is built with from_pretrained(...) or "
                      "from_config(...)")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        from transformers import AutoModelForCausalLM

        options, kwargs = _split_options(kwargs)
        model = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args,
                                                     **kwargs)
        return apply_fusedloss(model, **options)

    @classmethod
    def from_config(cls, config, **kwargs):
        from transformers import AutoModelForCausalLM

        options, kwargs = _split_options(kwargs)
        return apply_fusedloss(AutoModelForCausalLM.from_config(config, **kwargs), **options)
