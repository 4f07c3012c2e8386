"""Subword sampling's pass over an epoch on 1, 2, ... threads: sentences/s of each and the ratio to one thread.

    python benchmarks/sampling_pass.py --data data/multi30k_en_de --threads 1,2

Times what starts every sampled epoch (`SampledEpoch`: both sides of every training sentence segmented with
the recipe's defaults, n-best 16 and alpha 0.1) on a prepared data directory, the thread counts taking turns
in one process for ``--rounds`` rounds, each a new epoch; the table gives each count's best round.
"""

import argparse
import os
import time

from dsmt.config import SubwordSamplingConfig
from dsmt.data.batching import ParallelData
from dsmt.data.sampling import SampledEpoch, SubwordSampler


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a data dir prepared by dsmt prepare (format 2)")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    data, defaults = ParallelData(args.data, "train"), SubwordSamplingConfig()
    counts = [int(n) for n in args.threads.split(",")]
    best = dict.fromkeys(counts, float("inf"))
    for epoch in range(args.rounds):
        for threads in counts:
            sampler = SubwordSampler(data, args.data, "both", defaults.alpha, defaults.nbest, seed=1,
                                     max_len=1 << 30, threads=threads)
            start = time.perf_counter()
            SampledEpoch.whole(data, sampler, epoch)
            best[threads] = min(best[threads], time.perf_counter() - start)
    print(f"{len(data):,} sentence pairs, both sides, {os.cpu_count()} cores\n\n"
          "| threads | seconds a pass | sentence pairs/s | × one thread |\n| ---: | ---: | ---: | ---: |")
    for threads, seconds in best.items():
        print(f"| {threads} | {seconds:.2f} | {len(data) / seconds:,.0f} | {best[counts[0]] / seconds:.2f}× |")


if __name__ == "__main__":
    main()
