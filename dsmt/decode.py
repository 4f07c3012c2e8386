"""Turning a trained Transformer into token ids: greedy decoding."""

import torch


def forbid_pad_and_bos(logits: torch.Tensor, pad: int, bos: int) -> None:
    """Neither is ever a next token: padding only follows a finished sentence, BOS only starts one."""
    logits[:, [pad, bos]] = float("-inf")


@torch.no_grad()
def max_output_length(source_length: int, a: float, b: int, max_positions: int) -> int:
    """Hypotheses stop at ``a`` × source length + ``b`` tokens, and never beyond the model's positions."""
    return min(int(a * source_length + b), max_positions)


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
        logits = logits_of(ys)[:, -1]
        forbid_pad_and_bos(logits, pad, bos)
        next_token = logits.argmax(dim=-1).masked_fill(finished, pad)
        ys = torch.cat([ys, next_token[:, None]], dim=1)
        finished |= next_token == eos
        if ys.size(1) > max_len:
            finished.fill_(True)
    hypotheses = []
    for row in ys[:, 1:].tolist():
        hypotheses.append(row[: row.index(eos)] if eos in row else [t for t in row if t != pad])
    return hypotheses


def cached_logits(model, src: torch.Tensor):
    """``prefix -> logits`` for ``greedy`` that decodes incrementally: the memory of ``src`` is encoded once,
    and each call runs the decoder on the prefix's newest token only, with the key/value cache."""
    memory, cache = model.encode(src), model.empty_cache()
    return lambda prefix: model.decode(prefix[:, -1:], memory, src, cache)


def reorder_cache(cache: list[dict], order: torch.Tensor) -> None:
    """Make row i of every cached tensor the old row ``order[i]`` (beam search keeps the surviving beams)."""
    for layer in cache:
        for kind in layer.values():
            for name, tensor in kind.items():
                kind[name] = tensor.index_select(0, order)


def length_penalty(length: int, alpha: float) -> float:
    """GNMT's ((5 + length) / 6) ** alpha (Wu et al., 2016)."""
    return ((5.0 + length) / 6.0) ** alpha


@torch.no_grad()
def beam_search(model, src: torch.Tensor, bos: int, eos: int, pad: int, beam: int, lenpen: float, max_len: int,
                nbest: int = 1, use_cache: bool = True) -> list[list[tuple[float, list[int]]]]:
    """Batched beam search; per sentence the ``nbest`` best (score, ids), the score being the sum of token
    log-probabilities divided by the GNMT length penalty. A sentence stops once ``beam`` hypotheses have
    ended; hypotheses still open after ``max_len`` tokens end there without EOS. ``use_cache=False``
    recomputes the decoder over the whole prefix at every step (the baseline the cache is measured against)."""
    batch, vocab, device = src.size(0), model.output.out_features, src.device
    memory = model.encode(src).repeat_interleave(beam, dim=0)
    src = src.repeat_interleave(beam, dim=0)
    cache = model.empty_cache() if use_cache else None
    tokens = torch.full((batch * beam, 1), bos, dtype=torch.long, device=device)
    scores = torch.full((batch, beam), float("-inf"), device=device)
    scores[:, 0] = 0.0  # every beam starts as the same BOS: expand only the first
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(batch)]
    for step in range(max_len):
        logits = model.decode(tokens[:, -1:], memory, src, cache) if use_cache else model.decode(tokens, memory, src)
        lprobs = torch.log_softmax(logits[:, -1].float(), dim=-1)
        forbid_pad_and_bos(lprobs, pad, bos)
        candidates = (scores[:, :, None] + lprobs.view(batch, beam, vocab)).view(batch, -1)
        top_scores, top_ids = (t.tolist() for t in candidates.topk(2 * beam, dim=1))  # ≥ beam are not EOS
        survivors = []
        for b in range(batch):
            kept = []
            if len(finished[b]) < beam:
                for rank, (score, flat) in enumerate(zip(top_scores[b], top_ids[b])):
                    row, token = b * beam + flat // vocab, flat % vocab
                    if score == float("-inf") or len(kept) == beam:
                        break
                    if token != eos:
                        kept.append((row, token, score))
                    elif rank < beam:  # an ending counts only if it is among the best `beam` candidates
                        ids = tokens[row, 1:].tolist()
                        finished[b].append((score / length_penalty(len(ids) + 1, lenpen), ids))
                        if len(finished[b]) == beam:
                            kept = []
                            break
                if step == max_len - 1:  # out of length: the open beams end here, without EOS
                    finished[b] += [(score / length_penalty(step + 1, lenpen), tokens[row, 1:].tolist() + [token])
                                    for row, token, score in kept]
            # A finished sentence keeps `beam` dead rows so that the batch keeps its shape.
            kept = kept or [(b * beam, pad, float("-inf"))]
            survivors += kept + [kept[0][:2] + (float("-inf"),)] * (beam - len(kept))
        if step == max_len - 1 or all(len(f) >= beam for f in finished):
            break
        rows, next_tokens, next_scores = zip(*survivors)
        order = torch.tensor(rows, device=device)
        if use_cache:
            reorder_cache(cache, order)
        tokens = torch.cat([tokens.index_select(0, order), torch.tensor(next_tokens, device=device)[:, None]], dim=1)
        scores = torch.tensor(next_scores, device=device).view(batch, beam)
    return [sorted(hyps, key=lambda h: -h[0])[:nbest] for hyps in finished]
