"""Turning a trained Transformer into token ids: greedy decoding."""

import torch


@torch.no_grad()
def greedy(logits_of, batch_size: int, device, bos: int, eos: int, pad: int, max_len: int,
           all_done=bool) -> list[list[int]]:
    """Greedy hypotheses (ids without BOS/EOS) for a batch.

    ``logits_of(prefix)`` maps the ``[B, t]`` target prefix to ``[B, t, vocab]`` logits: a DeepSpeed engine's
    full forward in the training loop, or ``model.decode`` on a precomputed memory. ``all_done(local_done)``
    decides when to stop; in a ZeRO-3 job every rank must keep running the model until all are done
    (DeepSpeed issue 860), so the training loop passes a collective here.
    """
    ys = torch.full((batch_size, 1), bos, dtype=torch.long, device=device)
    finished = torch.zeros(batch_size, dtype=torch.bool, device=device)
    while not all_done(bool(finished.all())):  # a rank past its own max_len steps on, emitting padding
        next_token = logits_of(ys)[:, -1].argmax(dim=-1).masked_fill(finished, pad)
        ys = torch.cat([ys, next_token[:, None]], dim=1)
        finished |= next_token == eos
        if ys.size(1) > max_len:
            finished.fill_(True)
    hypotheses = []
    for row in ys[:, 1:].tolist():
        hypotheses.append(row[: row.index(eos)] if eos in row else [t for t in row if t != pad])
    return hypotheses
