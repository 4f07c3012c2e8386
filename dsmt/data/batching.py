"""Token-bounded, length-bucketed batches of a binarized split, sharded across data-parallel ranks.

Every rank sees disjoint batches and the same number of them per epoch, so no rank waits on a
collective that another never joins. The stream is deterministic given (seed, epoch, rank, world size),
and its position is a small state a checkpoint can store.
"""

import itertools
import queue
import threading
from pathlib import Path

import numpy as np
import torch

from dsmt import DsmtError
from dsmt.data.prepare import load_meta
from dsmt.data.sampling import SampledEpoch, SampledPart


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


class StreamClosed(Exception):
    """Raised in a thread that was waiting for an epoch's plan when the stream was closed, and where an
    item is taken from an ``Ahead`` that was closed."""


class BatchStream:
    """This rank's batches, epoch after epoch, without end; ``state_dict`` is (epoch, position). With a
    ``SubwordSampler``, each epoch is segmented anew and planned from its sampled lengths, the next epoch's
    plan worked out on a thread of its own while this one is trained on (it takes a pass over the text).

    With ``exchange`` (every rank's equally shaped array, gathered: an all-gather), the ranks share that pass:
    each segments every world-th sentence, on a thread of its own, and the ranks exchange the lengths. The
    exchange is a collective, so it is made by the thread that trains, in ``sync``, at the same point of every
    rank's batches: before the first batch it takes, and halfway through each epoch for the epoch after it
    (whose part then had half an epoch to be made, and its plan half an epoch before it is needed). Planning
    threads only wait for it; nothing but the training thread ever waits on another rank. A rank makes its part
    of an epoch's pass once it trains on the epoch before: then, and from the epoch's plan to its last batch, it
    holds the sampled ids of two epochs at most, and the first epoch's plan has the core to itself."""

    def __init__(self, data: ParallelData, max_tokens: int, seed: int, rank: int = 0, world_size: int = 1,
                 sampler=None, exchange=None):
        self.data, self.max_tokens, self.seed, self.sampler = data, max_tokens, seed, sampler
        self.rank, self.world_size, self.exchange = rank, world_size, exchange
        self.epoch, self.position = 0, 0
        self._batches = self._view = self._plans = None  # the plans of this epoch on, made one ahead (sampled)
        self._parts = self._next_exchange = None  # this rank's parts of the passes; the next epoch to exchange
        self._exchanged, self._changed, self._closed = {}, threading.Condition(), False
        self._planned = {}  # epoch -> this rank's batch count (or what planning it raised), once planned
        self._started = -1  # the epoch whose batches the stream gives now (-1: none yet)

    def plan(self, epoch: int) -> tuple:
        """(the data as ``epoch`` segments it, with its lengths and collate; this rank's batches of it)."""
        try:
            view = self.data if self.sampler is None else self._sampled_epoch(epoch)
            batches = shard(epoch_batches(view.src_lens, view.tgt_lens, self.max_tokens, self.seed, epoch),
                            self.rank, self.world_size)
            if self.sampler is not None:
                view.keep(np.concatenate(batches))
        except BaseException as error:
            self._planned_as(epoch, error)
            raise
        self._planned_as(epoch, len(batches))
        return view, batches

    def _planned_as(self, epoch: int, outcome) -> None:
        with self._changed:
            self._planned[epoch] = outcome
            self._changed.notify_all()

    def _wait_for(self, found, what: str):
        """``found()`` once it is not None, waiting for the planning threads; raises if the stream closed."""
        with self._changed:
            while (value := found()) is None:
                if self._closed:
                    raise StreamClosed(f"the stream closed before {what}")
                self._changed.wait()
        return value

    def batches(self, epoch: int) -> list[np.ndarray]:
        return self.plan(epoch)[1]

    def _sampled_epoch(self, epoch: int) -> SampledEpoch:
        if self.exchange is None:
            return SampledEpoch.whole(self.data, self.sampler, epoch)
        part, lengths = self._wait_for(lambda: self._exchanged.pop(epoch, None), f"epoch {epoch}'s exchange")
        return SampledEpoch(self.data, self.sampler, part, lengths)

    def sync(self, state: dict) -> None:
        """On the thread that trains, before it takes a batch, given the stream's state after the last one it
        took (or the state it started from): the exchanges planning waits for, the same on every rank."""
        if self.exchange is None:
            return
        if self._parts is None:
            self._next_exchange = state["epoch"]
            self._parts = Ahead(self._parts_from(state["epoch"]), depth=1, name="dsmt-sampling")
        epoch, position = state["epoch"], state["position"]
        if self._next_exchange == epoch:  # the first take: the epoch it starts in
            self._exchange(epoch)
        if self._next_exchange == epoch + 1:
            count = self._wait_for(lambda: self._planned.get(epoch), f"epoch {epoch}'s plan")
            if isinstance(count, BaseException):
                raise count
            if 2 * position >= count:
                self._exchange(epoch + 1)

    def _parts_from(self, first: int):
        """This rank's parts of the passes from epoch ``first`` on, each (after the first) made once the stream
        gives the batches of the epoch before it: not beside that epoch's plan, nor held beside two planned epochs."""
        yield SampledPart(self.data, self.sampler, first, self.rank, self.world_size)
        for epoch in itertools.count(first + 1):
            self._wait_for(lambda: self._started >= epoch - 1 or None, f"epoch {epoch - 1}'s start")
            yield SampledPart(self.data, self.sampler, epoch, self.rank, self.world_size)

    def _exchange(self, epoch: int) -> None:
        part = next(self._parts)
        assert part.epoch == epoch, (part.epoch, epoch)
        count, rows = len(self.data), -(-len(self.data) // self.world_size)
        mine = np.zeros((2, rows), np.int32)  # every rank's part padded to the largest
        mine[:, :len(part.indices)] = part.lengths
        lengths = np.empty((2, count), np.int32)
        for rank, theirs in enumerate(self.exchange(mine)):
            lengths[:, rank::self.world_size] = theirs[:, :len(range(rank, count, self.world_size))]
        with self._changed:
            self._exchanged[epoch], self._next_exchange = (part, lengths), epoch + 1
            self._changed.notify_all()

    def close(self) -> None:
        """Wake the threads waiting for an exchange that will not come: they raise ``StreamClosed``."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        for ahead in (self._plans, self._parts):
            if ahead is not None:
                ahead.close(wait=False)  # an item half made is left to its daemon thread: no rank waits on it

    def _start(self, epoch: int) -> None:
        """Plan ``epoch``: a sampled stream takes the plan made while the last epoch was trained on (the
        first one made here), a plain one plans it now (a shuffle and a sort of lengths already known)."""
        if self.sampler is None:
            self._view, self._batches = self.plan(epoch)
        else:
            if self._plans is None:
                self._plans = Ahead((self.plan(e) for e in itertools.count(epoch)), depth=1, name="dsmt-next-epoch")
            self._view, self._batches = next(self._plans)
        with self._changed:
            self.epoch = self._started = epoch
            self._changed.notify_all()

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
        (rounded up: a few batches may be skipped, none repeated). A stream whose ranks exchange must be loaded
        before its first batch: its planning threads wait for the old position's exchanges, and would take the
        new position's."""
        if self._parts is not None:
            raise RuntimeError("BatchStream.load_state_dict after the ranks' first exchange: "
                               "load before the first batch")
        consumed = state["position"] * state["world_size"]
        self.epoch, self.position, self._batches = state["epoch"], -(-consumed // self.world_size), None
        if self._plans is not None:  # what was planned ahead follows the old position, not this one
            self._plans.close(wait=False)
            self._plans = None


class Ahead:
    """The items of the iterator ``items``, made on a daemon thread (which never holds up the process's exit)
    at most ``depth`` ahead: no more than ``depth`` made and not yet taken, the one being made included, which
    bounds the memory they hold. An error raised in making one, or the end of ``items``, is raised where that
    item would have been taken, and again on every later take."""

    def __init__(self, items, depth: int, name: str):
        self.items, self.made, self.ended = items, queue.SimpleQueue(), None
        self.room, self.stopped = threading.Semaphore(depth), threading.Event()
        self.thread = threading.Thread(target=self._fill, name=name, daemon=True)
        self.thread.start()

    def _fill(self) -> None:
        try:
            while self.room.acquire() and not self.stopped.is_set():
                self.made.put(next(self.items))
            raise StreamClosed(f"{self.thread.name} was closed")
        except BaseException as error:  # StopIteration included: handed to the consumer, which raises it
            self.made.put(error)

    def __iter__(self):
        return self

    def __next__(self):
        if self.ended is None:
            item = self.made.get()
            if not isinstance(item, BaseException):
                self.room.release()
                return item
            self.ended = item
        raise self.ended

    def close(self, wait: bool = True) -> None:
        """Stop the thread once it has made the item it is making, if any; ``wait`` for it to end."""
        self.stopped.set()
        self.room.release()  # wakes the thread if it waits for room
        if wait:
            self.thread.join()


class Prefetcher(Ahead):
    """``(prepare(batch), state)`` for each batch of ``stream``, built at most ``depth`` ahead in a background thread
    (numpy work that would otherwise sit between two GPU steps), ``state`` being the stream's state after that
    batch: a checkpoint stores the state after the last batch trained on, not after those built ahead. The
    stream is deterministic, so the items are exactly those of the stream itself. Taking an item first lets
    the stream make its collectives (``BatchStream.sync``) on the taking thread."""

    def __init__(self, stream, prepare, depth: int):
        self.stream, self.state = stream, stream.state_dict()
        super().__init__(((prepare(batch), stream.state_dict()) for batch in stream), depth, "dsmt-prefetch")

    def __next__(self):
        self.stream.sync(self.state)
        item = super().__next__()
        self.state = item[1]
        return item

    def close(self) -> None:
        self.stream.close()
        super().close()
