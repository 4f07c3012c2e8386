"""One GPU's training speed: transformer_big on synthetic token batches, through dsmt's engine set-up.

Run by benchmarks/gpu_check.sh (under `deepspeed --num_gpus 1`). Prints tokens/s, model FLOPs
utilization (FLOPs as in benchmarks/flops.py) and peak memory. On a CPU it runs too (no MFU).
"""

import argparse
import time

import torch

from dsmt.config import load_config
from dsmt.engine import build_engine, close_distributed, init_distributed
from dsmt.model import Transformer
from flops import parameter_counts, step_flops

# Dense bf16 tensor-core peaks (no sparsity), from NVIDIA's data sheets.
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed_config", default="ds_configs/zero0.json")
    parser.add_argument("--preset", default="transformer_big")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=256, help="sentences per step")
    parser.add_argument("--length", type=int, default=64, help="source and target tokens per sentence")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # from the deepspeed launcher
    args = parser.parse_args()

    cfg = load_config(overrides=[f"model.preset={args.preset}", f"model.vocab_size={args.vocab}",
                                 f"train.deepspeed_config={args.deepspeed_config}", f"train.precision={args.precision}",
                                 "train.warmup_steps=1000", "model.dropout=0.1"])
    _, world, _ = init_distributed(cfg.train.dist_timeout_minutes)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    params = parameter_counts(model)
    engine, _ = build_engine(model, cfg, world)  # torch_adam "auto": PyTorch's fused Adam, nothing to compile
    device = engine.device
    shape = (args.batch, args.length)
    src = torch.randint(4, args.vocab, shape, device=device)
    tgt = torch.randint(4, args.vocab, (args.batch, args.length + 1), device=device)
    flops = step_flops(cfg.model, params, args.batch, args.length, args.length)

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            synchronize()
            start = time.perf_counter()
        loss, _ = engine(src, tgt[:, :-1], tgt[:, 1:], 0.1)
        engine.backward(loss / tgt[:, 1:].numel())
        engine.step()
    synchronize()
    seconds = (time.perf_counter() - start) / args.steps
    tokens = 2 * args.batch * args.length / seconds
    achieved = flops / seconds / 1e12
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    memory = f"{torch.cuda.max_memory_allocated() / 2 ** 30:.1f} GiB" if device.type == "cuda" else "n/a"
    mfu = f"{achieved / peak:.1%}" if peak else "n/a (unknown peak)"
    print(f"| {name} | {args.preset} {sum(params.values()) / 1e6:.0f}M | {args.deepspeed_config} | {args.precision} "
          f"| {args.batch}×{args.length} | {tokens:,.0f} | {achieved:.1f} TFLOP/s | {mfu} | {memory} |", flush=True)
    close_distributed()


if __name__ == "__main__":
    main()
