"""The training loop: get batches, forward, backward, step, log, maybe validate, maybe save.

It knows the model only through its forward (loss sums given the targets, logits for greedy validation)
and its config; DeepSpeed only through the engine; data only through ``BatchStream``.
"""

import ctypes
import hashlib
import json
import os
import resource
import signal
import time
from pathlib import Path
from unittest import mock

import numpy as np
import sacrebleu
import sentencepiece as spm
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from tqdm import tqdm

from dsmt import DsmtError, checkpoint, faults
from dsmt.data.batching import BatchStream, ParallelData, epoch_batches, shard
from dsmt.data.prepare import load_meta
from dsmt.decode import cached_logits, greedy, max_output_length
from dsmt.engine import (build_engine, close_distributed, gradient_bytes, init_distributed, optimizer_description,
                         partitioned_bytes, read_ds_config, zero_stage)
from dsmt.model import Transformer


def step_seed(seed: int, step: int, rank: int) -> int:
    """Dropout's RNG is reseeded from (seed, step, rank) each step, so a resumed run draws the same masks."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


def peak_rss_mb() -> float:
    """This process's peak resident memory (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def keep_freed_memory() -> None:
    """Make glibc's malloc keep freed memory for reuse instead of handing it back to the kernel.

    By default every block over 32 MB (a step's logits, their log-probabilities and gradients) is a fresh
    mmap, unmapped again when freed, so each training step page-faults hundreds of MB back in: on a CPU
    about a tenth of the step is spent in the kernel zeroing pages. PyTorch's CPU tuning guide swaps the
    allocator for this (jemalloc, tcmalloc); two mallopt calls get the same from the one every Linux
    process has, at the price of a slightly higher resident peak. Elsewhere (macOS, musl) nothing happens.
    """
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_max = -1, -4  # from glibc's malloc.h
    mallopt(m_mmap_max, 0)  # large blocks come from the heap, where freed ones are reused
    mallopt(m_trim_threshold, 2 ** 31 - 1)  # and the heap's free top is never returned


def use_deterministic_kernels(enabled: bool) -> None:
    """``train.deterministic``: PyTorch picks deterministic kernels (and raises on an op that has none), and
    cuBLAS gets the fixed workspace it needs for reproducible results (set before CUDA starts)."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def fill_model_config(cfg, meta: dict, data_dir: str) -> None:
    """Vocabulary sizes and the pad id come from the data directory, never from the user."""
    vocab = meta["vocab_size"]
    cfg.model.vocab_size = vocab[meta["tgt"]]
    cfg.model.src_vocab_size = 0 if meta["joint"] else vocab[meta["src"]]
    cfg.model.pad_id = meta["specials"]["pad"]
    if cfg.model.share_embeddings and not meta["joint"]:
        raise DsmtError(f"model.share_embeddings=true needs a joint vocabulary, but {data_dir} was prepared with "
                        "--separate-vocab; set model.share_embeddings=false")


def check_lengths(data: ParallelData, split: str, cfg) -> None:
    """Before step 1, not at the first validation: every pair of ``split`` fits a batch and the model."""
    lengths = np.maximum(data.src_lens, data.tgt_lens)  # with EOS (source, target output) or BOS (target input)
    index = int(lengths.argmax())
    longest, where = int(lengths[index]), f"{cfg.data.dir}: pair {index + 1} of split {split!r}"
    if split == "train":
        advice = "raise {key} or prepare the data with a smaller --max-len"
    else:
        advice = f"evaluation splits are kept whole (line {index + 1} of its text): raise {{key}} to at least {longest}"
    for key, limit in (("data.max_tokens", cfg.data.max_tokens), ("model.max_positions", cfg.model.max_positions)):
        if longest > limit:
            raise DsmtError(f"{where} has {longest} tokens, more than {key}={limit}; " + advice.format(key=key))


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.activity = "start-up"  # what this rank is doing, for the message when a collective times out
        use_deterministic_kernels(cfg.train.deterministic)
        self.rank, self.world, local_world = init_distributed(cfg.train.dist_timeout_minutes)
        torch.set_num_threads(cfg.train.threads or max(1, (os.cpu_count() or 1) // local_world))
        keep_freed_memory()
        checkpoint.check_output_dir(cfg.train.output_dir)
        meta = load_meta(cfg.data.dir)
        fill_model_config(cfg, meta, cfg.data.dir)
        self.pad, self.bos, self.eos = (meta["specials"][k] for k in ("pad", "bos", "eos"))
        self.train_data = ParallelData(cfg.data.dir, "train")
        self.valid_data = ParallelData(cfg.data.dir, cfg.data.valid_split)
        check_lengths(self.train_data, "train", cfg)
        check_lengths(self.valid_data, cfg.data.valid_split, cfg)
        self.references = (Path(cfg.data.dir) / f"{cfg.data.valid_split}.{meta['tgt']}.txt").read_text().splitlines()
        self.spm_paths = {side: str(Path(cfg.data.dir) / meta["spm"][meta[side]]) for side in ("src", "tgt")}
        self.sp = spm.SentencePieceProcessor(model_file=self.spm_paths["tgt"])

        self.spm_sha256 = {side: hashlib.sha256(Path(path).read_bytes()).hexdigest()
                           for side, path in self.spm_paths.items()}

        source, universal = self._resume_source()
        torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
        self.engine, ds_config = build_engine(Transformer(cfg.model), cfg, self.world, load_universal=universal)
        if self.rank == 0:
            print(f"optimizer: {optimizer_description(self.engine)}", flush=True)
        self.accumulation = ds_config["gradient_accumulation_steps"]
        self.precision = next((k for k in ("fp16", "bf16") if ds_config[k]["enabled"]), "fp32")
        self.stream = BatchStream(self.train_data, cfg.data.max_tokens, cfg.train.seed, self.rank, self.world)
        self.step, self.best_bleu, self.minutes_before, self.grad_bytes = 0, -1.0, 0.0, None
        self.skipped_steps, self.skips_in_a_row, self.stop_signal = 0, 0, None
        state = checkpoint.load(self.engine, source) if source else None
        if state:
            self.step, self.best_bleu, self.minutes_before = state["step"], state["best_bleu"], state["train_minutes"]
            self.skipped_steps = state["non_finite_steps"]
            self.stream.load_state_dict(state["data"])
        self.writer = self.log_file = None
        if self.rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            out = Path(cfg.train.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
            self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=self.step + 1 if state else None)
            self.log_file = open(out / checkpoint.TRAIN_LOG, "a")

    def _resume_source(self) -> tuple:
        """(checkpoint to resume from or None, whether it is a universal one). A ZeRO checkpoint written by
        another number of ranks or another stage ≥ 1 goes through DeepSpeed's universal checkpoint, which
        keeps the optimizer state (elastic resume)."""
        tc = self.cfg.train
        source = checkpoint.resume_source(tc.output_dir, tc.resume)
        if source is None:
            return None, False
        states = checkpoint.model_states(source)
        checkpoint.check_resumable(source, states, self.cfg.model, self.spm_sha256, self.cfg.data.dir)
        saved = checkpoint.zero_layout(states)
        stage = zero_stage(read_ds_config(tc.deepspeed_config))
        if saved == (stage, self.world) or saved[0] == stage == 0:
            return source, False
        if 0 in (saved[0], stage):
            raise DsmtError(f"{source} was written with ZeRO-{saved[0]} and this job uses ZeRO-{stage} "
                            f"({tc.deepspeed_config}); resume with a ds_config of stage {saved[0]}")
        return checkpoint.to_universal(source, tc.output_dir), True

    def _on_signal(self, signum, frame) -> None:
        """SIGTERM/SIGINT: finish the step, save, exit 0. A second signal acts as usual."""
        self.stop_signal = signal.Signals(signum).name
        signal.signal(signum, signal.SIG_DFL)

    # ---- collectives ------------------------------------------------------------------------------
    def _sum(self, values) -> list[float]:
        total = torch.tensor(values, dtype=torch.float64, device=self.engine.device)
        dist.all_reduce(total)
        return total.tolist()

    def _all_done(self, local_done: bool) -> bool:
        return self._sum([0.0 if local_done else 1.0])[0] == 0.0

    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.engine.device, non_blocking=True) for k, v in batch.items()}

    # ---- one optimizer step -----------------------------------------------------------------------
    def train_step(self) -> dict:
        self.activity = f"training step {self.step + 1}"
        faults.trigger("kill", self.step + 1, self.rank)
        faults.trigger("hang", self.step + 1, self.rank)
        torch.manual_seed(step_seed(self.cfg.train.seed, self.step, self.rank))
        micro = [self._to_device(next(self.stream)) for _ in range(self.accumulation)]
        src_tokens, tgt_tokens = self._sum([sum(int((b["src"] != self.pad).sum()) for b in micro),
                                            sum(int((b["tgt_out"] != self.pad).sum()) for b in micro)])
        # The update is sum(loss) / target tokens of the global batch, as fairseq does; DeepSpeed averages
        # gradients over ranks and accumulation steps, so multiply that average back out.
        scale = self.world * self.accumulation / tgt_tokens
        sums, grad_norm, applied = torch.zeros(2, dtype=torch.float64, device=self.engine.device), None, True
        for batch in micro:
            loss, nll = self.engine(batch["src"], batch["tgt_in"], batch["tgt_out"], self.cfg.train.label_smoothing)
            if faults.due("nan", self.step + 1, self.rank):
                loss = loss * float("nan")
            self.engine.backward(loss * scale)
            if self.engine.is_gradient_accumulation_boundary():
                grad_norm = self._replicated_grad_norm()
                applied = grad_norm is None or bool(torch.isfinite(grad_norm))
                if self.grad_bytes is None:  # measured once, for the memory record of the first step
                    self.grad_bytes = gradient_bytes(self.engine)
            if applied:
                self.engine.step()
            else:  # plain fp32 ZeRO-0, the one path where DeepSpeed does not check: step it without the update
                with mock.patch.object(self.engine.optimizer, "step", lambda *args, **kwargs: None):
                    self.engine.step()
            sums += torch.stack([loss.detach(), nll.detach()]).double()
        loss_sum, nll_sum = self._sum(sums.tolist())
        self.step += 1
        grad_norm = self.engine.get_global_grad_norm() or grad_norm
        # ZeRO, bf16 and fp16 optimizers skip a non-finite step themselves (fp16 also lowers its loss scale).
        return {"loss": loss_sum / tgt_tokens, "nll": nll_sum / tgt_tokens, "tokens": src_tokens + tgt_tokens,
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "skipped": not (applied and self.engine.was_step_applied())}

    def _replicated_grad_norm(self):
        """DeepSpeed reports the gradient norm from its ZeRO and mixed-precision optimizers, but its plain
        fp32 ZeRO-0 path clips without keeping it; there the full, reduced gradients sit on the parameters."""
        if self.engine.zero_optimization_stage() or self.precision != "fp32":
            return None
        norms = [torch.linalg.vector_norm(p.grad) for p in self.engine.module.parameters() if p.grad is not None]
        return torch.linalg.vector_norm(torch.stack(norms))

    # ---- validation -------------------------------------------------------------------------------
    @torch.no_grad()
    def validate(self) -> dict:
        """Valid loss, and BLEU of greedy output; every rank decodes its shard and runs the model in lockstep."""
        self.activity = f"validation after step {self.step}"
        self.engine.eval()
        data, ev = self.valid_data, self.cfg.eval
        all_batches = epoch_batches(data.src_lens, data.tgt_lens, self.cfg.data.max_tokens, seed=0, epoch=0)
        sums, hypotheses = [0.0, 0.0, 0.0], {}
        for k, indices in enumerate(shard(all_batches, self.rank, self.world)):
            batch = self._to_device(data.collate(indices))
            # Every rank runs every forward (ZeRO-3 gathers parameters collectively); shard()'s repeats don't count.
            loss, nll = self.engine(batch["src"], batch["tgt_in"], batch["tgt_out"], self.cfg.train.label_smoothing)
            if self.rank + k * self.world < len(all_batches):
                sums = [sums[0] + loss.item(), sums[1] + nll.item(), sums[2] + int((batch["tgt_out"] != self.pad).sum())]
            if ev.valid_bleu:
                max_len = max_output_length(batch["src"].size(1), ev.max_len_a, ev.max_len_b,
                                            self.cfg.model.max_positions)
                found = greedy(self._next_logits(batch["src"]), len(indices), self.engine.device,
                               self.bos, self.eos, self.pad, max_len, self._all_done)
                hypotheses.update(zip(map(int, indices), found))
        loss, nll, tokens = self._sum(sums)
        metrics = {"loss": loss / tokens, "nll": nll / tokens}
        if ev.valid_bleu:
            gathered = [None] * self.world
            dist.all_gather_object(gathered, hypotheses)
            merged = {i: h for part in gathered for i, h in part.items()}
            text = [self.sp.decode(merged[i]) for i in range(len(data))]
            metrics["bleu"] = sacrebleu.corpus_bleu(text, [self.references]).score
        self.engine.train()
        return metrics

    def _next_logits(self, src: torch.Tensor):
        """``prefix -> logits`` for greedy decoding. ZeRO-3 gathers its partitioned parameters only inside the
        engine's forward, so there every step reruns the full forward (O(T²)); otherwise the model decodes
        incrementally with its key/value cache."""
        if self.engine.zero_optimization_partition_weights():
            return lambda prefix: self.engine(src, prefix)
        return cached_logits(self.engine.module, src)

    # ---- logging and saving -------------------------------------------------------------------------
    def log(self, kind: str, metrics: dict) -> None:
        if self.rank != 0:
            return
        for name, value in metrics.items():
            self.writer.add_scalar(f"{kind}/{name}", value, self.step)
        self.log_file.write(json.dumps({"kind": kind, "step": self.step, **metrics}) + "\n")
        self.log_file.flush()
        tqdm.write(f"{kind} step {self.step}: " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))

    def save(self, best: bool) -> None:
        self.activity = f"saving the checkpoint of step {self.step}"
        # Not "skipped_steps": DeepSpeed keeps its own count under that key.
        client_state = {"step": self.step, "data": self.stream.state_dict(), "best_bleu": self.best_bleu,
                        "train_minutes": self.minutes(), "non_finite_steps": self.skipped_steps,
                        "config": OmegaConf.to_container(self.cfg), "spm": self.spm_paths, "spm_sha256": self.spm_sha256}
        checkpoint.save(self.engine, self.cfg.train.output_dir, self.step, client_state, self.cfg.train.keep_last, best)

    def minutes(self) -> float:
        """Wall-clock minutes of training so far, earlier runs of a resumed job included."""
        return self.minutes_before + (time.time() - self.started) / 60

    def _stop_reason(self) -> str | None:
        """A signal on any rank, or ``train.max_minutes`` by rank 0's clock; one collective per step, so that
        every rank stops after the same step."""
        self.activity = f"agreeing whether to stop after step {self.step}"
        limit = self.cfg.train.max_minutes
        out_of_time = self.rank == 0 and limit > 0 and self.minutes() >= limit
        signalled, late = self._sum([float(self.stop_signal is not None), float(out_of_time)])
        return "signal" if signalled else "time" if late else None

    def _count_skip(self, stats: dict) -> None:
        """A step whose loss or gradient was not finite changed nothing; too many in a row stop the run."""
        if not stats["skipped"]:
            self.skips_in_a_row = 0
            return
        self.skipped_steps, self.skips_in_a_row = self.skipped_steps + 1, self.skips_in_a_row + 1
        record = {"skipped_steps": self.skipped_steps, "in_a_row": self.skips_in_a_row}
        if self.precision == "fp16":  # the loss scaler's own skip: it has just lowered the scale
            record["loss_scale"] = float(self.engine.optimizer.loss_scale)
        self.log("skip", record)
        limit = self.cfg.train.max_skips_in_a_row
        if self.precision != "fp16" and self.skips_in_a_row >= limit:
            self.save(best=False)  # skipped steps changed no parameter: this is the last good state
            raise DsmtError(f"{limit} steps in a row had a non-finite loss or gradient (train.max_skips_in_a_row); "
                            f"stopped at step {self.step}, last good parameters saved in {self.cfg.train.output_dir}; "
                            "lower train.lr or check the data")

    def run(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        progress = tqdm(total=self.cfg.train.max_steps, initial=self.step, disable=self.rank != 0 or None, unit="step")
        try:
            stop = self._loop(progress)
        except RuntimeError as e:  # how Gloo and NCCL report a collective that failed
            raise self._collective_failure(e) from None
        finally:  # also on an error: the process ends without finalization (dsmt.cli), so close what buffers
            progress.close()
            if self.rank == 0:
                self.writer.close()
                self.log_file.close()
        if stop == "signal" and self.rank == 0:
            tqdm.write(f"stopped by {self.stop_signal or 'a signal to another rank'} after step {self.step}; "
                       f"checkpoint saved, resume with train.resume=auto")

    def _collective_failure(self, error: RuntimeError) -> Exception:
        """A timed-out collective, or a peer that is gone, as one line naming what this rank was doing."""
        text = str(error).lower()
        if "timed out" in text:
            return DsmtError(f"rank {self.rank} waited longer than train.dist_timeout_minutes="
                             f"{self.cfg.train.dist_timeout_minutes} in a collective during {self.activity}; another "
                             f"rank is stuck, see its log ({str(error).strip().splitlines()[0][:160]})")
        if "connection closed" in text or "connection reset" in text:
            return DsmtError(f"rank {self.rank} lost its connection to another rank during {self.activity}: that "
                             "rank ended, see its error")
        return error

    def _loop(self, progress) -> str | None:
        """Train until max_steps, the time budget or a signal; returns the stop reason (None: max_steps)."""
        tc = self.cfg.train
        self.started, started_step, window_seconds, window_tokens = time.time(), self.step, 0.0, 0
        stop = self._stop_reason()  # a resumed run may have no time left
        done = self.step >= tc.max_steps or stop is not None
        while not done:
            step_start = time.time()
            stats = self.train_step()
            window_seconds, window_tokens = window_seconds + time.time() - step_start, window_tokens + stats["tokens"]
            progress.update()
            self._count_skip(stats)
            stop = self._stop_reason()
            done = self.step >= tc.max_steps or stop is not None
            if self.step == started_step + 1:  # optimizer state exists after the first step
                self.log("memory", {**partitioned_bytes(self.engine), "gradient_bytes": self.grad_bytes})
            if self.step % tc.log_interval == 0 or done:
                # Source+target tokens of the global batch per second of training steps (validation excluded).
                metrics = {"loss": stats["loss"], "nll": stats["nll"], "ppl": float(np.exp(stats["nll"])),
                           "lr": self.engine.get_lr()[0], "tokens_per_s": window_tokens / window_seconds,
                           "tokens_per_s_per_rank": window_tokens / window_seconds / self.world,
                           "wall_minutes": self.minutes(), "peak_rss_mb": peak_rss_mb(),
                           "skipped_steps": self.skipped_steps}
                if stats["grad_norm"] is not None:
                    metrics["grad_norm"] = stats["grad_norm"]
                if self.precision == "fp16":
                    metrics["loss_scale"] = float(self.engine.optimizer.loss_scale)
                self.log("train", metrics)
                progress.set_postfix(loss=f"{stats['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
                window_seconds, window_tokens = 0.0, 0
            improved = False
            if (self.step % tc.valid_interval == 0 or done) and stop != "signal":  # pre-emption: save at once
                metrics = self.validate()
                metrics["wall_minutes"] = self.minutes()
                if "bleu" in metrics and metrics["bleu"] > self.best_bleu:
                    self.best_bleu, improved = metrics["bleu"], True
                self.log("valid", metrics)
            if self.step % tc.save_interval == 0 or done or improved:
                self.save(best=improved)
        return stop


def train(cfg) -> None:
    try:
        Trainer(cfg).run()
    finally:
        close_distributed()
