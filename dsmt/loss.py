"""Label-smoothed cross-entropy, summed over real target tokens (the caller normalizes)."""

import torch
import torch.nn.functional as F


def label_smoothed_nll(logits: torch.Tensor, target: torch.Tensor, epsilon: float, pad_id: int):
    """(smoothed loss, nll), each summed over non-pad positions of ``target``.

    Equals ``F.cross_entropy(..., label_smoothing=epsilon, reduction="sum")`` but shares one log-softmax
    with the NLL that perplexity needs.
    """
    lprobs = F.log_softmax(logits.float(), dim=-1).flatten(0, -2)
    target = target.flatten()
    nll = F.nll_loss(lprobs, target, ignore_index=pad_id, reduction="sum")
    uniform = -lprobs.mean(dim=-1)[target != pad_id].sum()
    return (1.0 - epsilon) * nll + epsilon * uniform, nll
