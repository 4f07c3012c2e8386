"""ZeRO stages side by side: 2 ranks, the same model and batches, one ds_config each.

    python benchmarks/zero_stages.py --data data/multi30k_en_de

Each config trains in its own `deepspeed --num_gpus 2` job (on a machine without GPUs: 2 CPU ranks
on gloo, one thread each). Reported per rank, from rank 0's train_log.jsonl: source+target tokens/s
after the first logging window (relative to ZeRO-0), the bytes of parameters, gradients and optimizer
state it holds (measured on DeepSpeed's tensors: ``dsmt.engine.partitioned_bytes``/``gradient_bytes``),
and its peak RSS. Offload configs use DeepSpeed's CPU Adam, compiled on first use (not timed). With
``--rounds N`` the configs run in turn N times and each keeps its fastest round: run-to-run noise on a
shared 2-core machine (several percent) is as large as the differences measured.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from dsmt.engine import free_port

REPO = Path(__file__).resolve().parent.parent
CONFIGS = ["zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"]


def run(config: str, data: str, out: str, steps: int, log_interval: int, overrides: list[str]) -> dict:
    deepspeed = str(Path(sys.executable).parent / "deepspeed")
    command = [deepspeed, "--num_gpus", "2", "--master_port", str(free_port()), "launch/train.py",
               "--deepspeed_config", f"ds_configs/{config}.json", f"data.dir={data}", f"train.output_dir={out}",
               f"train.max_steps={steps}", f"train.log_interval={log_interval}", "train.threads=1",
               "train.resume=none", "train.precision=fp32", "eval.valid_bleu=false",
               f"train.valid_interval={10 ** 9}", f"train.save_interval={10 ** 9}", *overrides]
    # Validation (loss only) and saving run once, after the last timed step.
    result = subprocess.run(command, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{config} failed:\n{result.stderr[-2000:]}")
    log = [json.loads(line) for line in (Path(out) / "train_log.jsonl").read_text().splitlines()]
    train = [r for r in log if r["kind"] == "train"]
    memory = next(r for r in log if r["kind"] == "memory")
    timed = train[1:]  # the first window holds start-up (and JIT-compiled ops)
    return {"tokens_per_s": sum(r["tokens_per_s"] for r in timed) / len(timed),
            "param_bytes": memory["param_bytes"], "gradient_bytes": memory["gradient_bytes"],
            "optimizer_state_bytes": memory["optimizer_state_bytes"], "peak_rss_mb": train[-1]["peak_rss_mb"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/multi30k_en_de")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1, help="run every config this many times, keep the fastest")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated ds_configs/ names")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. data.max_tokens=2048 (default: the small preset)")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for config in args.configs.split(","):
                result = run(config, args.data, f"{tmp}/{config}{round_}", args.steps, args.log_interval, args.overrides)
                print(f"{config}, round {round_ + 1}: {result}", file=sys.stderr, flush=True)
                if config not in results or result["tokens_per_s"] > results[config]["tokens_per_s"]:
                    results[config] = result
    base = results.get("zero0") or next(iter(results.values()))
    mb = 2 ** 20
    print(f"2 ranks × 1 thread, {args.steps} steps, tokens/s averaged after the first {args.log_interval}, best of "
          f"{args.rounds} round(s); {' '.join(args.overrides) or 'defaults'}")
    print("| ds_config | src+tgt tokens/s | vs ZeRO-0 | parameters / rank | gradients / rank | optimizer state / rank "
          "| params vs ZeRO-0 | peak RSS / rank |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for config, r in results.items():
        print(f"| {config} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}× "
              f"| {r['param_bytes'] / mb:.1f} MB | {r['gradient_bytes'] / mb:.1f} MB "
              f"| {r['optimizer_state_bytes'] / mb:.1f} MB | {r['param_bytes'] / base['param_bytes']:.2f}× "
              f"| {r['peak_rss_mb']:.0f} MB |")


if __name__ == "__main__":
    main()
