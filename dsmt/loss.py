"""Label-smoothed cross-entropy of the output projection, summed over real target tokens (the caller normalizes).

A batch's logits (tokens × vocabulary) are a training step's largest tensors: at 4k target tokens and an 8k
vocabulary, 131 MB each for the logits, their log-probabilities and their gradients, with a dozen memory-bound
passes over them. Here projection, loss and gradient are computed together, a cache-sized chunk of rows at a
time and only at positions whose target is not padding. The gradients with respect to the hidden states and the
weight are formed during the forward, as Liger Kernel's fused linear cross-entropy does; backward only scales them.
"""

import torch

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
    mixed-precision gradients are formed here before any loss scaling, so they must not underflow.

    Per row, with lse the log-sum-exp of the logits x: nll = lse - x[target], and the smoothed loss is
    (1 - ε)·nll + ε·(lse - mean(x)). The chunk is passed over four times (max, subtract, exp, sum): mean(x) is
    hidden · mean(weight), and the softmax's 1/sum and the gradient's -ε/V are applied on the small side of the
    gradient matmuls, d logits = (exp - (1 - ε)·sum·onehot(target)) / sum - ε/V.
    """
    vocab, exact = weight.size(0), torch.promote_types(weight.dtype, torch.float32)
    rows = max(1, CHUNK_LOGITS // vocab)
    weight_mean = weight.to(exact).mean(0)
    loss = nll = torch.zeros((), dtype=exact, device=hidden.device)
    grad_hidden = torch.empty(hidden.shape, dtype=exact, device=hidden.device) if gradients else None
    grad_weight = torch.zeros(weight.shape, dtype=exact, device=weight.device) if gradients else None
    for start in range(0, hidden.size(0), rows):
        h, y = hidden[start:start + rows], target[start:start + rows, None]
        logits = (h @ weight.t()).to(exact)
        target_logit = logits.gather(1, y)
        top = logits.amax(1, keepdim=True)
        exp = logits.sub_(top).exp_()  # in place: the chunk's only buffer
        total = exp.sum(1, keepdim=True)
        lse = top + total.log()
        chunk_nll = (lse - target_logit).sum()
        nll = nll + chunk_nll
        loss = loss + (1.0 - epsilon) * chunk_nll + epsilon * (lse.sum() - (h.to(exact) @ weight_mean).sum())
        if gradients:
            exp.scatter_add_(1, y, total * (epsilon - 1.0))
            exp, inverse_total = exp.to(weight.dtype), 1.0 / total
            grad_hidden[start:start + rows] = (exp @ weight) * inverse_total - epsilon * weight_mean
            grad_weight += exp.t() @ (h * inverse_total).to(weight.dtype)
    if gradients:
        grad_weight.sub_(epsilon / vocab * hidden.sum(0, dtype=exact))
    return loss, nll, grad_hidden, grad_weight
