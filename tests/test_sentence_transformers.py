"""``fusedloss.integrations.sentence_transformers`` against sentence-transformers' own losses
(6.x, an optional test dependency): values and gradients on embeddings for every direction,
partition mode, similarity and number of hard-negative columns, on both backends; the plain,
symmetric and cached losses on a tiny encoder built from a config (dropout on, the cached
loss's mini-batches not dividing the batch); the swap helper and its refusals; a short
``SentenceTransformerTrainer`` run with the same losses step by step."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import DEVICE, requires_triton

st = pytest.importorskip("sentence_transformers")

from sentence_transformers import losses  # noqa: E402
from sentence_transformers.util import cos_sim, dot_score  # noqa: E402

from fusedloss.integrations import sentence_transformers as fst  # noqa: E402

B, E = 7, 16
DIRECTIONS = {
    "q2d": ("query_to_doc",),
    "symmetric": ("query_to_doc", "doc_to_query"),
    "all": ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"),
    "q2d+q2q": ("query_to_doc", "query_to_query"),
}


def _embeddings(columns: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, E, generator=g).to(DEVICE).requires_grad_() for _ in range(columns)]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("directions, mode, similarity, negatives, hardness", [
    ("q2d", "joint", "cosine", 0, None), ("q2d", "joint", "cosine", 2, None),
    ("q2d", "joint", "dot", 1, None), ("symmetric", "per_direction", "cosine", 1, None),
    ("symmetric", "joint", "dot", 0, None), ("all", "joint", "cosine", 0, None),
    ("all", "joint", "cosine", 2, None), ("q2d+q2q", "joint", "cosine", 2, None),
    ("q2d+q2q", "joint", "dot", 1, None),
    ("q2d", "joint", "cosine", 2, "hard_negatives"),
    ("q2d", "joint", "cosine", 0, "hard_negatives"),
    ("q2d", "joint", "cosine", 1, "in_batch_negatives"),
    ("symmetric", "per_direction", "dot", 2, "all_negatives"),
    ("all", "joint", "cosine", 1, "in_batch_negatives"),
    ("q2d", "joint", "cosine", 0, "all_negatives")])
def test_loss_equals_sentence_transformers(directions, mode, similarity, negatives, hardness,
                                           backend):
    emb = _embeddings(2 + negatives)
    scale = 20.0 if similarity == "cosine" else 0.5
    strength = 0.0 if hardness is None else 5.0
    theirs = losses.MultipleNegativesRankingLoss(
        torch.nn.Module(), scale=scale, directions=DIRECTIONS[directions], partition_mode=mode,
        similarity_fct=cos_sim if similarity == "cosine" else dot_score, hardness_mode=hardness,
        hardness_strength=strength)
    want = theirs.compute_loss_from_embeddings(emb, None)
    got = fst.multiple_negatives_ranking_loss(
        emb[0], emb[1:], scale=scale, similarity=similarity, directions=DIRECTIONS[directions],
        partition_mode=mode, hardness_mode=hardness, hardness_strength=strength,
        backend=backend)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for x, r in zip(torch.autograd.grad(got, emb), torch.autograd.grad(want, emb), strict=True):
        torch.testing.assert_close(x, r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("directions, hardness", [
    ("q2d", None), ("all", None), ("q2d", "in_batch_negatives")])
def test_loss_compiles_with_fullgraph(directions, hardness):
    """``multiple_negatives_ranking_loss`` under ``torch.compile(fullgraph=True)``: the fused
    calls are custom ops, the hardness modes' gradient scaling an autograd Function."""
    torch._dynamo.reset()
    emb = _embeddings(3, seed=2)

    def fn(*columns):
        return fst.multiple_negatives_ranking_loss(
            columns[0], list(columns[1:]), directions=DIRECTIONS[directions],
            hardness_mode=hardness, hardness_strength=0.0 if hardness is None else 5.0)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got, want = compiled(*emb), fn(*emb)
    torch.testing.assert_close(got, want)
    for x, r in zip(torch.autograd.grad(got, emb), torch.autograd.grad(want, emb), strict=True):
        torch.testing.assert_close(x, r)


def test_symmetric_loss_equals_sentence_transformers():
    emb = _embeddings(3, seed=1)
    want = losses.MultipleNegativesSymmetricRankingLoss(
        torch.nn.Module(), scale=10.0).compute_loss_from_embeddings(emb, None)
    got = fst.FusedMultipleNegativesSymmetricRankingLoss(
        torch.nn.Module(), scale=10.0).compute_loss_from_embeddings(emb, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for x, r in zip(torch.autograd.grad(got, emb), torch.autograd.grad(want, emb), strict=True):
        torch.testing.assert_close(x, r, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------
# on a tiny encoder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import BertConfig, BertModel, BertTokenizerFast

    path = str(tmp_path_factory.mktemp("tiny-bert"))
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(60)]
    with open(os.path.join(path, "vocab.txt"), "w") as f:
        f.write("\n".join(words))
    BertTokenizerFast(vocab_file=os.path.join(path, "vocab.txt")).save_pretrained(path)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=64,
                         max_position_embeddings=64)).save_pretrained(path)
    return path


def _model(model_dir):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    return SentenceTransformer(modules=[Transformer(model_dir), Pooling(32, "mean"),
                                        Normalize()], device="cpu")


def _texts(n: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(f"w{int(i)}" for i in torch.randint(0, 60, (int(k),), generator=g))
            for k in torch.randint(2, 9, (n,), generator=g)]


def _features(model, columns: int, n: int = 11):
    return [model.tokenize(_texts(n, seed)) for seed in range(columns)]


def _loss_and_grads(loss, model, features):
    model.zero_grad()
    torch.manual_seed(5)  # dropout: the same masks for both losses
    value = loss(features, None)
    value.backward()
    return value.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("kind", ["plain", "cached"])
def test_losses_on_an_encoder_equal_sentence_transformers(kind, model_dir):
    model = _model(model_dir)
    model.train()  # dropout on: the cached loss replays its random state
    features = _features(model, 3)
    if kind == "plain":
        theirs = losses.MultipleNegativesRankingLoss(model, scale=20.0)
        ours = fst.FusedMultipleNegativesRankingLoss(model, scale=20.0)
    else:  # mini-batches of 4 rows for a batch of 11
        options = dict(scale=20.0, mini_batch_size=4, directions=("query_to_doc", "doc_to_query"))
        theirs = losses.CachedMultipleNegativesRankingLoss(model, **options)
        ours = fst.FusedCachedMultipleNegativesRankingLoss(model, **options)
    want, want_grads = _loss_and_grads(theirs, model, features)
    got, got_grads = _loss_and_grads(ours, model, features)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(got_grads) == len(want_grads) > 0
    for x, r in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(x, r, rtol=1e-4, atol=1e-6)


def test_cached_loss_step_memory_follows_the_mini_batch(model_dir, monkeypatch):
    """The cached loss's fused calls run with their working memory tuned to
    ``mini_batch_size`` rows of fp32 logits against every document (64 MiB at least), and only
    within the call."""
    from fusedloss.core import config

    seen = []
    original = fst.multiple_negatives_ranking_loss

    def spy(*args, **kwargs):
        t = config.tuning()
        seen.append((t.lm_head_chunk_bytes, t.scratch_mb, t.materialized_bytes,
                     t.torch_chunk_elements))
        return original(*args, **kwargs)

    monkeypatch.setattr(fst, "multiple_negatives_ranking_loss", spy)
    model = _model(model_dir)
    before = config.tuning()
    loss = fst.FusedCachedMultipleNegativesRankingLoss(model, scale=20.0, mini_batch_size=4)
    loss(_features(model, 3), None).backward()  # 11 queries, 2 × 11 documents: the floor
    floor = fst.MIN_LOSS_BYTES
    assert seen == [(floor, floor / 2**20, floor, floor // 4)]
    assert config.tuning() == before
    seen.clear()
    big = fst.FusedCachedMultipleNegativesRankingLoss(model, scale=20.0, mini_batch_size=4)
    big.mini_batch_size = floor  # a budget above the floor: mini_batch_size rows × 22 documents
    big(_features(model, 3), None).backward()
    assert seen == [(floor * 88, floor * 88 / 2**20, floor * 88, floor * 22)]


def test_fused_loss_swaps_each_loss_with_its_settings(model_dir):
    model = _model(model_dir)
    cases = [
        losses.MultipleNegativesRankingLoss(model, scale=30.0, similarity_fct=dot_score,
                                            directions=("query_to_doc", "doc_to_query"),
                                            partition_mode="per_direction"),
        losses.MultipleNegativesSymmetricRankingLoss(model, scale=15.0),
        losses.CachedMultipleNegativesRankingLoss(model, scale=25.0, mini_batch_size=3)]
    for original in cases:
        fused = fst.fused_loss(original)
        assert type(fused).__mro__[1] is type(original) and fused.model is model
        assert fused.get_config_dict() == original.get_config_dict()
        assert fused.similarity_fct is original.similarity_fct


@pytest.mark.parametrize("make, match", [
    (lambda m: losses.MultipleNegativesRankingLoss(
        m, gather_across_devices=True, hardness_mode="hard_negatives", hardness_strength=5.0),
     "gather_across_devices"),
    (lambda m: losses.MultipleNegativesRankingLoss(
        m, gather_across_devices=True, directions=("query_to_doc", "query_to_query")),
     "gather_across_devices"),
    (lambda m: losses.MultipleNegativesRankingLoss(m, similarity_fct=lambda a, b: a @ b.T),
     "similarity_fct"),
    (lambda m: losses.CoSENTLoss(m), "no fused counterpart"),
])
def test_fused_loss_refuses_what_it_does_not_support(make, match, model_dir):
    with pytest.raises(ValueError, match=match):
        fst.fused_loss(make(_model(model_dir)))


def test_trainer_steps_equal_sentence_transformers(model_dir, tmp_path):
    """Two steps of ``SentenceTransformerTrainer`` (same seed, dropout on) with
    sentence-transformers' loss and with the fused one log the same losses."""
    Dataset = pytest.importorskip("datasets").Dataset
    from sentence_transformers import (
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )

    data = Dataset.from_dict({"anchor": _texts(16, 1), "positive": _texts(16, 2),
                              "negative": _texts(16, 3)})
    logged = {}
    for name, make in (("theirs", losses.MultipleNegativesRankingLoss),
                       ("ours", fst.FusedMultipleNegativesRankingLoss)):
        model = _model(model_dir)
        args = SentenceTransformerTrainingArguments(
            output_dir=str(tmp_path / name), per_device_train_batch_size=8, max_steps=2,
            logging_steps=1, seed=3, report_to=[], save_strategy="no", use_cpu=True,
            dataloader_drop_last=True)
        trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data,
                                             loss=make(model, scale=20.0))
        trainer.train()
        logged[name] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged["ours"]) == 2
    torch.testing.assert_close(torch.tensor(logged["ours"]), torch.tensor(logged["theirs"]),
                               rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------
# gather_across_devices: the ring against sentence-transformers' all-gather, gloo


def _gathered_on_rank(rank, world, directions, mode):
    """This rank's loss and local embedding gradients, sentence-transformers' and ours."""
    g = torch.Generator().manual_seed(100 + rank)
    emb = [torch.randn(5, E, generator=g) for _ in range(3)]
    out = {}
    for name, cls in (("theirs", losses.MultipleNegativesRankingLoss),
                      ("ours", fst.FusedMultipleNegativesRankingLoss)):
        leaves = [t.clone().requires_grad_() for t in emb]
        loss = cls(torch.nn.Module(), scale=20.0, gather_across_devices=True,
                   directions=directions, partition_mode=mode).compute_loss_from_embeddings(
                       leaves, None)
        out[name] = (loss.detach(), torch.autograd.grad(loss, leaves))
    return out


@pytest.mark.parametrize("directions, mode", [
    (DIRECTIONS["q2d"], "joint"), (DIRECTIONS["symmetric"], "per_direction"),
    (DIRECTIONS["symmetric"], "joint")])
def test_gather_across_devices_on_the_ring(directions, mode, workers):
    from workers import all_ok

    for result in all_ok(workers(2).run(_gathered_on_rank, directions, mode)):
        (want, want_grads), (got, got_grads) = result["theirs"], result["ours"]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for x, r in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(x, r, rtol=1e-4, atol=1e-6)
