"""Token-bounded, length-bucketed batches of a binarized split, sharded across data-parallel ranks.

Every rank sees disjoint batches and the same number of them per epoch, so no rank waits on a
collective that another never joins. The stream is deterministic given (seed, epoch, rank, world size),
and its position is a small state a checkpoint can store.
"""

import queue
import threading
from pathlib import Path

import numpy as np
import torch

from dsmt import DsmtError
from dsmt.data.prepare import load_meta
from dsmt.data.sampling import SampledEpoch


class ParallelData:
    """One split of a prepared data directory, memory-mapped; sequences carry EOS (and BOS on decoder input)."""

    def __init__(self, data_dir: str, split: str):
        meta = load_meta(data_dir)
        if split not in meta["splits"]:
            raise DsmtError(f"{data_dir} has no split {split!r}; it has {list(meta['splits'])}")
        folder = Path(data_dir)
        self.meta = meta
        self.pad, self.bos, self.eos = (meta["specials"][k] for k in ("pad", "bos", "eos"))
        self.src_ids, self.src_offsets = self._load(folder, f"{split}.{meta['src']}")
        self.tgt_ids, self.tgt_offsets = self._load(folder, f"{split}.{meta['tgt']}")
        if len(self.src_offsets) < 2:
            raise DsmtError(f"{data_dir}: split {split!r} holds no sentence pair; prepare the data again with a "
                            "non-empty file for it")
        self.src_lens = self._lengths(self.src_offsets)  # + EOS
        self.tgt_lens = self._lengths(self.tgt_offsets)  # + BOS on the input side, + EOS on the output side

    @staticmethod
    def _load(folder: Path, stem: str):
        return (np.load(folder / f"{stem}.ids.npy", mmap_mode="r"),
                np.load(folder / f"{stem}.offsets.npy", mmap_mode="r"))

    @staticmethod
    def _lengths(offsets: np.memmap, block: int = 1 << 20) -> np.ndarray:
        """Tokens per sentence + 1, as int32 (18 MB at WMT14 En-De's 4.5M pairs). The offsets are read from
        the file a block at a time, not through their memory map, which would keep all of them resident."""
        lengths = np.empty(len(offsets) - 1, np.int32)
        with open(offsets.filename, "rb") as f:
            f.seek(offsets.offset)
            previous = np.fromfile(f, np.int64, count=1)
            for start in range(0, len(lengths), block):
                ends = np.fromfile(f, np.int64, count=min(block, len(lengths) - start))
                lengths[start:start + len(ends)] = np.diff(ends, prepend=previous)
                previous = ends[-1:]
        lengths += 1
        return lengths

    def __len__(self) -> int:
        return len(self.src_lens)

    def tokens(self, side: str, index: int) -> np.ndarray:
        """The prepared ids of sentence ``index`` on ``side`` ("src" or "tgt"), without EOS/BOS."""
        ids, offsets = (self.src_ids, self.src_offsets) if side == "src" else (self.tgt_ids, self.tgt_offsets)
        return ids[offsets[index]:offsets[index + 1]]

    def sentences(self, side: str, indices) -> list[np.ndarray]:
        """``tokens`` of each of ``indices``."""
        return [self.tokens(side, index) for index in indices]

    def _rows(self, sequences: list[np.ndarray], prefix, suffix) -> torch.Tensor:
        width = max(map(len, sequences)) + len(prefix) + len(suffix)
        rows = np.full((len(sequences), width), self.pad, dtype=np.int64)
        for row, sequence in enumerate(sequences):
            tokens = np.concatenate([prefix, sequence, suffix])
            rows[row, : len(tokens)] = tokens
        return torch.from_numpy(rows)

    def collate(self, indices, tokens=None) -> dict:
        """Right-padded ``src`` (x + EOS), ``tgt_in`` (BOS + y) and ``tgt_out`` (y + EOS) tensors; and on the host,
        the sentence ``indices`` and the rows' real lengths (``src_lengths``; ``tgt_lengths``, of either target).
        ``tokens(side, indices)`` gives the sentences' ids: the prepared ones (``sentences``) unless a sampled epoch
        passes its own."""
        indices = np.asarray(indices)
        tokens = tokens or self.sentences
        src, tgt = tokens("src", indices), tokens("tgt", indices)
        return {"src": self._rows(src, [], [self.eos]), "tgt_in": self._rows(tgt, [self.bos], []),
                "tgt_out": self._rows(tgt, [], [self.eos]), "indices": indices,
                "src_lengths": np.fromiter(map(len, src), np.int32, len(src)) + 1,
                "tgt_lengths": np.fromiter(map(len, tgt), np.int32, len(tgt)) + 1}


def token_batches(src_lens, tgt_lens, max_tokens: int, order) -> list[np.ndarray]:
    """Cut ``order`` greedily into batches whose padded source and padded target each hold ≤ max_tokens: a batch
    grows while its widest sentence × its sentence count fits. Each cut is one numpy pass over the sentences
    that can still fit, so an epoch of millions of sentences is cut in about a second."""
    order = np.asarray(order)
    widths = np.maximum(src_lens, tgt_lens)[order]
    longest = int(widths.max())
    if longest > max_tokens:
        raise DsmtError(f"a sentence has {longest} tokens, more than data.max_tokens={max_tokens}; "
                        "raise data.max_tokens or prepare the data with a smaller --max-len")
    batches, start = [], 0
    while start < len(order):
        window = widths[start:start + max_tokens // int(widths[start])]  # no batch can hold more
        cost = np.maximum.accumulate(window) * np.arange(1, len(window) + 1)  # non-decreasing
        size = int(np.searchsorted(cost, max_tokens, side="right"))
        batches.append(order[start:start + size])
        start += size
    return batches


def epoch_batches(src_lens, tgt_lens, max_tokens: int, seed: int, epoch: int) -> list[np.ndarray]:
    """All batches of one epoch: sorted by length (ties broken at random), cut, then shuffled."""
    rng = np.random.default_rng([seed, epoch])
    order = np.lexsort((rng.random(len(src_lens)), tgt_lens, src_lens))
    batches = token_batches(src_lens, tgt_lens, max_tokens, order)
    return [batches[i] for i in rng.permutation(len(batches))]


def shard(batches: list, rank: int, world_size: int) -> list:
    """This rank's batches. The list is first padded cyclically to a multiple of ``world_size`` (its first
    batches again, as many times as it takes when there are fewer batches than ranks), so every rank gets
    the same number, at least one: a rank without a batch would miss the collectives the others enter."""
    if not batches:
        raise ValueError("no batches to shard")
    per_rank = -(-len(batches) // world_size)
    return [batches[i % len(batches)] for i in range(rank, per_rank * world_size, world_size)]


class BatchStream:
    """This rank's batches, epoch after epoch, without end; ``state_dict`` is (epoch, position). With a
    ``SubwordSampler``, each epoch is segmented anew and planned from its sampled lengths, the next epoch's
    plan worked out on a thread of its own while this one is trained on (it takes a pass over the text)."""

    def __init__(self, data: ParallelData, max_tokens: int, seed: int, rank: int = 0, world_size: int = 1,
                 sampler=None):
        self.data, self.max_tokens, self.seed, self.sampler = data, max_tokens, seed, sampler
        self.rank, self.world_size = rank, world_size
        self.epoch, self.position = 0, 0
        self._batches = self._view = self._next_plan = None

    def plan(self, epoch: int) -> tuple:
        """(the data as ``epoch`` segments it, with its lengths and collate; this rank's batches of it)."""
        view = self.data if self.sampler is None else SampledEpoch(self.data, self.sampler, epoch)
        batches = shard(epoch_batches(view.src_lens, view.tgt_lens, self.max_tokens, self.seed, epoch), self.rank,
                        self.world_size)
        if self.sampler is not None:
            view.keep(np.concatenate(batches))
        return view, batches

    def batches(self, epoch: int) -> list[np.ndarray]:
        return self.plan(epoch)[1]

    def _start(self, epoch: int) -> None:
        ahead = self._next_plan
        self.epoch, (self._view, self._batches) = epoch, (ahead.result() if ahead and ahead.epoch == epoch
                                                            else self.plan(epoch))
        self._next_plan = InBackground(epoch + 1, self.plan) if self.sampler is not None else None

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._batches is None:
            self._start(self.epoch)
        if self.position >= len(self._batches):
            self.position = 0
            self._start(self.epoch + 1)
        indices = self._batches[self.position]
        self.position += 1
        return self._view.collate(indices)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        """Resume where the job stood; on another number of ranks, after the same share of the epoch
        (rounded up: a few batches may be skipped, none repeated)."""
        consumed = state["position"] * state["world_size"]
        self.epoch, self.position, self._batches = state["epoch"], -(-consumed // self.world_size), None


class InBackground:
    """``function(epoch)`` computed on a daemon thread (which never holds up the process's exit);
    ``result()`` waits for it and raises what it raised."""

    def __init__(self, epoch: int, function):
        self.epoch, self._done, self._value, self._error = epoch, threading.Event(), None, None
        threading.Thread(target=self._run, args=(function,), name="dsmt-next-epoch", daemon=True).start()

    def _run(self, function) -> None:
        try:
            self._value = function(self.epoch)
        except BaseException as error:
            self._error = error
        finally:
            self._done.set()

    def result(self):
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value


class Prefetcher:
    """``(prepare(batch), state)`` for each batch of ``stream``, built up to ``depth`` ahead in a background thread
    (numpy work that would otherwise sit between two GPU steps), ``state`` being the stream's state after that
    batch: a checkpoint stores the state after the last batch trained on, not after those built ahead. The
    stream is deterministic, so the items are exactly those of the stream itself."""

    def __init__(self, stream, prepare, depth: int):
        self.stream, self.prepare = stream, prepare
        self.queue, self.stopped = queue.Queue(maxsize=depth), threading.Event()
        self.thread = threading.Thread(target=self._fill, name="dsmt-prefetch", daemon=True)
        self.thread.start()

    def _fill(self) -> None:
        try:
            while not self.stopped.is_set():
                batch = next(self.stream)
                self.queue.put((self.prepare(batch), self.stream.state_dict()))
        except BaseException as error:  # handed to the consumer, which raises it
            self.queue.put(error)

    def __iter__(self):
        return self

    def __next__(self):
        item = self.queue.get()
        if isinstance(item, BaseException):
            self.stopped.set()
            raise item
        return item

    def close(self) -> None:
        """Stop the thread: it sees the flag once the queue has room again."""
        self.stopped.set()
        while self.thread.is_alive():
            try:
                self.queue.get(timeout=0.1)
            except queue.Empty:
                pass
