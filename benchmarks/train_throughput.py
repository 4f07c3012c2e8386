"""Training throughput: a plain PyTorch baseline against dsmt (DeepSpeed ZeRO-0), same model size, same threads.

    python benchmarks/train_throughput.py --data data/multi30k_en_de

The baseline is written the way most tutorials write it: ``torch.nn.Transformer`` with masks built
outside the model and an ordinary loop. Both train on the same length-bucketed batches (the speed
ratio); the baseline also trains on the tutorials' batching (a fixed number of sentences in random
order), which shows what padding costs, and once more with the allocator setting dsmt makes
(``dsmt.train.keep_freed_memory``), which shows how much of the gap that setting is. Each trainer runs
in a process of its own, as it would be run, one after the other, for several rounds; the table keeps
each one's best round. Tokens are real (non-pad) source + target tokens. Model GFLOP/s
(benchmarks/flops.py, padded positions included) against this CPU's own matrix-multiply rate shows
how much headroom is left: on identical batches every trainer does the same arithmetic.
"""

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np
import torch
from omegaconf import OmegaConf
from torch import nn

from dsmt.config import load_config
from dsmt.data.batching import ParallelData, epoch_batches
from dsmt.data.prepare import load_meta
from dsmt.model import Transformer, sinusoidal_table
from dsmt.train import Trainer, fill_model_config, keep_freed_memory
from flops import matmul_flops_per_s, parameter_counts, step_flops

# name: (trainer, batches, description)
TRAINERS = {
    "baseline": ("baseline", "bucketed", "plain PyTorch nn.Transformer"),
    "baseline_tutorial": ("baseline", "tutorial", "plain PyTorch nn.Transformer"),
    "baseline_keep_freed_memory": ("baseline", "bucketed", "plain PyTorch nn.Transformer + dsmt's malloc setting"),
    "dsmt": ("dsmt", "bucketed", "dsmt, DeepSpeed ZeRO-0"),
}


class TutorialTransformer(nn.Module):
    def __init__(self, vocab, d_model, n_heads, n_layers, d_ff, dropout, pad):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model, padding_idx=pad)
        self.register_buffer("positions", sinusoidal_table(1024, d_model))
        self.transformer = nn.Transformer(d_model, n_heads, n_layers, n_layers, d_ff, dropout, batch_first=True,
                                          norm_first=True)
        self.out = nn.Linear(d_model, vocab, bias=False)
        self.out.weight = self.embed.weight
        self.scale, self.dropout = math.sqrt(d_model), nn.Dropout(dropout)

    def embed_tokens(self, tokens):
        return self.dropout(self.embed(tokens) * self.scale + self.positions[: tokens.size(1)])

    def forward(self, src, tgt, tgt_mask, src_key_padding_mask, tgt_key_padding_mask):
        hidden = self.transformer(self.embed_tokens(src), self.embed_tokens(tgt), tgt_mask=tgt_mask,
                                  src_key_padding_mask=src_key_padding_mask, tgt_key_padding_mask=tgt_key_padding_mask,
                                  memory_key_padding_mask=src_key_padding_mask)
        return self.out(hidden)


def real_tokens(batch, pad):
    return int((batch["src"] != pad).sum() + (batch["tgt_out"] != pad).sum())


def run_baseline(model, batches, pad, warmup):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    criterion = nn.CrossEntropyLoss(ignore_index=pad, label_smoothing=0.1)
    model.train()
    tokens, start = 0, None
    for i, batch in enumerate(batches):
        if i == warmup:
            tokens, start = 0, time.perf_counter()
        src, tgt_in, tgt_out = batch["src"], batch["tgt_in"], batch["tgt_out"]
        tgt_mask = nn.Transformer.generate_square_subsequent_mask(tgt_in.size(1))
        logits = model(src, tgt_in, tgt_mask, src == pad, tgt_in == pad)
        loss = criterion(logits.view(-1, logits.size(-1)), tgt_out.view(-1))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        tokens += real_tokens(batch, pad)
    return tokens / (time.perf_counter() - start)


def run_dsmt(trainer, batches, pad, warmup):
    """dsmt's own training step (global-token loss, engine.backward/step) fed the given batches."""
    trainer.stream = iter(batches)
    tokens, start = 0, None
    for i, batch in enumerate(batches):
        if i == warmup:
            tokens, start = 0, time.perf_counter()
        trainer.train_step()
        tokens += real_tokens(batch, pad)
    return tokens / (time.perf_counter() - start)


def padding(batches, pad):
    real = sum(real_tokens(b, pad) for b in batches)
    total = sum(b["src"].numel() + b["tgt_out"].numel() for b in batches)
    return 1 - real / total


def config_overrides(args, out):
    return [f"data.dir={args.data}", f"train.output_dir={out}", "train.resume=none", f"train.threads={args.threads}",
            "train.precision=fp32", "train.deepspeed_config=ds_configs/zero0.json"]


def worker(args) -> dict:
    """One trainer in this process: its tokens/s, and what the table needs about its batches."""
    trainer_kind, batching, _ = TRAINERS[args.worker]
    torch.set_num_threads(args.threads)
    # The tutorials' float causal mask beside a bool padding mask: PyTorch warns, and it is what they do.
    warnings.filterwarnings("ignore", message="Support for mismatched key_padding_mask")
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(overrides=config_overrides(args, out))
        fill_model_config(cfg, load_meta(args.data), args.data)
        m, pad = cfg.model, cfg.model.pad_id
        data = ParallelData(args.data, "train")
        count = args.warmup + args.steps
        if batching == "bucketed":
            batches = [data.collate(b) for b in epoch_batches(data.src_lens, data.tgt_lens, args.max_tokens, 1, 0)[:count]]
        else:
            order = np.random.default_rng(1).permutation(len(data))
            batches = [data.collate(order[i:i + args.tutorial_batch])
                       for i in range(0, count * args.tutorial_batch, args.tutorial_batch)]
        torch.manual_seed(1)
        if trainer_kind == "dsmt":
            trainer = Trainer(cfg)  # sets dsmt's threads and allocator itself
            speed, parameters = run_dsmt(trainer, batches, pad, args.warmup), trainer.engine.module.parameters()
        else:
            if args.worker == "baseline_keep_freed_memory":
                keep_freed_memory()
            model = TutorialTransformer(m.vocab_size, m.d_model, m.n_heads, m.n_encoder_layers, m.d_ff, m.dropout, pad)
            speed, parameters = run_baseline(model, batches, pad, args.warmup), model.parameters()
        timed, counts = batches[args.warmup:], parameter_counts(Transformer(m))
        flops = sum(step_flops(m, counts, b["src"].size(0), b["src"].size(1), b["tgt_in"].size(1)) for b in timed)
        return {"tokens_per_s": speed, "padding": padding(batches, pad),
                "flops_per_real_token": flops / sum(real_tokens(b, pad) for b in timed),
                "parameters": sum(p.numel() for p in parameters), "model": OmegaConf.to_container(m)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/multi30k_en_de")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--tutorial-batch", type=int, default=128, help="sentences per tutorial-style batch")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", choices=TRAINERS, help=argparse.SUPPRESS)  # one trainer, in a child process
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return

    results = {name: [] for name in TRAINERS}
    for _ in range(args.rounds):
        for name in TRAINERS:
            command = [sys.executable, __file__, *sys.argv[1:], "--worker", name]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{name} failed:\n{done.stderr[-2000:]}")
            results[name].append(json.loads(done.stdout.splitlines()[-1]))
            print(f"{name}: {results[name][-1]['tokens_per_s']:.0f} tokens/s", file=sys.stderr, flush=True)
    torch.set_num_threads(args.threads)
    peak = matmul_flops_per_s()

    best = {name: max(runs, key=lambda r: r["tokens_per_s"]) for name, runs in results.items()}
    m, base = best["dsmt"]["model"], best["baseline"]["tokens_per_s"]
    print(f"model {m['d_model']}-d, {m['n_encoder_layers']}+{m['n_decoder_layers']} layers, d_ff {m['d_ff']}: "
          f"dsmt {best['dsmt']['parameters'] / 1e6:.2f}M parameters, baseline {best['baseline']['parameters'] / 1e6:.2f}M; "
          f"{args.threads} threads; {args.steps} timed steps, best of {args.rounds} rounds, each in its own process")
    print(f"this CPU's fp32 matmul rate (2048², {args.threads} threads): {peak / 1e9:.0f} GFLOP/s")
    print("| trainer | batches | padding | real src+tgt tokens/s | vs baseline on the same batches "
          "| model GFLOP/s (share of the matmul rate) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (_, batching, description) in TRAINERS.items():
        r = best[name]
        batches = (f"bucketed, {args.max_tokens} tokens" if batching == "bucketed"
                   else f"random order, {args.tutorial_batch} sentences")
        flops = r["tokens_per_s"] * r["flops_per_real_token"]
        print(f"| {description} | {batches} | {r['padding']:.1%} | {r['tokens_per_s']:.0f} | "
              f"{r['tokens_per_s'] / base:.2f}× | {flops / 1e9:.0f} ({flops / peak:.0%}) |")


if __name__ == "__main__":
    main()
