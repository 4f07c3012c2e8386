"""Training speed of the real Trainer on WMT-shaped token batches: tokens/s per GPU, MFU and peak memory.

Run by benchmarks/gpu_check.sh under the deepspeed launcher, on a data directory it prepared. Each timed step
is ``Trainer.train_step`` as `dsmt train` runs it: batches built ahead from the memory-mapped data, host-to-device
copies, the fused loss, the all-reduces and the optimizer DeepSpeed builds from the ds_config. Warm-up steps are
excluded, and peak memory is counted from the end of warm-up. On a CPU it runs too (no MFU), so that it cannot rot.
"""

import argparse
import json
import re
import tempfile
import time
import traceback
import warnings
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from dsmt.config import load_config
from dsmt.engine import close_distributed
from dsmt.train import NEXT_SRC_TOKENS, NEXT_TGT_TOKENS, Trainer
from flops import numel, parameter_counts, step_flops

# Dense (no sparsity) bf16/fp16 tensor-core peaks per GPU from NVIDIA's data sheets, by device name: the first
# entry contained in torch.cuda.get_device_name() wins, so the specific forms come before the general ones.
PEAK_TFLOPS = [("GH200", 989.4), ("H200 NVL", 835.5), ("H200", 989.4), ("H100 PCIe", 756.5), ("H100 NVL", 835.5),
               ("H100", 989.4),  # "NVIDIA H100 80GB HBM3": the SXM form
               ("A100", 312.0), ("L40S", 362.1), ("A10G", 70.0)]


def peak_tflops(name: str) -> float | None:
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a prepared data directory (gpu_check.sh makes one)")
    parser.add_argument("--deepspeed_config", default="ds_configs/zero2.json")
    parser.add_argument("--preset", default="transformer_big")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--max-tokens", type=int, default=8192, help="data.max_tokens: tokens per GPU micro-batch")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--result", help="write this run's figures here (JSON)")
    parser.add_argument("--baseline", help="the 1-GPU run's --result: prints the scaling efficiency")
    parser.add_argument("--profile", metavar="DIR", help="after the timed steps, profile 3 more with torch.profiler "
                        "and write rank 0's tables (host and device time per operator, the host's share of a "
                        "step, and on a GPU where the host waited for it) to DIR/profile-STAGE-NGPUS.txt")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="more config overrides")
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # from the deepspeed launcher
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(overrides=[f"data.dir={args.data}", f"train.output_dir={out}", "train.resume=none",
                                     f"model.preset={args.preset}", f"train.deepspeed_config={args.deepspeed_config}",
                                     f"train.precision={args.precision}", f"data.max_tokens={args.max_tokens}",
                                     "train.warmup_steps=4000", *args.overrides])
        trainer = Trainer(cfg)
        row = measure(trainer, args)
        if args.profile:
            profile_steps(trainer, args)
        trainer.batches.close()
    if trainer.rank == 0:
        report(row, args)
    close_distributed()


def measure(trainer: Trainer, args) -> dict:
    device, model = trainer.engine.device, trainer.engine.module
    counts = parameter_counts(model)

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    trainer.begin()
    for _ in range(args.warmup):
        trainer.train_step()
    synchronize()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    flops, tokens, start = 0.0, 0.0, time.perf_counter()
    for _ in range(args.steps):
        # Model FLOPs of this rank's micro-batches, padded shapes (benchmarks/flops.py's convention).
        flops += sum(step_flops(trainer.cfg.model, counts, b["src"].size(0), b["src"].size(1), b["tgt_in"].size(1))
                     for b, _ in trainer.next_micro)
        totals = trainer.train_step()["totals"]  # all ranks' source + target tokens of this step
        tokens += totals[NEXT_SRC_TOKENS] + totals[NEXT_TGT_TOKENS]
    synchronize()
    seconds = time.perf_counter() - start
    summed = torch.tensor([flops], dtype=torch.float64, device=device)
    dist.all_reduce(summed)
    world = trainer.world
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    return {"device": name, "gpus": world, "ds_config": args.deepspeed_config, "precision": trainer.precision,
            "model": f"{args.preset} {sum(map(numel, model.parameters())) / 1e6:.1f}M",
            "tokens_per_s_per_gpu": tokens / seconds / world, "tflops_per_gpu": summed.item() / seconds / world / 1e12,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None}


def profile_steps(trainer: Trainer, args, steps: int = 3) -> None:
    """Where a step's time goes: per operator, the host's time (Python, dispatch, launches, waits) and the
    device's; a step whose device time is far below its wall time is held back by the host."""
    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            trainer.train_step()
        if cuda:
            torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps
    waits = host_waits(trainer) if cuda else None  # every rank steps
    if trainer.rank != 0:
        return
    table = prof.key_averages()
    kernels = [event for event in table if event.device_type == torch.autograd.DeviceType.CUDA]
    device_time = sum(event.self_device_time_total for event in kernels) / steps / 1e6
    stage = Path(args.deepspeed_config).stem
    lines = [f"{stage}, {trainer.world} GPU(s), {args.preset} {args.precision}, data.max_tokens={args.max_tokens}: "
             f"{wall * 1e3:.1f} ms a step under the profiler, with {device_time * 1e3:.1f} ms of device kernels",
             table.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)]
    if cuda:
        lines.append(table.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70))
    folder = Path(args.profile)
    folder.mkdir(parents=True, exist_ok=True)
    if waits is not None:
        lines += ["Where the host waited for the device in 2 more steps (calls, innermost dsmt/DeepSpeed frames):",
                  *(f"{count:4d}x {site}" for site, count in waits.most_common())]
    (folder / f"profile-{stage}-{trainer.world}.txt").write_text("\n".join(lines) + "\n")


def host_waits(trainer: Trainer, steps: int = 2) -> Counter:
    """The call sites where the host waits for the GPU during ``steps`` steps: the synchronizing calls CUDA's
    sync debug mode warns of (``.item()``, ``nonzero``, copies to pageable memory) and explicit synchronizes.
    A host that waits cannot queue the next kernels, so each is a bubble when the host is the bottleneck."""
    sites = Counter()

    def record(*_args, **_kwargs):
        frames = [f for f in traceback.extract_stack()[:-1] if re.search(r"/(dsmt|deepspeed|benchmarks)/", f.filename)]
        sites[" < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))] += 1

    def recorded(function):
        def wrapper(*args, **kwargs):
            record()
            return function(*args, **kwargs)
        return wrapper

    with ExitStack() as stack, warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
                            (torch.cuda.Stream, "synchronize")):
            stack.enter_context(mock.patch.object(owner, name, recorded(getattr(owner, name))))
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                trainer.train_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


def report(row: dict, args) -> None:
    peak = peak_tflops(row["device"])
    mfu = f"{row['tflops_per_gpu'] / peak:.1%}" if peak else "n/a (unknown peak)"
    memory = f"{row['peak_memory_gib']:.1f} GiB" if row["peak_memory_gib"] is not None else "n/a"
    scaling = "–"
    if args.baseline:
        single = json.load(open(args.baseline))["tokens_per_s_per_gpu"]
        scaling = f"{row['tokens_per_s_per_gpu'] / single:.1%}"
    print(f"| {row['device']} | {row['gpus']} | {row['model']} | {row['ds_config']} | {row['precision']} "
          f"| {args.max_tokens} | {row['tokens_per_s_per_gpu']:,.0f} | {row['tflops_per_gpu']:.1f} | {mfu} "
          f"| {memory} | {scaling} |", flush=True)
    if args.result:
        with open(args.result, "w") as f:
            json.dump(row, f)


if __name__ == "__main__":
    main()
