"""Each loss family's math, written once: the loss from the core's statistics, the
coefficients of its gradient, the logits it asks the core for.

The single-GPU ops (``fusedloss/ops``) and the distributed layer (``fusedloss/distributed``)
both call these, so that a fix to a formula reaches every path. Plain PyTorch on tensors, no
kernels and no policy.
"""
