"""Where a rank's memory goes while subword sampling makes its first epoch: peak anonymous and file-backed
resident memory (MB) of each phase.

    python benchmarks/sampling_memory.py --data /tmp/dsmt_prepare_scale/data_1000000 --world 2

One process plays rank ``--rank`` of ``--world`` with the recipe's sampling defaults: it makes its part of the
sampled pass (`SampledPart`), plans the epoch's batches, and keeps its own sentences' ids (`SampledEpoch.keep`),
as `BatchStream` does. The other ranks' parts are not made: their sentences' lengths are the prepared ones,
which changes which sentences this rank keeps but not how many. A thread reads /proc/self/status every 50 ms:
RssAnon is the process's own memory, RssFile the pages of the memory-mapped arrays and text it has read (page
cache, shared by the ranks of a node and reclaimable); getrusage's peak RSS counts both.
"""

import argparse
import threading
import time

import numpy as np

from dsmt.config import DataConfig, ModelConfig, SubwordSamplingConfig
from dsmt.data.batching import ParallelData, epoch_batches, shard
from dsmt.data.sampling import SampledEpoch, SampledPart, SubwordSampler
from prepare_scale import resident_mb


class PhasePeaks:
    """The largest RssAnon and RssFile seen during each named phase."""

    def __init__(self):
        self.phase, self.peaks = "load", {}
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while True:
            now, peak = resident_mb(), self.peaks.setdefault(self.phase, {"RssAnon": 0, "RssFile": 0})
            for key, value in now.items():
                peak[key] = max(peak[key], value)
            time.sleep(0.05)

    def start(self, phase: str) -> None:
        time.sleep(0.1)  # one more reading of the phase that ends
        self.phase = phase


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a data dir prepared by dsmt prepare (format 2)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rank", type=int, default=0)
    args = parser.parse_args()
    peaks, options, max_tokens = PhasePeaks(), SubwordSamplingConfig(), DataConfig().max_tokens
    data = ParallelData(args.data, "train")
    fits = min(max_tokens, ModelConfig().max_positions) - 1  # as the trainer bounds a sampled sentence
    sampler = SubwordSampler(data, args.data, options.sides, options.alpha, options.nbest, seed=1, max_len=fits)
    timings = {}

    def phase(name, work):
        peaks.start(name)
        start = time.perf_counter()
        result = work()
        timings[name] = time.perf_counter() - start
        return result

    part = phase("sampled part", lambda: SampledPart(data, sampler, 0, args.rank, args.world))
    lengths = np.stack([data.src_lens, data.tgt_lens]).astype(np.int32)
    lengths[:, args.rank::args.world] = part.lengths
    epoch = SampledEpoch(data, sampler, part, lengths)
    del part
    batches = phase("plan", lambda: shard(epoch_batches(epoch.src_lens, epoch.tgt_lens, max_tokens, 1, 0),
                                          args.rank, args.world))
    phase("keep", lambda: epoch.keep(np.concatenate(batches)))
    peaks.start("kept")
    time.sleep(0.2)  # a reading of what stays
    held = sum(ids.nbytes + offsets.nbytes for ids, offsets in epoch.segments.values()) / 2 ** 20
    print(f"{len(data):,} pairs, rank {args.rank} of {args.world}: {held:.0f} MB of sampled ids and offsets kept\n\n"
          "| phase | seconds | peak anonymous MB | peak file-backed MB |\n| --- | ---: | ---: | ---: |")
    for name, peak in peaks.peaks.items():
        seconds = f"{timings[name]:.0f}" if name in timings else ""
        print(f"| {name} | {seconds} | {peak['RssAnon']:,.0f} | {peak['RssFile']:,.0f} |")


if __name__ == "__main__":
    main()
