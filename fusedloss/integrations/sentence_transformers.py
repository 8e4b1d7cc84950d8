"""sentence-transformers' in-batch-negatives losses on fusedloss's kernels (sentence-transformers
6.x, extra ``fusedloss[st]``).

``FusedMultipleNegativesRankingLoss``, ``FusedMultipleNegativesSymmetricRankingLoss`` and
``FusedCachedMultipleNegativesRankingLoss`` take the constructor arguments of
sentence-transformers' ``MultipleNegativesRankingLoss``, ``MultipleNegativesSymmetricRankingLoss``
and ``CachedMultipleNegativesRankingLoss`` (they subclass them: config, model card, citation and
the trainer's handling are theirs) and compute the same loss, values and gradients, without the
(queries × documents) similarity matrix::

    from fusedloss.integrations.sentence_transformers import FusedMultipleNegativesRankingLoss
    loss = FusedMultipleNegativesRankingLoss(model, scale=20.0)  # the original's arguments
    trainer = SentenceTransformerTrainer(model=model, train_dataset=data, loss=loss)

    from fusedloss.integrations.sentence_transformers import fused_loss
    loss = fused_loss(losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=64))

The loss, with s = ``scale``, S the similarity (cosine: of the L2-normalized embeddings; dot
product), q_i the queries (anchors), d_i their positives and D all documents (positives, then
each hard-negative column), per query i, for the selected ``directions``:

    query_to_doc    l_qd = LSE_j s·S(q_i, D_j)         doc_to_query  l_dq = LSE_j s·S(d_i, q_j)
    query_to_query  l_qq = LSE_{j≠i} s·S(q_i, q_j)     doc_to_doc    l_dd = LSE_{j∉i} s·S(d_i, D_j)

and loss_i = LSE_k(l_k) − s·S(q_i, d_i) ("joint") or mean_k(l_k) − s·S(q_i, d_i)
("per_direction"), averaged over the queries (doc_to_doc leaves out every document of query
i). Each l_k − s·S(q_i, d_i) comes from fused calls: ``fusedloss.info_nce_loss``
(query_to_doc, doc_to_query) or, per block of embeddings, the kernels' LSE without the row's
own column (``losses.contrastive.off_diagonal_margins``: query_to_query, doc_to_doc, the
hardness modes). Not supported (the constructor or the call raises, naming the option):
query_to_query, doc_to_doc and hardness modes with ``gather_across_devices=True``, similarity
functions other than cosine and dot product. With ``gather_across_devices=True`` the other
ranks' embeddings reach this rank's rows on the ring (``fusedloss.distributed``) instead of an
all-gather.
"""

from __future__ import annotations

import contextlib
from typing import Any

import sentence_transformers
import torch
import torch.nn.functional as F
from sentence_transformers import losses as st_losses
from sentence_transformers.util import cos_sim, dot_score
from torch import Tensor

from ..core import config
from ..losses import contrastive

# 6.2 computes the losses in ``compute_loss_from_embeddings`` / ``calculate_loss``, which the
# fused classes override: an older version would ignore them and run its own loss silently
if tuple(int(p) for p in sentence_transformers.__version__.split(".")[:2]) < (6, 2):
    raise ImportError(f"fusedloss.integrations.sentence_transformers needs sentence-transformers "
                      f">= 6.2, found {sentence_transformers.__version__}")

__all__ = ["FusedCachedMultipleNegativesRankingLoss", "FusedMultipleNegativesRankingLoss",
           "FusedMultipleNegativesSymmetricRankingLoss", "fused_loss",
           "multiple_negatives_ranking_loss"]

SIMILARITIES = {cos_sim: "cosine", dot_score: "dot"}


def multiple_negatives_ranking_loss(
    queries: Tensor,  # (B, E)
    docs: list[Tensor],  # the positives (B, E), then each hard-negative column (B, E)
    *,
    scale: float = 20.0,
    similarity: str = "cosine",
    directions: tuple[str, ...] = ("query_to_doc",),
    partition_mode: str = "joint",
    hardness_mode: str | None = None,
    hardness_strength: float = 0.0,
    gather_across_devices: bool = False,
    backend: str = "auto",
) -> Tensor:
    """sentence-transformers' ``MultipleNegativesRankingLoss`` on embeddings (the module doc's
    loss), a scalar fp32, from fused calls: no (B × B·(1 + k)) matrix.

    ``hardness_mode`` ("in_batch_negatives", "hard_negatives", "all_negatives") adds
    α·stop_grad(S) (α = ``hardness_strength``) to query_to_doc's logits of the negatives it
    names: their block of documents runs at the scale s + α with its gradient scaled by
    s / (s + α), each query's own documents apart (the kernels leave a row's own column out).

    ``gather_across_devices``: in a torch.distributed group of W ranks with B queries each,
    this rank's queries against the documents of every rank (and its positives against every
    rank's queries, for doc_to_query) on the ring (``fusedloss.distributed.info_nce_loss``:
    the ranks' embeddings travel, nothing is gathered), the loss the mean over its own queries
    and the gradients those of the sum of the ranks' losses, as sentence-transformers' gather
    with gradients gives them; query_to_query, doc_to_doc and hardness modes are not supported
    there."""
    _check_directions(directions, partition_mode)
    if hardness_mode not in (None, *HARDNESS_MODES):
        raise ValueError(f"hardness_mode must be None or one of {HARDNESS_MODES}, got "
                         f"{hardness_mode!r}")
    hardness = hardness_mode is not None and hardness_strength > 0
    if gather_across_devices and (set(directions) & {"query_to_query", "doc_to_doc"}
                                  or hardness):
        raise ValueError("gather_across_devices=True takes the directions query_to_doc and "
                         "doc_to_query without a hardness_mode; query_to_query, doc_to_doc and "
                         "hardness modes are not supported there")
    if similarity == "cosine":
        queries, docs = F.normalize(queries, dim=-1), [F.normalize(d, dim=-1) for d in docs]
    elif similarity != "dot":
        raise ValueError(f"similarity must be 'cosine' or 'dot', got {similarity!r}")
    positives = docs[0]
    keys = torch.cat(docs, dim=0) if len(docs) > 1 else positives
    positive = scale * (queries * positives).sum(-1).float()  # s·S(q_i, d_i)
    common = dict(temperature=1.0 / scale, reduction="none", backend=backend)
    info_nce = contrastive.info_nce_loss
    key_ids = query_ids = None  # each row's positive: its own index on one process
    if gather_across_devices and torch.distributed.is_initialized():
        from ..distributed import contrastive as ring

        # global key ids of the rank-order concatenation of the ranks' keys (equal batches)
        rank, b = torch.distributed.get_rank(), queries.shape[0]
        own = torch.arange(b, device=queries.device)
        key_ids, query_ids = rank * keys.shape[0] + own, rank * b + own
        info_nce = ring.info_nce_loss
    single = tuple(directions) == ("query_to_doc",) and not hardness
    if single and info_nce is contrastive.info_nce_loss:
        # one reduced call: fp32 features take the LM head's training path there
        return info_nce(queries, keys, **{**common, "reduction": "mean"})
    # each direction's l_k − s·S(q_i, d_i), per query
    margins = []
    for direction in directions:
        if direction == "query_to_doc" and hardness:
            margins.append(_hard_query_to_doc(queries, docs, scale, hardness_mode,
                                              hardness_strength, backend) - positive)
        elif direction == "query_to_doc":
            margins.append(info_nce(queries, keys, key_ids, **common))
        elif direction == "doc_to_query":
            margins.append(info_nce(positives, queries, query_ids, **common))
        elif direction == "query_to_query":
            margins.append(_block_lse(queries, queries, scale, True, backend) - positive)
        else:  # doc_to_doc: every document but the query's own ones
            blocks = [_block_lse(positives, d, scale, True, backend) for d in docs]
            margins.append(torch.logsumexp(torch.stack(blocks), dim=0) - positive)
    if len(margins) == 1:
        return margins[0].mean()
    stacked = torch.stack(margins)
    if partition_mode == "joint":
        return torch.logsumexp(stacked, dim=0).mean()
    return stacked.mean()


HARDNESS_MODES = ("in_batch_negatives", "hard_negatives", "all_negatives")


def _hard_query_to_doc(queries: Tensor, docs: list[Tensor], scale: float, mode: str,
                       strength: float, backend: str) -> Tensor:
    """LSE_j of query_to_doc's logits s·S_ij + α·stop_grad(S_ij) on the negatives ``mode``
    names (per query (B,)): each block of documents at s, or at s + α with its gradient scaled
    by s / (s + α), its own column in or out, and the query's own documents as terms apart."""
    own = [scale * (queries * d).sum(-1).float() for d in docs]  # s·S(q_i, d_i), s·S(q_i, n_i)
    harder = scale + strength

    def penalized(block: Tensor, diagonal_out: bool) -> Tensor:
        lse = _block_lse(queries, block, harder, diagonal_out, backend)
        return _ScaledGradient.apply(lse, scale / harder)

    if mode == "hard_negatives":  # the query's own hard negatives, each with its penalty
        if len(docs) == 1:
            return _block_lse(queries, docs[0], scale, False, backend)
        terms = [_block_lse(queries, docs[0], scale, False, backend)]
        terms += [_block_lse(queries, n, scale, True, backend) for n in docs[1:]]
        terms += [t + (strength / scale) * t.detach() for t in own[1:]]
    elif mode == "in_batch_negatives":  # every other query's documents
        terms = own + [penalized(d, True) for d in docs]
    else:  # all_negatives: everything but the positive
        terms = [own[0], penalized(docs[0], True)] + [penalized(n, False) for n in docs[1:]]
    return torch.logsumexp(torch.stack(terms), dim=0)


def _block_lse(rows: Tensor, block: Tensor, scale: float, diagonal_out: bool,
               backend: str) -> Tensor:
    """LSE_j s·<r_i, b_j> per row (N,) over a block of B ≥ N rows, without j = i when
    ``diagonal_out`` (−inf for a single row): a fused call's margin plus the target's logit."""
    n = rows.shape[0]
    if not diagonal_out:
        margin = contrastive.info_nce_loss(rows, block, temperature=1.0 / scale,
                                           reduction="none", backend=backend)
        return margin + scale * (rows * block[:n]).sum(-1).float()
    if block.shape[0] == 1:
        return torch.full((1,), float("-inf"), device=rows.device) + 0 * rows.sum()
    target = (torch.arange(n, device=rows.device) + 1) % block.shape[0]
    margin = contrastive.off_diagonal_margins(rows, block, target, scale, backend)
    return margin + scale * (rows * block[target]).sum(-1).float()


class _ScaledGradient(torch.autograd.Function):
    """The identity forward, the gradient times a constant backward."""

    @staticmethod
    def forward(ctx, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.factor, None


def _check_directions(directions, partition_mode) -> None:
    valid = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
    if not directions or not set(directions) <= set(valid) or "query_to_doc" not in directions:
        raise ValueError(f"directions must hold 'query_to_doc' and others of {valid}, got "
                         f"{directions!r}")
    if partition_mode not in ("joint", "per_direction"):
        raise ValueError(f"partition_mode must be 'joint' or 'per_direction', got "
                         f"{partition_mode!r}")


def _similarity_name(similarity_fct) -> str:
    name = SIMILARITIES.get(similarity_fct)
    if name is None:
        raise ValueError(f"similarity_fct {getattr(similarity_fct, '__name__', similarity_fct)!r}"
                         f" is not supported by the fused loss: use util.cos_sim or "
                         f"util.dot_score")
    return name


def _refuse_unsupported(loss) -> None:
    """ValueError naming the first option the fused losses do not support."""
    _similarity_name(loss.similarity_fct)
    hardness = loss.hardness_mode is not None and loss.hardness_strength > 0
    if loss.gather_across_devices and (
            set(loss.directions) & {"query_to_query", "doc_to_doc"} or hardness):
        raise ValueError("gather_across_devices=True takes the directions query_to_doc and "
                         "doc_to_query without a hardness_mode; query_to_query, doc_to_doc and "
                         "hardness modes are not supported there")


def _loss_of(loss, queries: Tensor, docs: list[Tensor]) -> Tensor:
    if len(docs) < 1:
        raise ValueError(f"expected at least 2 embedding columns, got {1 + len(docs)}")
    return multiple_negatives_ranking_loss(
        queries, docs, scale=float(loss.scale), similarity=_similarity_name(loss.similarity_fct),
        directions=tuple(loss.directions), partition_mode=loss.partition_mode,
        hardness_mode=loss.hardness_mode, hardness_strength=float(loss.hardness_strength),
        gather_across_devices=loss.gather_across_devices)


class FusedMultipleNegativesRankingLoss(st_losses.MultipleNegativesRankingLoss):
    """sentence-transformers' ``MultipleNegativesRankingLoss`` (same arguments, same loss)
    computed without the similarity matrix (the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _refuse_unsupported(self)

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor) -> Tensor:
        return _loss_of(self, embeddings[0], list(embeddings[1:]))


class FusedMultipleNegativesSymmetricRankingLoss(
        st_losses.MultipleNegativesSymmetricRankingLoss):
    """sentence-transformers' ``MultipleNegativesSymmetricRankingLoss`` (query_to_doc and
    doc_to_query, one softmax each) without the similarity matrix."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _refuse_unsupported(self)

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor) -> Tensor:
        return _loss_of(self, embeddings[0], list(embeddings[1:]))


# The cached loss's working memory never goes below the tiled kernels' default scratch: narrower
# chunks and slabs would let the host's launches set the pace.
MIN_LOSS_BYTES = 64 * 2**20


class FusedCachedMultipleNegativesRankingLoss(st_losses.CachedMultipleNegativesRankingLoss):
    """sentence-transformers' ``CachedMultipleNegativesRankingLoss`` (Gradient Cache: the
    embeddings in mini-batches without gradients, the loss and its gradient with respect to
    them, then the mini-batches again with gradients, the random state replayed for dropout),
    its loss step one fused call per direction over the whole batch instead of mini-batches of
    the similarity matrix. That step's working memory stays within what sentence-transformers'
    mini-batches hold, ``mini_batch_size`` rows of fp32 logits against every document, or 64 MiB
    (the tiled kernels' default scratch) where that is more: the chunks of the fp32 path, the
    tiled kernels' scratch, the materialized path's reach and the CPU's blocks are set to it for
    the call (``fusedloss.core.config.tuned``: the process's tuning, within the block only, so
    not for two threads' calls at once; any setting of those four fields is replaced for the
    call). With ``gather_across_devices`` the ring keeps its own plan."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _refuse_unsupported(self)

    def calculate_loss(self, reps: list[list[Tensor]], labels: Tensor | None = None, *,
                       with_backward: bool = False) -> Tensor:
        queries, docs = torch.cat(reps[0]), [torch.cat(r) for r in reps[1:]]
        budget = max(4 * self.mini_batch_size * sum(d.shape[0] for d in docs), MIN_LOSS_BYTES)
        bounded = (contextlib.nullcontext() if self.gather_across_devices else config.tuned(
            lm_head_chunk_bytes=budget, scratch_mb=budget / 2**20, materialized_bytes=budget,
            torch_chunk_elements=budget // 4))
        with bounded:
            loss = _loss_of(self, queries, docs)
            if with_backward:
                loss.backward()
                loss = loss.detach()
        return loss


_FUSED = {
    st_losses.CachedMultipleNegativesRankingLoss: FusedCachedMultipleNegativesRankingLoss,
    st_losses.MultipleNegativesSymmetricRankingLoss: FusedMultipleNegativesSymmetricRankingLoss,
    st_losses.MultipleNegativesRankingLoss: FusedMultipleNegativesRankingLoss,
}


def fused_loss(loss: torch.nn.Module) -> torch.nn.Module:
    """The fused counterpart of a sentence-transformers loss object, with its model and
    settings: ``loss = fused_loss(losses.MultipleNegativesRankingLoss(model, scale=30))``.
    ValueError for a loss without one, or for an option the fused losses do not support
    (named)."""
    cls = _FUSED.get(type(loss))
    if cls is None:
        raise ValueError(f"no fused counterpart for {type(loss).__name__}; fused: "
                         f"{', '.join(c.__name__ for c in _FUSED)}")
    settings = dict(loss.get_config_dict())
    settings["similarity_fct"] = loss.similarity_fct
    if cls is FusedMultipleNegativesSymmetricRankingLoss:
        settings = {k: settings[k] for k in ("scale", "similarity_fct", "gather_across_devices")}
    return cls(loss.model, **settings)
