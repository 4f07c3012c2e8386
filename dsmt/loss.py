"""Label-smoothed cross-entropy of the output projection, summed over real target tokens (the caller normalizes).

A batch's logits (tokens × vocabulary) are a training step's largest tensors: at 4k target tokens and an 8k
vocabulary, 131 MB each for the logits, their log-probabilities and their gradients, with a dozen memory-bound
passes over them. Here projection, loss and gradient are computed together, a cache-sized chunk of rows at a
time and only at positions whose target is not padding. The gradients with respect to the hidden states and the
weight are formed during the forward, as Liger Kernel's fused linear cross-entropy does; backward only scales them.
"""

import torch
import torch.nn.functional as F

CHUNK_LOGITS = 2 ** 23  # logits per chunk: 32 MB in fp32, about a CPU's last-level cache


def label_smoothed_nll(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, epsilon: float, pad_id: int):
    """(smoothed loss, nll) of the logits ``hidden @ weight.T``, each summed over positions where ``target`` is not pad.

    The loss equals ``F.cross_entropy(logits, target, ignore_index=pad_id, label_smoothing=epsilon, reduction="sum")``
    and is differentiable in ``hidden`` and ``weight``; the NLL (for perplexity) is not differentiable.
    """
    keep = target.flatten() != pad_id
    hidden, target = hidden.flatten(0, -2)[keep], target.flatten()[keep]
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedLoss.apply(hidden, weight, target, epsilon)
    loss, nll, _, _ = _chunked(hidden, weight, target, epsilon, gradients=False)
    return loss, nll


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, epsilon):
        loss, nll, grad_hidden, grad_weight = _chunked(hidden, weight, target, epsilon, gradients=True)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = hidden.dtype, weight.dtype
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss, _grad_nll):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        return (grad_hidden * grad_loss).to(hidden_dtype), (grad_weight * grad_loss).to(weight_dtype), None, None


def _chunked(hidden, weight, target, epsilon: float, gradients: bool):
    """Loss and nll sums; with ``gradients``, also d loss / d hidden and d loss / d weight. All in fp32 at least:
    mixed-precision gradients are formed here before any loss scaling, so they must not underflow."""
    vocab, exact = weight.size(0), torch.promote_types(weight.dtype, torch.float32)
    rows = max(1, CHUNK_LOGITS // vocab)
    loss = nll = torch.zeros((), dtype=exact, device=hidden.device)
    grad_hidden = torch.empty(hidden.shape, dtype=exact, device=hidden.device) if gradients else None
    grad_weight = torch.zeros(weight.shape, dtype=exact, device=weight.device) if gradients else None
    for start in range(0, hidden.size(0), rows):
        h, y = hidden[start:start + rows], target[start:start + rows, None]
        lprobs = F.log_softmax((h @ weight.t()).to(exact), dim=-1)
        chunk_nll = -lprobs.gather(1, y).sum()
        nll = nll + chunk_nll
        loss = loss + (1.0 - epsilon) * chunk_nll - epsilon / vocab * lprobs.sum()
        if gradients:
            # d loss / d logits = softmax - (1 - ε)·onehot(target) - ε/V, built in place over the log-probabilities.
            grad_logits = lprobs.exp_().sub_(epsilon / vocab)
            grad_logits.scatter_add_(1, y, grad_logits.new_full(y.shape, epsilon - 1.0))
            grad_logits = grad_logits.to(weight.dtype)
            grad_hidden[start:start + rows] = grad_logits @ weight
            grad_weight += grad_logits.t() @ h
    return loss, nll, grad_hidden, grad_weight
