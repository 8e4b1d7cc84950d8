"""The transformers integration under FSDP2 (fully_shard) and FSDP1, on 2 gloo ranks (CPU).

The fused loss never calls ``lm_head``, so FSDP's hooks on a head that is its own unit would
never gather its weight (``_loss_through_head`` runs the loss as the head's forward). Each case
trains a tiny llama for a few optimizer steps, patched and unpatched, sharded the same way,
each rank on its own batch: the losses and the full (gathered) parameters after the steps are
equal between the two, on every rank, and to one process without FSDP (the mean of the ranks'
losses: FSDP averages the gradients).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from workers import all_ok

pytest.importorskip("transformers")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)
try:
    from torch.distributed.fsdp import fully_shard
except ImportError:
    pytest.skip("FSDP2 (torch.distributed.fsdp.fully_shard) is not available",
                allow_module_level=True)

from test_transformers import OPTS, batch, make_model  # noqa: E402

from fusedloss.integrations.transformers import (  # noqa: E402
    FusedLossUnsupportedError,
    apply_fusedloss,
)

WORLD = 2
STEPS = 3


def _optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _shard(model, layout: str, raf: bool):
    """Shard ``model`` as ``layout`` says; returns the module to call."""
    if layout.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        head = model.lm_head
        policy = functools.partial(
            lambda_auto_wrap_policy,
            lambda_fn=lambda m: isinstance(m, LlamaDecoderLayer)
            or (layout == "fsdp1-head" and m is head))
        return FullyShardedDataParallel(model, auto_wrap_policy=policy, use_orig_params=True,
                                        device_id=torch.device("cpu"))
    from torch.distributed.device_mesh import init_device_mesh

    # on CPU ranks even where a GPU is present (fully_shard's default mesh takes the accelerator)
    shard = functools.partial(fully_shard, reshard_after_forward=raf,
                              mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    for layer in model.model.layers:
        shard(layer)
    if layout == "fsdp2-head":
        shard(model.lm_head)
    elif layout == "fsdp2-tied-group":  # a tied head must share its unit with the embedding
        shard([model.model.embed_tokens, model.lm_head])
    shard(model)
    return model


def _full_params(model, wrapped) -> dict:
    if wrapped is not model:  # FSDP1
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(wrapped):
            return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                    for n, p in model.named_parameters()}
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _train_sharded(rank, world, layout, raf, tied, patched, opt, apply_after):
    model = make_model(tie_word_embeddings=tied).train()
    if patched and not apply_after:
        apply_fusedloss(model, **OPTS)
    wrapped = _shard(model, layout, raf)
    if patched and apply_after:
        apply_fusedloss(model, **OPTS)
    optimizer = _optimizer(opt, wrapped.parameters())
    losses = []
    for step in range(STEPS):
        out = wrapped(**batch(seed=10 * step + rank))
        assert (out.logits is None) == patched
        if raf and layout in ("fsdp2-head", "fsdp1-head"):
            # The head unit resharded after the forward, freeing the full weight the fused
            # loss saved: the backward below is right only if FSDP gathers it again.
            weight = model.lm_head.weight
            assert type(weight).__name__ == "DTensor" or weight.dim() == 1, type(weight)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    return losses, _full_params(model, wrapped)


def _train_reference(world, tied, opt):
    """One process, no FSDP, unpatched: the mean over the ranks' batches."""
    model = make_model(tie_word_embeddings=tied).train()
    optimizer = _optimizer(opt, model.parameters())
    losses = []
    for step in range(STEPS):
        per_rank = [model(**batch(seed=10 * step + r)).loss for r in range(world)]
        (sum(per_rank) / world).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append([x.item() for x in per_rank])
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _case(rank, world, layout, raf, tied, opt, apply_after=False):
    torch.manual_seed(0)
    ref = _train_sharded(rank, world, layout, raf, tied, False, opt, False)
    fused = _train_sharded(rank, world, layout, raf, tied, True, opt, apply_after)
    single = _train_reference(world, tied, opt) if rank == 0 else None
    return ref, fused, single



def _assert_params(a: dict, b: dict, rtol=1e-4, atol=1e-5):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=name)


CASES = [  # layout, reshard_after_forward, tied embeddings, optimizer
    ("fsdp2-root", True, False, "adamw"),
    ("fsdp2-root", False, True, "sgd"),
    ("fsdp2-head", True, False, "adamw"),
    ("fsdp2-head", False, False, "sgd"),
    ("fsdp2-tied-group", True, True, "adamw"),
    ("fsdp1-root", True, True, "adamw"),
    ("fsdp1-head", True, False, "sgd"),
]


@pytest.mark.parametrize(("layout", "raf", "tied", "opt"), CASES)
def test_sharded_training_equals_unpatched(workers, layout, raf, tied, opt):
    results = all_ok(workers(WORLD).run(_case, layout, raf, tied, opt))
    single_losses, single_params = results[0][2]
    for rank, (ref, fused, _) in enumerate(results):
        # Patched vs. unpatched, both sharded the same way: same losses, same parameters.
        torch.testing.assert_close(fused[0], ref[0], rtol=1e-5, atol=1e-6)
        _assert_params(fused[1], ref[1])
        # ... and as one process without FSDP.
        torch.testing.assert_close(fused[0], [s[rank] for s in single_losses],
                                   rtol=1e-5, atol=1e-6)
        _assert_params(fused[1], single_params)
    # Every rank holds the same full parameters.
    _assert_params(results[1][1][1], results[0][1][1], rtol=0, atol=0)


def test_apply_after_fully_shard(workers):
    """apply_fusedloss on a model whose head is already its own FSDP2 unit (FSDP's hooks on
    lm_head are accepted; other forward hooks are still refused)."""
    results = all_ok(workers(WORLD).run(_case, "fsdp2-head", True, False, "sgd", True))
    for ref, fused, _ in results:
        torch.testing.assert_close(fused[0], ref[0], rtol=1e-5, atol=1e-6)
        _assert_params(fused[1], ref[1])


def test_sharded_weight_reaching_the_loss_is_refused():
    """A head weight that is still a shard at the loss (here a flat 1-D one, as an FSDP unit
    the integration does not know would leave it) is refused by name, not a shape error."""
    model = apply_fusedloss(make_model(), **OPTS).train()
    w = model.lm_head.weight
    model.lm_head.weight = torch.nn.Parameter(w.detach().flatten()[: w.numel() // 2].clone())
    with pytest.raises(FusedLossUnsupportedError, match="reaches the fused loss sharded"):
        model(**batch())


def test_copy_unaffected():
    """The head's forward swap is undone: the head computes logits again afterwards."""
    model = apply_fusedloss(make_model(), **OPTS).train()
    head = copy.deepcopy(model.lm_head)
    from fusedloss.integrations.transformers import _loss_through_head

    h = torch.randn(2, 3, 32)
    out = _loss_through_head(head, lambda h, w, b: (h @ w.T).sum(), h)
    torch.testing.assert_close(out, (h @ head.weight.T).sum())
    assert "forward" not in head.__dict__
    torch.testing.assert_close(head(h), h @ head.weight.T)
