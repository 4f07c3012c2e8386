"""Subword regularization: the training text segmented anew every epoch by n-best sampling (Kudo, 2018) of
the unigram sentencepiece model, while evaluation keeps the prepared ids.

A sentence's segmentation in an epoch depends only on (seed, epoch, side, sentence index): every rank count,
rerun and resume sees the same one. The draw is dsmt's own, from sentencepiece's deterministic n-best list:
sentencepiece's built-in sampling draws from a generator seeded per process (the same seed gives other
segmentations in another process). An epoch is planned from its sampled lengths (one pass over the text, kept
as memory-mapped UTF-8 by prepare), so token batches stay exact; that pass's ids are then kept for this rank's
sentences only, which its batches are built from. Several ranks share that pass: each segments every
world-th sentence and the ranks exchange the lengths (``dsmt.data.batching.BatchStream``).
"""

import ctypes
import itertools
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import sentencepiece as spm

from dsmt import DsmtError

SIDES = {"src": 0, "tgt": 1}
SEGMENT_BLOCK = 128  # sentences drawn at once, by one thread (larger blocks measured slower: more live objects)
COPY_CHUNK = 1 << 14  # sentences copied at once by copy_sentences: its index takes a few MB
# glibc's, looked up once; musl has none, and other systems' allocators return freed pages themselves
MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform == "linux" else None


def trim_heap() -> None:
    """Hand the pages of freed arrays back to the system (glibc's ``malloc_trim``; elsewhere nothing). A pass
    frees thousands of per-block arrays once it joins them, and the old ids once they are copied: glibc keeps
    such pages (its mmap threshold grows to the largest array freed, so later ones come from the heap), about
    100 MB a rank after an epoch's pass at 1M pairs, growing with the corpus."""
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)


def sentence_uniforms(seed: int, epoch: int, side: str, indices) -> np.ndarray:
    """One uniform draw in [0, 1) per sentence: splitmix64 of the index offset by a key of (seed, epoch, side),
    so neighbouring sentences and epochs get unrelated draws."""
    key = np.random.SeedSequence([seed, epoch, SIDES[side]]).generate_state(1, np.uint64)[0]
    x = np.asarray(indices, np.uint64) + key + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return ((x ^ (x >> np.uint64(31))) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


class SubwordSampler:
    """Sampled segmentations of a prepared training split, for the sides in ``sides`` ("src", "tgt" or
    "both"); the other side, and any sampled segmentation longer than ``max_len`` tokens (which would not fit
    a batch or the model), keep the prepared ids. A pass over many sentences runs on ``threads`` threads."""

    def __init__(self, data, data_dir: str, sides: str, alpha: float, nbest: int, seed: int, max_len: int,
                 threads: int = 1):
        meta, folder = data.meta, Path(data_dir)
        if meta["format"] < 2:
            raise DsmtError(f"{data_dir} was prepared by an older dsmt and holds no training text, which "
                            "data.subword_sampling segments; run `dsmt prepare` again into a new --out")
        if meta["model_type"] != "unigram":
            raise DsmtError(f"data.subword_sampling draws among a unigram model's segmentations and {data_dir} "
                            f"has a {meta['model_type']} model; prepare with --model-type unigram (the default)")
        self.data, self.alpha, self.nbest, self.seed, self.max_len = data, alpha, nbest, seed, max_len
        self.threads = threads
        self.sides = ("src", "tgt") if sides == "both" else (sides,)
        self.text, self.processors, self.log_probs = {}, {}, {}
        for side in self.sides:
            stem = folder / f"train.{meta[side]}"
            self.text[side] = (np.load(f"{stem}.utf8.npy", mmap_mode="r"),
                               np.load(f"{stem}.utf8_offsets.npy", mmap_mode="r"))
            sp = spm.SentencePieceProcessor(model_file=str(folder / meta["spm"][meta[side]]))
            self.processors[side] = sp
            self.log_probs[side] = np.array([sp.get_score(i) for i in range(sp.vocab_size())])

    def _draw_block(self, epoch: int, side: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The sampled ids of a block of sentences end to end, and their lengths: for each, one of its ``nbest``
        best segmentations, drawn with probability ∝ P(x)^alpha. sentencepiece's n-best search (most of the
        time, run without Python's lock) is called per sentence; the draws are made for the block at once."""
        text, offsets = self.text[side]
        nbests = [self.processors[side].nbest_encode_as_ids(text[offsets[i]:offsets[i + 1]].tobytes().decode("utf-8"),
                                                            self.nbest) for i in indices]
        counts = np.fromiter(map(len, nbests), np.int64, len(nbests))
        candidates = list(itertools.chain.from_iterable(nbests))
        lengths = np.fromiter(map(len, candidates), np.int64, len(candidates))
        pieces = np.fromiter(itertools.chain.from_iterable(candidates), np.int64, int(lengths.sum()))
        # log P of each candidate, one row per sentence (-inf pads: weight 0). An empty segmentation (a sentence
        # that normalizes to nothing has only that one) gets any finite value: the appended 0 keeps reduceat in range.
        first = np.cumsum(counts) - counts
        rows, columns = np.repeat(np.arange(len(nbests)), counts), np.arange(len(candidates)) - np.repeat(first, counts)
        log_p = np.full((len(nbests), int(counts.max(initial=1))), -np.inf)
        log_p[rows, columns] = np.add.reduceat(np.append(self.log_probs[side][pieces], 0.0), np.cumsum(lengths) - lengths)
        weights = np.cumsum(np.exp(self.alpha * (log_p - log_p.max(axis=1, keepdims=True))), axis=1)
        threshold = sentence_uniforms(self.seed, epoch, side, indices) * weights[:, -1]
        chosen = first + (weights <= threshold[:, None]).sum(axis=1)
        ids = [candidates[k] if lengths[k] <= self.max_len else self.data.tokens(side, i)
               for k, i in zip(chosen, indices)]
        sizes = np.fromiter(map(len, ids), np.int64, len(ids))
        return np.fromiter(itertools.chain.from_iterable(ids), self.data.src_ids.dtype, int(sizes.sum())), sizes

    def segment(self, epoch: int, side: str, indices) -> tuple[np.ndarray, np.ndarray]:
        """The sampled ids of ``indices`` end to end, and the offsets where each sentence's start (one more than
        ``indices``: the end). Blocks of sentences are drawn on ``threads`` threads, in the same order: the
        result does not depend on the thread count."""
        indices = np.asarray(indices, np.int64)
        blocks = [indices[k:k + SEGMENT_BLOCK] for k in range(0, len(indices), SEGMENT_BLOCK)]
        with ThreadPoolExecutor(self.threads, thread_name_prefix="dsmt-sampling") as pool:
            drawn = list(pool.map(lambda block: self._draw_block(epoch, side, block), blocks))
        ids = np.concatenate([np.empty(0, self.data.src_ids.dtype), *(ids for ids, _ in drawn)])
        offsets = np.concatenate([[0], np.cumsum(np.concatenate([np.empty(0, np.int64), *(n for _, n in drawn)]))])
        del drawn
        trim_heap()
        return ids, offsets


def copy_sentences(source: tuple[np.ndarray, np.ndarray], positions: np.ndarray,
                   target: tuple[np.ndarray, np.ndarray], places: np.ndarray, chunk: int = COPY_CHUNK) -> None:
    """Copy sentence ``positions[k]`` of ``source`` (ids end to end, offsets) into sentence ``places[k]`` of
    ``target``, whose offsets already give it room. ``chunk`` sentences are copied at a time: the copy's index
    takes 16 bytes a token (the ids take 2), which for all of a rank's WMT-sized share at once would be gigabytes."""
    (ids, offsets), (into, into_offsets) = source, target
    starts, lengths = offsets[positions], offsets[positions + 1] - offsets[positions]
    for first in range(0, len(positions), chunk):
        part = slice(first, first + chunk)
        counts = lengths[part]
        before = np.cumsum(counts) - counts  # each sentence's first token among this chunk's tokens
        token = np.arange(int(counts.sum()))
        into[np.repeat(into_offsets[places[part]] - before, counts) + token] = \
            ids[np.repeat(starts[part] - before, counts) + token]


class SampledPart:
    """One rank's share of an epoch's sampled pass: the sentences ``rank::world`` segmented (every sentence for
    ``world`` 1), with their sampled lengths. The ranks' parts together give every rank the whole epoch's
    lengths, which each rank needs to plan the same batches (``dsmt.data.batching.BatchStream``)."""

    def __init__(self, data, sampler: SubwordSampler, epoch: int, rank: int = 0, world: int = 1):
        self.epoch, self.indices = epoch, np.arange(rank, len(data), world)
        self.segments = {side: sampler.segment(epoch, side, self.indices) for side in sampler.sides}
        self.lengths = np.stack([np.diff(self.segments[side][1]) + 1 if side in self.segments  # + EOS
                                 else getattr(data, f"{side}_lens")[self.indices]
                                 for side in ("src", "tgt")]).astype(np.int32)


class SampledEpoch:
    """One epoch of ``data`` as the sampler segments it: the lengths its batches are planned from (``lengths``,
    2 × sentences: source and target, from one sampled pass over every sentence, made by this rank alone or
    shared among the ranks) and ``collate``. ``keep(indices)`` then keeps only those sentences' ids (this
    rank's, once the epoch is planned): those of ``part`` as they are, the others segmented then, so each
    sentence is segmented once an epoch by one rank, or twice where the rank that trains on it is not the one
    that measured it. Ids take 2 bytes per token (uint16: vocabularies up to 65,536 pieces), 8 per sentence."""

    def __init__(self, data, sampler: SubwordSampler, part: SampledPart, lengths: np.ndarray):
        self.data, self.sampler, self.epoch = data, sampler, part.epoch
        self.kept, self.segments = part.indices, part.segments
        self.src_lens, self.tgt_lens = lengths

    @classmethod
    def whole(cls, data, sampler: SubwordSampler, epoch: int) -> "SampledEpoch":
        """The epoch from a pass over every sentence made here."""
        part = SampledPart(data, sampler, epoch)
        return cls(data, sampler, part, part.lengths)

    def keep(self, indices) -> None:
        kept = np.unique(indices)
        position = np.searchsorted(self.kept, kept).clip(max=max(len(self.kept) - 1, 0))
        held = self.kept[position] == kept if len(self.kept) else np.zeros(len(kept), bool)
        missing = kept[~held]
        for side, (ids, offsets) in self.segments.items():
            # Copied straight into the kept sentences' arrays: no array of held and new ids together (a copy of
            # both, for a moment, beside them and the result).
            new_ids, new_offsets = self.sampler.segment(self.epoch, side, missing)
            lengths = np.empty(len(kept), np.int64)
            lengths[held], lengths[~held] = np.diff(offsets)[position[held]], np.diff(new_offsets)
            kept_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            kept_segments = np.empty(kept_offsets[-1], ids.dtype), kept_offsets
            copy_sentences((ids, offsets), position[held], kept_segments, np.flatnonzero(held))
            copy_sentences((new_ids, new_offsets), np.arange(len(missing)), kept_segments, np.flatnonzero(~held))
            self.segments[side] = kept_segments
            del ids, offsets, new_ids, new_offsets
            trim_heap()
        self.kept = kept

    def sentences(self, side: str, indices) -> list[np.ndarray]:
        """The ids of each of ``indices`` (kept sentences) in this epoch: sampled on a sampled side, else prepared."""
        if side not in self.segments:
            return self.data.sentences(side, indices)
        ids, offsets = self.segments[side]
        return [ids[offsets[k]:offsets[k + 1]] for k in np.searchsorted(self.kept, indices)]

    def collate(self, indices) -> dict:
        return self.data.collate(indices, self.sentences)
