"""Training throughput: a plain PyTorch baseline against dsmt (DeepSpeed ZeRO-0), same model size, same threads.

    python benchmarks/train_throughput.py --data data/multi30k_en_de

The baseline is written the way most tutorials write it: ``torch.nn.Transformer`` with masks built
outside the model and an ordinary loop. It trains on the same length-bucketed batches as dsmt (the
speed ratio) and once more on the tutorials' batching (a fixed number of sentences in random order),
which shows what padding costs. All trainers share one process and take turns step by step, the
order alternating, with a 2048² matrix multiply timed in each turn as well: this machine's speed
drifts by up to 20% within minutes, and turns this short see the same drift. The speedup is the
ratio of summed step times on identical batches; the spread of the per-step ratios shows the noise.
dsmt's process-wide settings (threads, ``keep_freed_memory``) hold for the baseline as well, so the
ratio is what dsmt's model, loss and loop gain. Tokens are real (non-pad) source + target tokens.
A second dsmt trainer, with ``data.subword_sampling`` on, takes its turns on its own sampled stream, each
batch collated inside its timed step (no prefetch thread to hide the cost) and each step charged its share
of the epoch plan (the one sampled pass over the whole corpus, whose ids the batches are built from, timed
separately): its tokens/s against dsmt's is what sampling costs at most.
Model GFLOP/s (benchmarks/flops.py, padded positions included) against the matrix multiply's rate
shows how much headroom is left: on identical batches every trainer does the same model arithmetic.
"""

import argparse
import math
import statistics
import tempfile
import threading
import time
import warnings

import numpy as np
import torch
from torch import nn

from dsmt.config import load_config
from dsmt.data.batching import ParallelData, epoch_batches
from dsmt.data.prepare import load_meta
from dsmt.model import sinusoidal_table
from dsmt.train import Trainer, fill_model_config
from flops import parameter_counts, step_flops

MATMUL_SIZE = 2048
TRAINERS = {"baseline": "plain PyTorch nn.Transformer", "baseline_tutorial": "plain PyTorch nn.Transformer",
            "dsmt": "dsmt, DeepSpeed ZeRO-0"}


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


def baseline_step(model, pad):
    """One step of the tutorials' loop: masks built outside the model, CrossEntropyLoss, Adam."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    criterion = nn.CrossEntropyLoss(ignore_index=pad, label_smoothing=0.1)
    model.train()

    def step(batch):
        src, tgt_in, tgt_out = batch["src"], batch["tgt_in"], batch["tgt_out"]
        tgt_mask = nn.Transformer.generate_square_subsequent_mask(tgt_in.size(1))
        logits = model(src, tgt_in, tgt_mask, src == pad, tgt_in == pad)
        loss = criterion(logits.view(-1, logits.size(-1)), tgt_out.view(-1))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return step


def dsmt_step(trainer, batches):
    """dsmt's own training step (loss over the global batch's tokens, engine.backward/step) on ``batches`` in
    turn: they replace its prefetched stream, prepared as its prefetch thread prepares them."""
    trainer.batches.close()
    prepared = [(trainer._host_batch(batch), None) for batch in batches]
    trainer.batches = iter(prepared + prepared[:1])  # a step also fetches the next step's batches
    trainer.begin()
    return lambda batch: trainer.train_step()


def sampling_step(trainer) -> tuple:
    """dsmt's step on its own subword-sampling stream, each next batch collated inside the step;
    returns the step and the list of the batches it built, and the seconds of an epoch plan per step."""
    trainer.batches.close()
    stream, built = trainer.batches.stream, []
    for thread in threading.enumerate():  # the next epoch's plan, begun in the background: not in the turns
        if thread.name == "dsmt-next-epoch":
            thread.join()
    start = time.perf_counter()
    batches_per_epoch = len(stream.plan(stream.epoch + 1)[1])
    plan_per_step = (time.perf_counter() - start) / batches_per_epoch

    def build():
        for batch in stream:
            built.append(batch)
            yield trainer._host_batch(batch), None
    trainer.batches = build()
    trainer.begin()
    return (lambda batch: trainer.train_step()), built, plan_per_step


def matmul_step(a, b):
    def step(_):
        a @ b
    return step


def padding(batches, pad):
    real = sum(real_tokens(b, pad) for b in batches)
    total = sum(b["src"].numel() + b["tgt_out"].numel() for b in batches)
    return 1 - real / total


def load_batches(args, data, count):
    bucketed = [data.collate(b) for b in epoch_batches(data.src_lens, data.tgt_lens, args.max_tokens, 1, 0)[:count]]
    order = np.random.default_rng(1).permutation(len(data))
    tutorial = [data.collate(order[i:i + args.tutorial_batch])
                for i in range(0, count * args.tutorial_batch, args.tutorial_batch)]
    return bucketed, tutorial


def take_turns(steps: dict, batches: dict, warmup: int, count: int) -> dict[str, list[float]]:
    """Seconds of each timed step per runner; runners go in turn, in rotating order, one step each."""
    names, seconds = list(steps), {name: [] for name in steps}
    for i in range(count):
        for name in names[i % len(names):] + names[:i % len(names)]:
            start = time.perf_counter()
            steps[name](batches[name][i])
            if i >= warmup:
                seconds[name].append(time.perf_counter() - start)
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/multi30k_en_de")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--tutorial-batch", type=int, default=128, help="sentences per tutorial-style batch")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sampling", nargs="*", default=["data.subword_sampling.enabled=true"],
                        help="the overrides of the subword-sampling trainer (default: its defaults)")
    args = parser.parse_args()
    # The tutorials' float causal mask beside a bool padding mask: PyTorch warns, and it is what they do.
    warnings.filterwarnings("ignore", message="Support for mismatched key_padding_mask")
    count = args.warmup + args.steps
    with tempfile.TemporaryDirectory() as out:
        common = [f"data.dir={args.data}", "train.resume=none", f"train.threads={args.threads}",
                  "train.precision=fp32", "train.deepspeed_config=ds_configs/zero0.json"]
        cfg = load_config(overrides=[*common, f"train.output_dir={out}"])
        fill_model_config(cfg, load_meta(args.data), args.data)
        m, pad = cfg.model, cfg.model.pad_id
        bucketed, tutorial = load_batches(args, ParallelData(args.data, "train"), count)
        torch.manual_seed(1)
        trainer = Trainer(cfg)  # sets threads and the allocator for this whole process
        sampling = Trainer(load_config(overrides=[*common, f"train.output_dir={out}/sampling", *args.sampling]))
        sampled_step, sampled, plan_per_step = sampling_step(sampling)
        baseline = lambda: TutorialTransformer(m.vocab_size, m.d_model, m.n_heads, m.n_encoder_layers,  # noqa: E731
                                               m.d_ff, m.dropout, pad)
        square = torch.randn(MATMUL_SIZE, MATMUL_SIZE)
        steps = {"baseline": baseline_step(baseline(), pad), "baseline_tutorial": baseline_step(baseline(), pad),
                 "dsmt": dsmt_step(trainer, bucketed), "dsmt_sampling": sampled_step, "matmul": matmul_step(square, square)}
        batches = {"baseline": bucketed, "baseline_tutorial": tutorial, "dsmt": bucketed, "dsmt_sampling": [None] * count,
                   "matmul": [None] * count}
        seconds = take_turns(steps, batches, args.warmup, count)
        model = trainer.engine.module
        dsmt_parameters, counts = sum(p.numel() for p in model.parameters()), parameter_counts(model)
    peak = 2 * MATMUL_SIZE ** 3 * len(seconds["matmul"]) / sum(seconds["matmul"])
    ratios = sorted(b / d for b, d in zip(seconds["baseline"], seconds["dsmt"]))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3

    print(f"model {m.d_model}-d, {m.n_encoder_layers}+{m.n_decoder_layers} layers, d_ff {m.d_ff}: "
          f"{dsmt_parameters / 1e6:.2f}M parameters; {args.threads} threads; {args.steps} timed steps each, "
          "taken in turns in one process")
    print(f"this CPU's fp32 matmul rate ({MATMUL_SIZE}², {args.threads} threads, timed in the same turns): "
          f"{peak / 1e9:.0f} GFLOP/s")
    print(f"dsmt vs baseline, per step: median {quartiles[1]:.2f}×, middle half {quartiles[0]:.2f}-{quartiles[2]:.2f}×")
    print("| trainer | batches | padding | real src+tgt tokens/s | vs baseline on the same batches "
          "| model GFLOP/s (share of the matmul rate) |")
    print("| --- | --- | --- | --- | --- | --- |")
    speed = {}
    for name, description in TRAINERS.items():
        timed = batches[name][args.warmup:]
        speed[name] = sum(real_tokens(b, pad) for b in timed) / sum(seconds[name])
        flops = sum(step_flops(m, counts, b["src"].size(0), b["src"].size(1), b["tgt_in"].size(1)) for b in timed)
        flops /= sum(seconds[name])
        kind = (f"bucketed, {args.max_tokens} tokens" if batches[name] is bucketed
                else f"random order, {args.tutorial_batch} sentences")
        print(f"| {description} | {kind} | {padding(batches[name], pad):.1%} | {speed[name]:.0f} | "
              f"{speed[name] / speed['baseline']:.2f}× | {flops / 1e9:.0f} ({flops / peak:.0%}) |")
    timed = sampled[args.warmup:count]  # the step that built a batch trains on it next: the same count
    sampled_speed = sum(real_tokens(b, pad) for b in timed) / (sum(seconds["dsmt_sampling"]) + plan_per_step * len(timed))
    print(f"dsmt with subword sampling ({' '.join(args.sampling)}): {sampled_speed:.0f} real src+tgt tokens/s, "
          f"{sampled_speed / speed['dsmt']:.2f}× dsmt's (batches built in the step; epoch plan "
          f"{plan_per_step * 1000:.0f} ms a step, included)")


if __name__ == "__main__":
    main()
