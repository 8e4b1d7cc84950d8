"""The transformers integration under tensor parallelism (a vocab-sharded DTensor head), on 2
gloo ranks (CPU).

``lm_head`` sharded over the vocabulary (``ColwiseParallel``: its weight a ``Shard(0)``
DTensor) is computed with the vocabulary-parallel head. Each case builds a tiny model, shards
it (torch's ``parallelize_module``, or transformers' own tensor-parallel plan), patches it, and
runs one forward + backward with labels, every rank on the same batch: the loss, and every
parameter's gradient (sharded ones gathered with ``full_tensor()``), equal the unpatched model's
in one process without sharding; and the unpatched model sharded the same way. Layouts the
vocabulary-parallel head cannot take are refused by name.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist
from workers import all_ok

pytest.importorskip("transformers")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)
try:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        RowwiseParallel,
        parallelize_module,
    )
except ImportError:
    pytest.skip("DTensor / tensor parallelism is not available", allow_module_level=True)

from test_transformers import OPTS, make_model  # noqa: E402

from fusedloss.integrations.transformers import (  # noqa: E402
    FusedLossUnsupportedError,
    apply_fusedloss,
)

WORLD = 2


def tp_batch(vocab: int, b: int = 2, t: int = 12, seed: int = 3) -> dict:
    """The same batch on every rank (tensor parallelism): a masked prompt, right padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (b, t), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    labels[-1, -2:] = -100
    mask = torch.ones_like(ids)
    mask[-1, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _shard(model, mesh, plan: str):
    """Shard ``model`` on the 1-D ``mesh`` as ``plan`` says."""
    head = ColwiseParallel(output_layouts=Replicate())
    if plan == "colwise":  # the head only
        parallelize_module(model, mesh, {"lm_head": head})
    elif plan == "tied":  # the embedding's rows and the head, the same Shard(0), tied again
        parallelize_module(model, mesh, {"model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate()), "lm_head": head})
        model.lm_head.weight = model.model.embed_tokens.weight
    elif plan == "sequence-hidden":  # the final norm's output a sequence-sharded DTensor
        parallelize_module(model, mesh, {
            "model.norm": PrepareModuleOutput(output_layouts=Replicate(),
                                              desired_output_layouts=Shard(1),
                                              use_local_output=False),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    elif plan == "replicated":  # a replicated DTensor weight (no hooks): used whole
        model.lm_head.weight = torch.nn.Parameter(
            distribute_tensor(model.lm_head.weight.detach(), mesh, [Replicate()]))
    elif plan == "hf":  # transformers' plan for the whole model (lm_head: colwise_gather_output)
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        apply_tensor_parallelism(model, mesh)
    else:
        raise ValueError(plan)
    return model


def _grads(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = None if g is None else (g.full_tensor() if isinstance(g, DTensor) else g)
    return out


def _step(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out


def _case(rank, world, model_type, vocab, plan, tied, bias, extra, apply_first):
    mesh = init_device_mesh("cpu", (world,))
    single = make_model(model_type, vocab_size=vocab, tie_word_embeddings=tied).train()
    if bias:
        head = torch.nn.Linear(single.config.hidden_size, vocab, bias=True)
        torch.nn.init.normal_(head.bias, std=0.5)
        head.weight.data.copy_(single.lm_head.weight.data)
        single.lm_head = head
    # A replicated weight with plain hidden states: the unpatched head cannot run (DTensor
    # refuses to mix them); only the comparison with one process is made.
    ref = None if plan == "replicated" else _shard(copy.deepcopy(single), mesh, plan)
    fused = copy.deepcopy(single)
    if apply_first:
        apply_fusedloss(fused, **OPTS)
    _shard(fused, mesh, plan)
    if not apply_first:
        apply_fusedloss(fused, **OPTS)
    inputs = {**tp_batch(vocab), **extra}
    o_single, o_fused = _step(single, inputs), _step(fused, inputs)
    o_ref = _step(ref, inputs) if ref is not None else o_single
    assert o_fused.logits is None and o_ref.logits is not None
    weight = fused.lm_head.weight
    layout = tuple(weight.placements)
    assert tuple(weight.grad.placements) == layout, weight.grad.placements
    # Without labels: the original forward, the sharded head's logits as the unpatched one's.
    without = {k: v for k, v in inputs.items() if k not in ("labels", "num_items_in_batch")}
    with torch.no_grad():
        logits = (fused(**without).logits, ref(**without).logits) if ref is not None else None
    return {
        "layout": layout, "local_rows": weight.to_local().shape[0],
        "loss": (o_single.loss.detach(), o_ref.loss.detach(), o_fused.loss.detach()),
        "grads": (_grads(single), _grads(ref or single), _grads(fused)), "logits": logits,
    }



def _assert_grads(fused: dict, ref: dict, rtol=1e-5, atol=1e-6):
    assert fused.keys() == ref.keys()
    n = 0
    for name, g in ref.items():
        if g is None:
            assert fused[name] is None or not fused[name].any(), name
            continue
        n += 1
        assert fused[name] is not None, name
        torch.testing.assert_close(fused[name], g, rtol=rtol, atol=atol, msg=name)
    assert n > 0


CASES = {  # id: model_type, vocab, plan, tied, bias, extra inputs, apply before sharding
    "llama-uneven-301": ("llama", 301, "colwise", False, False, {}, False),
    "llama-even-256": ("llama", 256, "colwise", False, False, {}, False),
    "llama-apply-first": ("llama", 301, "colwise", False, False, {}, True),
    "llama-tied": ("llama", 301, "tied", True, False, {}, False),
    "llama-bias": ("llama", 301, "colwise", False, True, {}, False),
    "llama-num-items": ("llama", 301, "colwise", False, False,
                        {"num_items_in_batch": torch.tensor(7)}, False),
    "llama-sequence-sharded-hidden": ("llama", 301, "sequence-hidden", False, False, {}, False),
    "llama-replicated": ("llama", 301, "replicated", False, False, {}, True),
    "llama-hf-plan": ("llama", 256, "hf", False, False, {}, False),
    "gemma2-softcap-tied": ("gemma2", 301, "tied", True, False, {}, False),
    "cohere-logit-scale": ("cohere", 301, "colwise", False, False, {}, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_vocab_sharded_head_equals_unpatched(workers, case):
    model_type, vocab, plan, tied, bias, extra, apply_first = CASES[case]
    results = all_ok(workers(WORLD).run(_case, model_type, vocab, plan, tied, bias, extra,
                                     apply_first))
    if plan == "replicated":
        assert results[0]["layout"] == (Replicate(),)
    else:
        assert results[0]["layout"] == (Shard(0),)
        chunk = -(-vocab // WORLD)
        assert [r["local_rows"] for r in results] == [chunk, vocab - chunk]
    for r in results:
        single, ref, fused = r["loss"]
        torch.testing.assert_close(fused, single, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-6)
        _assert_grads(r["grads"][2], r["grads"][0])  # as one process without sharding
        _assert_grads(r["grads"][2], r["grads"][1])  # as the unpatched model sharded alike
        if r["logits"] is not None:
            torch.testing.assert_close(r["logits"][0], r["logits"][1], rtol=0, atol=0)


def _refusals(rank, world):
    """Each refused layout: (what, where it was refused, the message)."""
    mesh = init_device_mesh("cpu", (world,))
    out = []

    def attempt(what, model, forward=True):
        where = "apply"
        try:
            apply_fusedloss(model, **OPTS)
            if forward:
                where = "forward"
                model.train()(**tp_batch(301))
            out.append((what, None, "not refused"))
        except ValueError as e:  # FusedLossUnsupportedError, or the head's collective check
            out.append((what, where, str(e)))

    def model(**kw):
        return make_model(vocab_size=301, tie_word_embeddings=False, **kw)

    # RowwiseParallel on the head: its weight Shard(1) (the hidden dimension).
    m = parallelize_module(model(), mesh, {"lm_head": RowwiseParallel(
        input_layouts=Replicate(), output_layouts=Replicate())})
    attempt("shard-1-at-apply", m, forward=False)
    m = apply_fusedloss(model(), **OPTS)
    parallelize_module(m, mesh, {"lm_head": RowwiseParallel(input_layouts=Replicate(),
                                                            output_layouts=Replicate())})
    try:
        m.train()(**tp_batch(301))
        out.append(("shard-1-at-forward", None, "not refused"))
    except FusedLossUnsupportedError as e:
        out.append(("shard-1-at-forward", "forward", str(e)))
    # A vocab-sharded head with a hook of another kind too.
    m = parallelize_module(model(), mesh, {"lm_head": ColwiseParallel(
        output_layouts=Replicate())})
    m.lm_head.register_forward_hook(lambda mod, args, output: output)
    attempt("other-hook", m, forward=False)
    # Shard(0) over uneven custom shards (150 / 151 rows, not torch.chunk's 151 / 150): the
    # vocabulary-parallel head's collective check refuses them on every rank.
    m = model()
    w = m.lm_head.weight.detach()
    rows = w[:150] if rank == 0 else w[150:]
    m.lm_head.weight = torch.nn.Parameter(DTensor.from_local(
        rows.clone(), mesh, [Shard(0)], run_check=False, shape=w.shape, stride=w.stride()))
    attempt("uneven", m)
    # A 2-D mesh.
    mesh2 = init_device_mesh("cpu", (1, world))
    m = model()
    m.lm_head.weight = torch.nn.Parameter(
        distribute_tensor(m.lm_head.weight.detach(), mesh2, [Replicate(), Shard(0)]))
    attempt("2-d-mesh", m)
    # Tied embeddings, the head sharded alone (the tie broken).
    m = parallelize_module(make_model(vocab_size=301, tie_word_embeddings=True), mesh,
                           {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    attempt("tie-broken", m)
    return out


def test_refused_layouts(workers):
    expected = {
        "shard-1-at-apply": ("apply", r"placements \(Shard\(dim=1\),\)"),
        "shard-1-at-forward": ("forward", r"placements \(Shard\(dim=1\),\)"),
        "other-hook": ("apply", "forward hooks"),
        "uneven": ("forward", r"the shards must tile \[0, V\)"),
        "2-d-mesh": ("forward", r"placements \(Replicate\(\), Shard\(dim=0\)\)"),
        "tie-broken": ("forward", "tie_word_embeddings"),
    }
    for result in all_ok(workers(WORLD).run(_refusals)):
        assert [what for what, _, _ in result] == list(expected)
        for what, where, message in result:
            assert where == expected[what][0], (what, message)
            assert re.search(expected[what][1], message), (what, message)


def _compiled_case(rank, world):
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (world,))
    single = make_model("llama", vocab_size=301, tie_word_embeddings=False).train()
    fused = _shard(copy.deepcopy(single), mesh, "colwise")
    apply_fusedloss(fused, **OPTS)
    inputs = tp_batch(301)
    fused.forward = torch.compile(fused.forward, backend="aot_eager")
    o_single, o_fused = _step(single, inputs), _step(fused, inputs)
    return o_single.loss.detach(), o_fused.loss.detach(), _grads(single), _grads(fused)


@pytest.mark.slow
def test_vocab_sharded_head_under_torch_compile(workers):
    """The patched forward of a tensor-parallel model compiled (the vocabulary-parallel head
    runs eagerly inside it, as the distributed layer does under torch.compile): the loss and
    every gradient of the unpatched model in one process."""
    for single_loss, fused_loss, single_grads, fused_grads in all_ok(
            workers(WORLD).run(_compiled_case)):
        torch.testing.assert_close(fused_loss, single_loss, rtol=1e-5, atol=1e-6)
        _assert_grads(fused_grads, single_grads)
