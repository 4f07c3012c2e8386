"""Turning a trained Transformer into token ids: greedy decoding."""

import torch


def forbid_pad_and_bos(logits: torch.Tensor, pad: int, bos: int) -> None:
    """Neither is ever a next token: padding only follows a finished sentence, BOS only starts one."""
    logits[:, [pad, bos]] = float("-inf")


@torch.no_grad()
def max_output_length(source_length: int, a: float, b: int, max_positions: int) -> int:
    """Hypotheses stop at ``a`` × source length + ``b`` tokens, and never beyond the model's positions."""
    return min(int(a * source_length + b), max_positions)


def greedy(logits_of, batch_size: int, device, bos: int, eos: int, pad: int, max_len: int) -> list[list[int]]:
    """Greedy hypotheses (ids without BOS/EOS) for a batch.

    ``logits_of(prefix)`` maps the ``[B, t]`` target prefix to ``[B, t, vocab]`` logits (``cached_logits``, or
    ``model.decode`` on a precomputed memory). It must not enter a collective: ranks decode different batches
    for different numbers of steps (ZeRO-3 training validates with whole gathered parameters for that reason).
    """
    ys = torch.full((batch_size, 1), bos, dtype=torch.long, device=device)
    finished = torch.zeros(batch_size, dtype=torch.bool, device=device)
    while not bool(finished.all()):
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


def cached_logits(model, src: torch.Tensor, padding=None):
    """``prefix -> logits`` for ``greedy`` that decodes incrementally: the memory of ``src`` is encoded once,
    and each call runs the decoder on the prefix's newest token only, with the key/value cache. ``padding``
    (a ``dsmt.model.Padding`` of the batch, optional) spares the source mask when there is no source padding."""
    memory, cache = model.encode(src, padding), model.empty_cache()
    return lambda prefix: model.decode(prefix[:, -1:], memory, src, cache, padding=padding)


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
    recomputes the decoder over the whole prefix at every step (the baseline the cache is measured against).

    Each step is tensor operations on the device; the host reads one flag per step (are all sentences done?)
    and, at the end, the step-by-step choices, from which it rebuilds the ended hypotheses (``_Hypotheses``).
    """
    batch, vocab, device = src.size(0), model.output.out_features, src.device
    memory = model.encode(src).repeat_interleave(beam, dim=0)
    src = src.repeat_interleave(beam, dim=0)
    cache = model.empty_cache() if use_cache else None
    tokens = torch.full((batch * beam, 1), bos, dtype=torch.long, device=device)
    scores = torch.full((batch, beam), float("-inf"), device=device)
    scores[:, 0] = 0.0  # every beam starts as the same BOS: expand only the first
    ended = torch.zeros(batch, dtype=torch.long, device=device)  # hypotheses ended so far, per sentence
    first_row = torch.arange(batch, device=device)[:, None] * beam
    rank = torch.arange(2 * beam, device=device)
    history = _Hypotheses(beam)
    for step in range(max_len):
        logits = model.decode(tokens[:, -1:], memory, src, cache) if use_cache else model.decode(tokens, memory, src)
        logits = logits[:, -1].float()
        forbid_pad_and_bos(logits, pad, bos)  # before normalizing: the scores are over tokens that can be emitted
        lprobs = torch.log_softmax(logits, dim=-1)
        candidates = (scores[:, :, None] + lprobs.view(batch, beam, vocab)).view(batch, -1)
        top_scores, top_ids = candidates.topk(2 * beam, dim=1)  # ≥ beam are not EOS
        rows, next_tokens = first_row + top_ids // vocab, top_ids % vocab
        possible = top_scores > float("-inf")
        # An ending counts only if it is among the best `beam` candidates, in rank order, while its sentence has
        # room for it; the sentence is then done once `beam` have ended.
        ending = possible & (next_tokens == eos) & (rank < beam) & (ended < beam)[:, None]
        ending &= ending.cumsum(1) <= (beam - ended)[:, None]
        ended += ending.sum(1)
        # The open beams are the best `beam` other candidates; a done sentence keeps `beam` dead rows (score
        # -inf), so that the batch keeps its shape.
        open_ = possible & (next_tokens != eos)
        pick = torch.where(open_, rank, rank + 2 * beam).argsort(dim=1)[:, :beam]
        alive = open_.gather(1, pick) & (ended < beam)[:, None]
        rows, next_tokens, top_scores_kept = (t.gather(1, pick) for t in (rows, next_tokens, top_scores))
        any_alive = alive[:, :1]
        filler_row = torch.where(any_alive, rows[:, :1], first_row)
        filler_token = torch.where(any_alive, next_tokens[:, :1], torch.full_like(next_tokens[:, :1], pad))
        order = torch.where(alive, rows, filler_row).flatten()
        chosen = torch.where(alive, next_tokens, filler_token).flatten()
        scores = torch.where(alive, top_scores_kept, float("-inf"))
        last = step == max_len - 1
        history.add(ending, top_ids // vocab + first_row, top_scores, order, chosen, alive if last else None, scores)
        if last or bool((ended >= beam).all()):
            break
        if use_cache:
            reorder_cache(cache, order)
        tokens = torch.cat([tokens.index_select(0, order), chosen[:, None]], dim=1)
    return [sorted(hyps, key=lambda h: -h[0])[:nbest] for hyps in history.finish(batch, lenpen)]


class _Hypotheses:
    """Beam search's record, kept on the device until the search ends: per step which candidates ended (their
    rows and scores) and which rows and tokens continued (``order``, ``chosen``), from which every ended
    hypothesis's tokens are rebuilt by following the rows back, and at the last step the beams still open."""

    def __init__(self, beam: int):
        self.beam, self.steps, self.open_at_end = beam, [], None

    def add(self, ending, rows, scores, order, chosen, open_at_end, open_scores) -> None:
        b = self.beam  # endings only come from the best `beam` candidates
        self.steps.append((ending[:, :b], rows[:, :b], scores[:, :b], order, chosen))
        if open_at_end is not None:
            self.open_at_end = (open_at_end, open_scores)

    def finish(self, batch: int, lenpen: float) -> list[list[tuple[float, list[int]]]]:
        ending, rows, scores, orders, chosen = (torch.stack(parts).cpu().tolist() for parts in zip(*self.steps))
        finished = [[] for _ in range(batch)]

        def prefix(step: int, row: int) -> list[int]:
            """The tokens after BOS of ``row`` as it stood at ``step`` (before that step's token)."""
            ids = []
            for earlier in range(step - 1, -1, -1):
                ids.append(chosen[earlier][row])
                row = orders[earlier][row]
            return ids[::-1]

        for step in range(len(ending)):
            for b in range(batch):
                for j in range(self.beam):
                    if ending[step][b][j]:
                        finished[b].append((scores[step][b][j] / length_penalty(step + 1, lenpen),
                                            prefix(step, rows[step][b][j])))
        if self.open_at_end is not None:  # out of length: the open beams end here, without EOS
            step, (alive, open_scores) = len(ending) - 1, (t.cpu().tolist() for t in self.open_at_end)
            for b in range(batch):
                for j in range(self.beam):
                    if alive[b][j]:
                        row = b * self.beam + j
                        finished[b].append((open_scores[b][j] / length_penalty(step + 1, lenpen),
                                            prefix(step + 1, row)))
        return finished
