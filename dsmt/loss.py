"""Label-smoothed cross-entropy of the output projection, summed over real target tokens (the caller normalizes).

A batch's logits (tokens × vocabulary) are a training step's largest tensors: at 4k target tokens and an 8k
vocabulary, 131 MB each for the logits, their log-probabilities and their gradients, with a dozen memory-bound
passes over them. Here projection, loss and gradient are computed together, a cache-sized chunk of rows at a
time and only at positions whose target is not padding. The gradients with respect to the hidden states and the
weight are formed during the forward, as Liger Kernel's fused linear cross-entropy does; backward only scales them.
"""

import torch

# Logits per chunk. On a CPU, 32 MB in fp32: about its last-level cache, so the chunk's passes stay in cache.
CHUNK_LOGITS = 2 ** 23
# A GPU has no such cache to fit; chunking there only bounds memory (512 MB in fp32), while every chunk re-reads
# the output weight and writes its fp32 gradient. At 4096 rows per chunk (32k vocabulary) that is ~5% of the
# chunk's own logits traffic and the matmuls stay large, where 32 MB chunks (256 rows) would re-read the weight
# 16 times as often: a transformer_big micro-batch of ~4k target tokens per GPU is one chunk.
ACCELERATOR_CHUNK_LOGITS = 2 ** 27


def chunk_logits(device: torch.device) -> int:
    return CHUNK_LOGITS if device.type == "cpu" else ACCELERATOR_CHUNK_LOGITS


def label_smoothed_nll(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, epsilon: float, pad_id: int):
    """(smoothed loss, nll) of the logits ``hidden @ weight.T``, each summed over positions where ``target`` is not pad.

    The loss equals ``F.cross_entropy(logits, target, ignore_index=pad_id, label_smoothing=epsilon, reduction="sum")``
    and is differentiable in ``hidden`` and ``weight``; the NLL (for perplexity) is not differentiable. Padded
    targets are weighted by zero rather than indexed out: a boolean index would make a GPU's host wait for the
    count (the model has packed its rows already, so few or none are padding).
    """
    hidden, target = hidden.flatten(0, -2), target.flatten()
    real = (target != pad_id)[:, None]
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedLoss.apply(hidden, weight, target, real, epsilon)
    loss, nll, _, _ = _chunked(hidden, weight, target, real, epsilon, gradients=False)
    return loss, nll


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, real, epsilon):
        loss, nll, grad_hidden, grad_weight = _chunked(hidden, weight, target, real, epsilon, gradients=True)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = hidden.dtype, weight.dtype
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss, _grad_nll):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        return (grad_hidden * grad_loss).to(hidden_dtype), (grad_weight * grad_loss).to(weight_dtype), None, None, None


def _chunked(hidden, weight, target, real, epsilon: float, gradients: bool):
    """Loss and nll sums; with ``gradients``, also d loss / d hidden and d loss / d weight. All in fp32 at least:
    mixed-precision gradients are formed here before any loss scaling, so they must not underflow.

    Per row, with lse the log-sum-exp of the logits x: nll = lse - x[target], and the smoothed loss is
    (1 - ε)·nll + ε·(lse - mean(x)). The chunk is passed over four times (max, subtract, exp, sum): mean(x) is
    hidden · mean(weight), and the softmax's 1/sum and the gradient's -ε/V are applied on the small side of the
    gradient matmuls, d logits = (exp - (1 - ε)·sum·onehot(target)) / sum - ε/V. A row whose target is padding
    (``real`` false) is multiplied by zero there and in the sums.
    """
    vocab, exact = weight.size(0), torch.promote_types(weight.dtype, torch.float32)
    rows = max(1, chunk_logits(hidden.device) // vocab)
    weight_mean = weight.to(exact).mean(0)
    loss = nll = torch.zeros((), dtype=exact, device=hidden.device)
    grad_hidden = torch.empty(hidden.shape, dtype=exact, device=hidden.device) if gradients else None
    grad_weight = torch.zeros(weight.shape, dtype=exact, device=weight.device) if gradients else None
    real_hidden_sum = torch.zeros(hidden.size(1), dtype=exact, device=hidden.device)
    for start in range(0, hidden.size(0), rows):
        h, y, keep = hidden[start:start + rows], target[start:start + rows, None], real[start:start + rows].to(exact)
        logits = (h @ weight.t()).to(exact)
        target_logit = logits.gather(1, y)
        top = logits.amax(1, keepdim=True)
        exp = logits.sub_(top).exp_()  # in place: the chunk's only buffer
        total = exp.sum(1, keepdim=True)
        lse = top + total.log()
        chunk_nll = ((lse - target_logit) * keep).sum()
        nll = nll + chunk_nll
        smoothing = ((lse - h.to(exact) @ weight_mean[:, None]) * keep).sum()
        loss = loss + (1.0 - epsilon) * chunk_nll + epsilon * smoothing
        if gradients:
            exp.scatter_add_(1, y, total * (epsilon - 1.0))
            exp, inverse_total = exp.to(weight.dtype), keep / total
            grad_hidden[start:start + rows] = (exp @ weight) * inverse_total - (epsilon * keep) * weight_mean
            grad_weight += exp.t() @ (h * inverse_total).to(weight.dtype)
            real_hidden_sum += (h.to(exact) * keep).sum(0)
    if gradients:
        grad_weight.sub_(epsilon / vocab * real_hidden_sum)
    return loss, nll, grad_hidden, grad_weight
