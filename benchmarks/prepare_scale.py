"""dsmt prepare at WMT scale, in bounded memory: a table of pairs, wall seconds, pairs/s and peak RSS.

    python benchmarks/prepare_scale.py --pairs 250000,1000000,4500000

It writes a WMT-like corpus of N pairs itself (never kept in the repository): each line two Multi30k training
sentences joined, drawn by a seeded generator (about 26 words a line, 270 MB of text per million pairs), with
a valid set of 3000 such pairs. `dsmt prepare` runs on it as a child process, whose peak resident memory is
read with getrusage. Then `--train-steps` steps of the Multi30k recipe's model (2 CPU ranks) run on the largest
prepared directory, and it prints the time from launch to the first logged step and rank 0's
peak RSS, next to the smallest generated corpus (the same sentence lengths, so the same activations) and
Multi30k (sentences half as long); with ``--sampling``, also on both generated corpora with subword sampling on.
"""

import argparse
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MULTI30K = REPO.parent / "shared" / "data" / "multi30k"


def multi30k_pairs(split: str) -> list[tuple[str, str]]:
    sides = [gzip.open(MULTI30K / f"{split}.{lang}.gz", "rt", encoding="utf-8").read().splitlines() for lang in ("en", "de")]
    return list(zip(*sides))


def write_corpus(prefix: Path, sentences: list[tuple[str, str]], pairs: int, seed: int) -> None:
    """``pairs`` lines, each two sentences joined, to PREFIX.en and PREFIX.de."""
    rng = random.Random(seed)
    with open(f"{prefix}.en", "w", encoding="utf-8") as en, open(f"{prefix}.de", "w", encoding="utf-8") as de:
        for start in range(0, pairs, 100_000):
            lines = [(rng.choice(sentences), rng.choice(sentences)) for _ in range(min(100_000, pairs - start))]
            en.write("".join(f"{a[0]} {b[0]}\n" for a, b in lines))
            de.write("".join(f"{a[1]} {b[1]}\n" for a, b in lines))


def child_peak_rss_mb(command: list[str], **kw) -> tuple[float, float]:
    """(wall seconds, peak RSS in MB) of ``command`` run in a fresh Python whose only child it is."""
    probe = ("import resource, subprocess, sys, time; start = time.time(); "
             "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
             "print(time.time() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)")
    out = subprocess.run([sys.executable, "-c", probe, *command], capture_output=True, text=True, cwd=REPO, **kw)
    if out.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{out.stderr[-2000:]}")
    wall, rss = out.stdout.split()
    return float(wall), float(rss)


def prepare(corpus: Path, out: Path, args) -> tuple[float, float]:
    command = [sys.executable, "-m", "dsmt.cli", "prepare", "--train", str(corpus / "train"), "--valid",
               str(corpus / "valid"), "--out", str(out), "--vocab-size", str(args.vocab_size)]
    if args.spm_sample:
        command += ["--spm-sample", str(args.spm_sample)]
    return child_peak_rss_mb(command)


def resident_mb(pid="self") -> dict[str, float]:
    """A process's resident memory (MB) as /proc/PID/status gives it: RssAnon (its own) and RssFile (the page
    cache of files it maps, its data arrays); nothing once it has ended."""
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    except OSError:
        return {}
    return {key: int(status[key].split()[0]) / 1024 for key in ("RssAnon", "RssFile") if key in status}


def private_mb(pid: int) -> float:
    """A process's anonymous resident memory: RSS without the page cache of files it maps (its data arrays)."""
    return resident_mb(pid).get("RssAnon", 0.0)


def first_step(data: Path, out: Path, steps: int, *overrides: str) -> tuple[float, float, float]:
    """Seconds from launch to the first logged step, rank 0's peak RSS and its largest sampled private memory
    (MB), on 2 CPU ranks."""
    import psutil

    from dsmt.engine import free_port

    shutil.rmtree(out, ignore_errors=True)
    command = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
               "launch/train.py", "--config", "launch/configs/multi30k_en_de.yaml", f"data.dir={data}",
               f"train.output_dir={out}", f"train.max_steps={steps}", "train.max_minutes=0", "train.log_interval=1",
               "train.resume=none", "eval.valid_bleu=false", "train.threads=1", *overrides]
    start, log = time.time(), out / "train_log.jsonl"
    job = subprocess.Popen(command, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds, private = None, 0.0
    while job.poll() is None:
        if seconds is None and log.is_file() and '"kind": "train"' in log.read_text():
            seconds = time.time() - start
        for process in psutil.Process(job.pid).children(recursive=True):
            try:
                if "--local_rank=0" in process.cmdline():
                    private = max(private, private_mb(process.pid))
            except psutil.Error:  # ended meanwhile
                pass
        time.sleep(0.2)
    if job.returncode:
        raise SystemExit(f"training on {data} failed:\n{job.stderr.read()[-2000:]}")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return seconds, max(r["peak_rss_mb"] for r in records if r["kind"] == "train"), private


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="250000,1000000,4500000", help="comma-separated corpus sizes")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--spm-sample", type=int, help="passed to dsmt prepare (default: its own)")
    parser.add_argument("--work", default="/tmp/dsmt_prepare_scale", help="where corpora and data dirs go")
    parser.add_argument("--train-steps", type=int, default=2, help="0: prepare only")
    parser.add_argument("--train-only", action="store_true", help="reuse the data dirs an earlier run left in --work")
    parser.add_argument("--sampling", action="store_true", help="train on the generated corpora with "
                        "data.subword_sampling on as well (its first epoch is planned from a sampled pass over them)")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    sentences, valid = multi30k_pairs("train"), multi30k_pairs("val")

    print("| pairs | wall s | pairs/s | peak RSS MB |\n| ---: | ---: | ---: | ---: |", flush=True)
    sizes = [int(n) for n in args.pairs.split(",")]
    prepared = work / f"data_{sizes[-1]}"
    for pairs in [] if args.train_only else sizes:
        corpus = work / f"corpus_{pairs}"
        corpus.mkdir(exist_ok=True)
        write_corpus(corpus / "train", sentences, pairs, seed=pairs)
        write_corpus(corpus / "valid", valid, 3000, seed=0)
        prepared = work / f"data_{pairs}"
        shutil.rmtree(prepared, ignore_errors=True)  # else prepare reuses it
        wall, rss = prepare(corpus, prepared, args)
        print(f"| {pairs:,} | {wall:.0f} | {pairs / wall:,.0f} | {rss:,.0f} |", flush=True)
    if not args.train_steps:
        return
    multi30k = work / "data_multi30k"
    subprocess.run([sys.executable, "-m", "dsmt.cli", "prepare", "multi30k", "--out", str(multi30k)], cwd=REPO,
                   check=True, stdout=subprocess.DEVNULL)
    print("\n| data | seconds to first step | rank 0 peak RSS MB | rank 0 private (anonymous) MB |\n"
          "| --- | ---: | ---: | ---: |")
    smallest = work / f"data_{min(sizes)}"  # the same sentence lengths
    runs = [(prepared.name, prepared, ()), (smallest.name, smallest, ()), ("multi30k", multi30k, ())]
    if args.sampling:
        runs += [(f"{data.name}_sampling", data, ("data.subword_sampling.enabled=true",)) for data in (prepared, smallest)]
    for name, data, overrides in runs:
        seconds, rss, private = first_step(data, work / f"run_{name}", args.train_steps, *overrides)
        print(f"| {name} | {seconds:.0f} | {rss:,.0f} | {private:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
