"""Integrations of fusedloss with other libraries.

``fusedloss.integrations.transformers`` (extra ``fusedloss[hf]``): Hugging Face transformers'
causal LMs, patched so that training computes the loss with ``fusedloss.linear_cross_entropy``
without the logits::

    from fusedloss.integrations.transformers import apply_fusedloss
    apply_fusedloss(model)

``fusedloss.integrations.trl``: TRL's trainers (SFT, DPO, KTO, GRPO, RLOO) compute their
per-token log-probabilities with fusedloss's core instead of TRL's chunked head::

    from fusedloss.integrations.trl import apply_fusedloss_to_trl
    apply_fusedloss_to_trl()

``fusedloss.integrations.sentence_transformers`` (extra ``fusedloss[st]``): sentence-transformers'
MultipleNegativesRankingLoss, its symmetric and its cached variants without the similarity
matrix::

    from fusedloss.integrations.sentence_transformers import fused_loss
    loss = fused_loss(losses.MultipleNegativesRankingLoss(model))

Nothing here is imported by ``import fusedloss``: each integration imports its library itself.
"""
