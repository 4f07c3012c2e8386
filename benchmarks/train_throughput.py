"""Training throughput: a plain PyTorch baseline against dsmt (DeepSpeed ZeRO-0), same model size, same threads.

    python benchmarks/train_throughput.py --data data/multi30k_en_de

The baseline is written the way most tutorials write it: ``torch.nn.Transformer`` with masks built
outside the model and an ordinary loop. Both train on the same length-bucketed batches (the speed
ratio); the baseline also trains on the tutorials' batching (a fixed number of sentences in random
order), which shows what padding costs. Tokens are real (non-pad) source + target tokens. The runs
alternate (baseline, dsmt, baseline, dsmt, ...) and the table keeps each one's best round. Model
GFLOP/s (benchmarks/flops.py, padded positions included) against this CPU's own matrix-multiply rate
shows how much headroom is left: on identical batches both trainers do the same arithmetic.
"""

import argparse
import math
import tempfile
import time
import warnings

import numpy as np
import torch
from torch import nn

from dsmt.config import load_config
from dsmt.data.batching import ParallelData, epoch_batches
from dsmt.model import sinusoidal_table
from dsmt.train import Trainer
from flops import matmul_flops_per_s, parameter_counts, step_flops


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


def flops_per_real_token(batches, cfg, params, pad):
    flops = sum(step_flops(cfg, params, b["src"].size(0), b["src"].size(1), b["tgt_in"].size(1)) for b in batches)
    return flops / sum(real_tokens(b, pad) for b in batches)


def padding(batches, pad):
    real = sum(real_tokens(b, pad) for b in batches)
    total = sum(b["src"].numel() + b["tgt_out"].numel() for b in batches)
    return 1 - real / total


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/multi30k_en_de")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--tutorial-batch", type=int, default=128, help="sentences per tutorial-style batch")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # The tutorials' float causal mask beside a bool padding mask: PyTorch warns, and it is what they do.
    warnings.filterwarnings("ignore", message="Support for mismatched key_padding_mask")

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(overrides=[f"data.dir={args.data}", f"train.output_dir={out}", "train.resume=none",
                                     f"train.threads={args.threads}", "train.precision=fp32",
                                     "train.deepspeed_config=ds_configs/zero0.json"])
        trainer = Trainer(cfg)
        m, pad = cfg.model, trainer.pad
        data = ParallelData(args.data, "train")
        count = args.warmup + args.steps
        bucketed = [data.collate(b) for b in epoch_batches(data.src_lens, data.tgt_lens, args.max_tokens, 1, 0)[:count]]
        order = np.random.default_rng(1).permutation(len(data))
        tutorial = [data.collate(order[i:i + args.tutorial_batch])
                    for i in range(0, count * args.tutorial_batch, args.tutorial_batch)]
        torch.manual_seed(1)
        baseline = TutorialTransformer(m.vocab_size, m.d_model, m.n_heads, m.n_encoder_layers, m.d_ff, m.dropout, pad)
        n_dsmt = sum(p.numel() for p in trainer.engine.module.parameters())
        n_base = sum(p.numel() for p in baseline.parameters())

        results = {"baseline": [], "baseline_tutorial": [], "dsmt": []}
        for _ in range(args.rounds):
            results["baseline"].append(run_baseline(baseline, bucketed, pad, args.warmup))
            results["dsmt"].append(run_dsmt(trainer, bucketed, pad, args.warmup))
            results["baseline_tutorial"].append(run_baseline(baseline, tutorial, pad, args.warmup))

        params = parameter_counts(trainer.engine.module)
        peak = matmul_flops_per_s()

    best = {k: max(v) for k, v in results.items()}
    print(f"model {m.d_model}-d, {m.n_encoder_layers}+{m.n_decoder_layers} layers, d_ff {m.d_ff}: dsmt {n_dsmt / 1e6:.2f}M "
          f"parameters, baseline {n_base / 1e6:.2f}M; {args.threads} threads; {args.steps} timed steps, best of {args.rounds}")
    print(f"this CPU's fp32 matmul rate (2048², {args.threads} threads): {peak / 1e9:.0f} GFLOP/s")
    print("| trainer | batches | padding | real src+tgt tokens/s | vs baseline on the same batches "
          "| model GFLOP/s (share of the matmul rate) |")
    print("| --- | --- | --- | --- | --- | --- |")
    rows = [("plain PyTorch nn.Transformer", f"bucketed, {args.max_tokens} tokens", bucketed, best["baseline"]),
            ("plain PyTorch nn.Transformer", f"random order, {args.tutorial_batch} sentences", tutorial,
             best["baseline_tutorial"]),
            ("dsmt, DeepSpeed ZeRO-0", f"bucketed, {args.max_tokens} tokens", bucketed, best["dsmt"])]
    for name, batching, batches, speed in rows:
        flops = speed * flops_per_real_token(batches[args.warmup:], m, params, pad)
        print(f"| {name} | {batching} | {padding(batches, pad):.1%} | {speed:.0f} | {speed / best['baseline']:.2f}× "
              f"| {flops / 1e9:.0f} ({flops / peak:.0%}) |")


if __name__ == "__main__":
    main()
