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
                / _chunked_backward                 loss, its gradients formed in the forward;
                                                    for a few rows in the backward op)
    fusedloss::linear_log_probs / _backward        (ops/log_probs.py: token log-probs and
                                                    entropies, for RL and preference losses)
    fusedloss::linear_divergence / _backward       (ops/distillation.py: KL and JSD between a
    fusedloss::linear_divergence_reduced            student's and a teacher's heads; the reduced
    fusedloss::linear_top_k_kl / _backward          loss's training path; offline top-k KL)
    fusedloss::contrastive / _backward             (ops/contrastive.py: CLIP, InfoNCE, NT-Xent,
                                                    SigLIP)
    fusedloss::contrastive_materialized / _backward   (the same at small sizes, two launches
                                                    a side: core/materialized.py)
    fusedloss::siglip_chunked                      (SigLIP's training path on cuBLAS chunks:
                                                    core/chunked_contrastive.py; a reduced fp32
                                                    InfoNCE takes linear_cross_entropy_chunked)
    fusedloss::grpo_loss_fused, dpo_loss_fused,    (ops/post_training.py: the preference and RL
    cpo_loss_fused, kto_loss_fused                  losses fused into the head)
    fusedloss::scaled_gradient                     (ops/cross_entropy.py: a gradient formed in
                                                    the forward times the upstream gradient,
                                                    rounded once)

With default options no op reads a value back to the host, so the CPU runs ahead of the GPU
and Inductor's CUDA graphs (``mode="reduce-overhead"``) capture them with the rest of a step.
What needs values is opt-in: ``Tuning.check_values`` (argument checks that raise instead of
giving NaN) and filtering's sparse slabs (each slab's live count; every slab runs dense while
a graph is captured).
"""

from . import contrastive, cross_entropy, log_probs

__all__ = ["contrastive", "cross_entropy", "log_probs"]
