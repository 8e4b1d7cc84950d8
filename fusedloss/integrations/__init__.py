"""Integrations of fusedloss with other libraries.

``fusedloss.integrations.transformers`` (extra ``fusedloss[hf]``): Hugging Face transformers'
causal LMs, patched so that training computes the loss with ``fusedloss.linear_cross_entropy``
without the logits::

    from fusedloss.integrations.transformers import apply_fusedloss
    apply_fusedloss(model)

Nothing here is imported by ``import fusedloss``: each integration imports its library itself.
"""
