"""Suite ``vocab-parallel``: the vocabulary-parallel LM head over K processes (torchrun) against
a Megatron-style head and the single-GPU head (definitions: benchmarks/README.md)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from benchmarks import common
from benchmarks.inputs import LM_HEAD_SHAPES, QUICK_N, make_lm_head_inputs, quick_shape
from benchmarks.suites import Suite, lm_head, ring

FUSEDLOSS, MEGATRON, SINGLE_GPU = "fusedloss", "megatron", "single-gpu"
DEFAULT_SHAPES = ("gemma2-2b", "llama3-8b")
REGIME = "peaked"


class CopyToTensorParallelRegion(torch.autograd.Function):
    """Megatron's ``_CopyToModelParallelRegion``: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        grad = grad_output.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron-LM's ``_VocabParallelCrossEntropy`` (no label smoothing) on this rank's float32
    logits (N, V_r), in place as Megatron does; saves the shard's softmax."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, vocab_start, group):
        logits_max = torch.max(vocab_parallel_logits, dim=-1)[0]
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        vocab_parallel_logits -= logits_max.unsqueeze(dim=-1)
        partition_vocab_size = vocab_parallel_logits.size(-1)
        target_mask = (target < vocab_start) | (target >= vocab_start + partition_vocab_size)
        masked_target = target.clone() - vocab_start
        masked_target[target_mask] = 0
        logits_2d = vocab_parallel_logits.view(-1, partition_vocab_size)
        masked_target_1d = masked_target.view(-1)
        arange_1d = torch.arange(logits_2d.size(0), device=logits_2d.device)
        predicted_logits = logits_2d[arange_1d, masked_target_1d].clone().contiguous()
        predicted_logits = predicted_logits.view_as(target)
        predicted_logits[target_mask] = 0.0
        dist.all_reduce(predicted_logits, group=group)
        exp_logits = vocab_parallel_logits
        torch.exp(vocab_parallel_logits, out=exp_logits)
        sum_exp_logits = exp_logits.sum(dim=-1)
        dist.all_reduce(sum_exp_logits, group=group)
        loss = torch.log(sum_exp_logits) - predicted_logits
        exp_logits.div_(sum_exp_logits.unsqueeze(dim=-1))
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d = grad_input.view(-1, grad_input.size(-1))
        arange_1d = torch.arange(grad_2d.size(0), device=grad_2d.device)
        grad_2d[arange_1d, masked_target_1d] -= 1.0 - target_mask.view(-1).float()
        grad_input.mul_(grad_output.unsqueeze(dim=-1))
        return grad_input, None, None, None


def megatron_loss(hidden: Tensor, classifier_shard: Tensor, target: Tensor,
                  vocab_start: int) -> Tensor:
    """The Megatron-style vocabulary-parallel head: mean cross-entropy over the tokens."""
    group = dist.group.WORLD
    hidden = CopyToTensorParallelRegion.apply(hidden, group)
    logits = torch.matmul(hidden, classifier_shard.t()).float()
    return VocabParallelCrossEntropy.apply(logits, target, vocab_start, group).mean()


def fusedloss_head(hidden: Tensor, classifier: Tensor, target: Tensor, backend: str,
                   sharded: bool) -> Tensor:
    import fusedloss
    group = dist.group.WORLD if sharded else None
    return fusedloss.linear_cross_entropy(hidden, classifier, target, process_group=group,
                                          backend=backend)


def check_head(row: dict[str, Any], ctx: ring.Context, grads: Sequence[Tensor],
               reference: dict[str, Any] | None) -> list[str]:
    """Every rank's loss, its dE and (over the whole weight) dC against the single-GPU head's
    (its loss, this rank's dE and rows of dC); collectives."""
    row["loss"] = row["rank_losses"][0]
    if reference is None:  # the single-GPU head itself
        return []
    row["check"] = "single GPU"
    errors = [common.check_loss(v, reference["loss"], lm_head.LOSS_TOLERANCE)
              for v in row["rank_losses"]]
    row["loss_error"] = max(error for error, _ in errors)
    row["errors"] = {"dE": max(ctx.gather(common.relative_l2_error(grads[0], reference["dE"]))),
                     "dC": ctx.relative_error(grads[1], reference["dC"])}
    return [p for _, found in errors for p in found][:1] + common.bound_problems(
        row["errors"], lambda _name: lm_head.GRADIENT_ERROR_BOUND)


def run_case(name: str, n: int, ctx: ring.Context, args: argparse.Namespace) -> dict[str, Any]:
    """The single-GPU head on rank 0 (the others wait), then the sharded heads on every rank;
    the case as the JSON keeps it."""
    device, world = ctx.device, ctx.world
    shape = quick_shape(LM_HEAD_SHAPES[name]) if args.quick else LM_HEAD_SHAPES[name]
    vocab, width = shape.vocab_size, shape.hidden_size
    # rank r's rows of C: [⌊r·V/K⌋, ⌊(r+1)·V/K⌋)
    shards = [(r * vocab // world, (r + 1) * vocab // world) for r in range(world)]
    start, stop = shards[ctx.rank]
    case = {"case": f"{name} ({vocab}, {width}) {REGIME}, N={n}, K={world}",
            "vocab_size": vocab, "hidden_size": width, "n": n, "shards": shards,
            "reference": None, "note": "", "results": []}
    ok, inputs = ctx.stage(case, lambda: make_lm_head_inputs(
        n, vocab, width, REGIME, dtype=ctx.dtype, device=device, seed=args.seed))
    if not ok:
        case["note"] = f"inputs could not be made: {case.pop('status')}: {case['note']}"
        return case
    (hidden, classifier, target), inputs = inputs, None
    hidden.requires_grad_(True)

    single, first = common.new_row(SINGLE_GPU, SINGLE_GPU), {}

    def check_single(loss: Tensor, grads: Sequence[Tensor]) -> list[str]:
        first["grads"] = grads
        return check_head(single, ctx, grads, None)

    if ctx.rank == 0:
        full = classifier.clone().requires_grad_(True)
        ring.measure_provider(single, dataclasses.replace(ctx, world=1), lambda: fusedloss_head(
            hidden, full, target, ctx.backend, False), (hidden, full), check_single,
            ring.MIN_REPS)
        full = None
    single = ctx.gather(single)[0]
    reference = None
    if single.get("loss") is None:
        case["note"] = f"no single-GPU reference: {single['status']}: {single['note']}"
    else:  # rank 0's dE and dC to every rank, which keeps its rows of dC
        grads = first.pop("grads", None) or (torch.empty_like(hidden), torch.empty_like(classifier))
        for grad in grads:
            dist.broadcast(grad, src=0)
        reference = {"loss": single["loss"], "dE": grads[0], "dC": grads[1][start:stop].clone()}
        case["reference"], grads = {"single_gpu_loss": single["loss"]}, None
    common.release_memory(device)

    shard = classifier[start:stop].clone().requires_grad_(True)
    losses = {FUSEDLOSS: lambda: fusedloss_head(hidden, shard, target, ctx.backend, True),
              MEGATRON: lambda: megatron_loss(hidden, shard, target, start)}
    for key in (FUSEDLOSS, MEGATRON):
        row = common.new_row(key, key)
        ring.measure_provider(row, ctx, losses[key], (hidden, shard),
                              lambda loss, grads, row=row: check_head(row, ctx, grads, reference),
                              ring.MIN_REPS)
        case["results"].append(row)
    case["results"].append(single)
    for row in case["results"]:
        ring.say_row(ctx, row)
    hidden = classifier = shard = reference = None
    common.release_memory(device)
    return case


def _run(args: argparse.Namespace, ctx: ring.Context) -> int:
    args.n = QUICK_N if args.quick else lm_head.DEFAULT_N
    matmul = common.probe_matmul(ctx.device, args.quick, ctx.timing, ctx.dtype,
                                 ctx.say) if ctx.rank == 0 else {}
    cases = [run_case(name, args.n, ctx, args) for name in args.shapes]
    if ctx.rank == 0:
        for case in cases:
            # One rank's share of the cost floor 8·N·V·D / R (single GPU: all of it).
            floor = 8.0 * args.n * case["vocab_size"] * case["hidden_size"] / matmul["tflops"] / 1e9
            for row in case["results"]:
                share = floor if row["provider"] == SINGLE_GPU else floor / ctx.world
                row["times_floor"] = row["ms"] / share if common.measured(row) else None
        items = ring.result_items(cases)
        body = common.section("Results", "ms: forward+backward step, max over the ranks of each "
                              "rank's median (single-gpu: rank 0 alone, the full C); MB: peak "
                              "per rank above inputs and gradients.", ring.RESULT_COLUMNS, items)
        ring.write_report(args, ctx, "Vocabulary-parallel LM head", body,
                          {"matmul": matmul, "cases": cases},
                          common.table(ring.RESULT_COLUMNS[:8], items, text=True))
    ctx.barrier()
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_list(parser, "--shapes", LM_HEAD_SHAPES, DEFAULT_SHAPES)
    common.add_common_arguments(parser, "V/128, D/32, N = 128: a smoke test (gloo)")


SUITE = Suite("vocab-parallel", "the vocabulary-parallel LM head over K processes (torchrun): "
              "fusedloss's sharded head against a Megatron-style head and the single-GPU head",
              add_arguments, lambda args: ring.run_distributed(args, _run))
