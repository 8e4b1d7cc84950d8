"""The losses' host functions, registered as ``torch.library`` custom ops.

Each loss family has two ops over the engine (``fusedloss/core``): a forward that returns the
per-row losses *and* the statistics its backward needs, and a backward that turns them into
gradients. ``torch.compile`` sees each op as one opaque node (the bodies may read GPU values,
plan slabs and launch Triton kernels), shapes come from a fake implementation, and
``register_autograd`` wires the backward op in, so a loss traces into a graph with no break,
under ``fullgraph=True`` and dynamic shapes alike. The functional API (``fusedloss/losses``)
validates arguments, shapes the inputs and reduces the per-row losses around these ops, in
plain traceable PyTorch.

    fusedloss::linear_cross_entropy / _backward    (ops/cross_entropy.py)
    fusedloss::linear_cross_entropy_chunked        (the LM head's training path: a reduced
                                                    loss, its gradients formed in the forward)
    fusedloss::contrastive / _backward             (ops/contrastive.py: CLIP, InfoNCE, NT-Xent,
                                                    SigLIP)

The ops wait for the GPU where the engine does (the LM head's target check and the backward's
live-tile counts), so they are tagged ``cudagraph_unsafe``: under ``mode="reduce-overhead"``
Inductor keeps them out of its CUDA graphs.
"""

from . import contrastive, cross_entropy

__all__ = ["contrastive", "cross_entropy"]
