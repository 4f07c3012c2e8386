"""The training loop: get batches, forward, backward, step, log, maybe validate, maybe save.

It knows the model only through its forward (loss sums given the targets, logits for greedy validation), the
``Padding`` it may be told, and its config; DeepSpeed only through the engine; data only through ``BatchStream``.

On a GPU the host queues work ahead of the device and must not wait for it inside a step: token counts come
from the lengths on the host, batches are built ahead in a thread into pinned memory, and the step's one
all-reduce (loss sums, stop flags, the next step's token counts) is read a step later, when it is long done.
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
from dsmt.data.batching import BatchStream, ParallelData, Prefetcher, epoch_batches
from dsmt.data.sampling import SubwordSampler
from dsmt.data.prepare import load_meta
from dsmt.decode import cached_logits, greedy, max_output_length
from dsmt.engine import (allow_tf32, build_engine, close_distributed, gradient_bytes, init_distributed,
                         optimizer_description, partitioned_bytes, read_ds_config, zero_stage)
from dsmt.model import Padding, Transformer

# Layout of the step's all-reduced vector: this step's sums, stop flags, then the next step's token counts.
LOSS, NLL, SIGNALLED, OUT_OF_TIME, NEXT_SRC_TOKENS, NEXT_TGT_TOKENS = range(6)


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


class HostCopy:
    """A device tensor's values on their way to the host: the copy is queued behind the work that produced them,
    and ``values()`` waits for that copy only, not for whatever the device was given after it."""

    def __init__(self, tensor: torch.Tensor):
        self.host = tensor.to("cpu", non_blocking=True)  # into pinned memory when it comes from a GPU
        self.copied = None
        if tensor.device.type == "cuda":
            self.copied = torch.cuda.Event()
            self.copied.record()

    def values(self) -> list[float]:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


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
        allow_tf32(cfg.train.tf32)
        self.cores = max(1, (os.cpu_count() or 1) // local_world)  # this rank's share of the node's cores
        torch.set_num_threads(cfg.train.threads or self.cores)
        keep_freed_memory()
        checkpoint.check_output_dir(cfg.train.output_dir)
        self.meta = meta = load_meta(cfg.data.dir)
        fill_model_config(cfg, meta, cfg.data.dir)
        self.pad, self.bos, self.eos = (meta["specials"][k] for k in ("pad", "bos", "eos"))
        self.train_data = ParallelData(cfg.data.dir, "train")
        self.valid_data = ParallelData(cfg.data.dir, cfg.data.valid_split)
        check_lengths(self.train_data, "train", cfg)
        check_lengths(self.valid_data, cfg.data.valid_split, cfg)
        sampler = self._subword_sampler()
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
        self.pin_memory = self.engine.device.type == "cuda"
        # Ranks share a sampled epoch's pass, exchanging its lengths; one rank makes it alone.
        exchange = self._all_gather if sampler is not None and self.world > 1 else None
        stream = BatchStream(self.train_data, cfg.data.max_tokens, cfg.train.seed, self.rank, self.world, sampler,
                             exchange)
        self.step, self.best_bleu, self.minutes_before, self.grad_bytes = 0, -1.0, 0.0, None
        self.valid_bleu = {}  # step -> valid BLEU, this run's validations
        self.skipped_steps, self.skips_in_a_row, self.stop_signal = 0, 0, None
        state = checkpoint.load(self.engine, source) if source else None
        if state:
            self.step, self.best_bleu, self.minutes_before = state["step"], state["best_bleu"], state["train_minutes"]
            self.skipped_steps = state["non_finite_steps"]
            stream.load_state_dict(state["data"])
        # Batches come (built ahead) with the stream's state after each; a checkpoint stores the state after the
        # last batch trained on, not after those fetched ahead.
        self.batches, self.data_state = Prefetcher(stream, self._host_batch, depth=2 * self.accumulation), stream.state_dict()
        self.next_micro = self.reduced = None  # the next step's (batch, state) pairs, the last step's all-reduce
        self.writer = self.log_file = None
        if self.rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            out = Path(cfg.train.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
            self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=self.step + 1 if state else None)
            self.log_file = open(out / checkpoint.TRAIN_LOG, "a")

    def _subword_sampler(self) -> SubwordSampler | None:
        options, cfg = self.cfg.data.subword_sampling, self.cfg
        if not options.enabled:
            return None
        fits = min(cfg.data.max_tokens, cfg.model.max_positions) - 1  # room left for EOS (BOS)
        threads = options.threads or (self.cores if torch.cuda.is_available() else 1)
        return SubwordSampler(self.train_data, cfg.data.dir, options.sides, options.alpha, options.nbest,
                              cfg.train.seed, max_len=fits, threads=threads)

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

    # ---- batches and collectives --------------------------------------------------------------------
    def _host_batch(self, batch: dict) -> dict:
        """Everything about a batch the host can know, worked out where it is built (the prefetch thread):
        its padding for the model and its token counts, in pinned memory when bound for a GPU. The sentence
        indices stay on the host."""
        tensors = {k: batch[k] for k in ("src", "tgt_in", "tgt_out")}
        padding = Padding.of_lengths(batch["src_lengths"], batch["tgt_lengths"], tensors["src"].size(1),
                                     tensors["tgt_in"].size(1))
        if self.pin_memory:
            tensors, padding = {k: v.pin_memory() for k, v in tensors.items()}, padding.pin_memory()
        return {**tensors, "padding": padding, "indices": batch["indices"],
                "src_tokens": int(batch["src_lengths"].sum()), "tgt_tokens": int(batch["tgt_lengths"].sum())}

    def _device_batch(self, batch: dict) -> dict:
        device = self.engine.device
        moved = {k: batch[k].to(device, non_blocking=True) for k in ("src", "tgt_in", "tgt_out")}
        return {**moved, "padding": batch["padding"].to(device, non_blocking=True)}

    def _all_gather(self, array: np.ndarray) -> list[np.ndarray]:
        """Every rank's ``array`` (the same shape on each), through the job's group: on the GPU there (NCCL
        gathers device tensors only)."""
        self.activity = "exchanging the sampled lengths of an epoch"
        tensor = torch.from_numpy(array).to(self.engine.device)
        gathered = [torch.empty_like(tensor) for _ in range(self.world)]
        dist.all_gather(gathered, tensor)
        return [t.cpu().numpy() for t in gathered]

    def _reduce_step(self, sums: torch.Tensor) -> torch.Tensor:
        """The one all-reduce of a step: its loss sums, whether any rank was signalled or rank 0 is out of time,
        and the token counts of the next step's batches, taken from the prefetcher now (they scale its loss)."""
        self.next_micro = [next(self.batches) for _ in range(self.accumulation)]  # may exchange sampled lengths
        self.activity = f"agreeing on the totals of step {self.step}"
        limit = self.cfg.train.max_minutes
        out_of_time = self.rank == 0 and limit > 0 and self.minutes() >= limit
        batches = [batch for batch, _ in self.next_micro]
        local = torch.tensor([float(self.stop_signal is not None), float(out_of_time),
                              sum(b["src_tokens"] for b in batches), sum(b["tgt_tokens"] for b in batches)],
                             dtype=torch.float64, pin_memory=self.pin_memory)
        vector = torch.cat([sums, local.to(self.engine.device, non_blocking=True)])
        dist.all_reduce(vector)
        return vector, HostCopy(vector)

    # ---- one optimizer step -----------------------------------------------------------------------
    def begin(self) -> str | None:
        """Fetch and count the first step's batches; the stop reason if the run must not take a step."""
        self.reduced = self._reduce_step(torch.zeros(2, dtype=torch.float64, device=self.engine.device))
        return self._stop_reason(self.reduced[1].values())

    def train_step(self) -> dict:
        """One optimizer step on the batches ``_reduce_step`` fetched and counted; returns its record, whose
        numbers stay on the device until ``_read`` (log steps only)."""
        self.activity = f"training step {self.step + 1}"
        faults.trigger("kill", self.step + 1, self.rank)
        faults.trigger("hang", self.step + 1, self.rank)
        torch.manual_seed(step_seed(self.cfg.train.seed, self.step, self.rank))
        totals, totals_on_host = self.reduced  # all-reduced at the end of the previous step
        # The update is sum(loss) / target tokens of the global batch, as fairseq does; DeepSpeed averages
        # gradients over ranks and accumulation steps, so multiply that average back out.
        scale = (self.world * self.accumulation / totals[NEXT_TGT_TOKENS]).float()
        sums, grad_norm, applied = torch.zeros(2, dtype=torch.float64, device=self.engine.device), None, True
        for batch in (self._device_batch(batch) for batch, _ in self.next_micro):
            loss, nll = self.engine(batch["src"], batch["tgt_in"], batch["tgt_out"], self.cfg.train.label_smoothing,
                                    padding=batch["padding"])
            if faults.due("nan", self.step + 1, self.rank):
                loss = loss * float("nan")
            self.engine.backward(loss * scale)
            if self.engine.is_gradient_accumulation_boundary():
                grad_norm = self._replicated_grad_norm()
                # The one host wait left in a step, on plain fp32 ZeRO-0 only (the other paths' optimizers check).
                applied = grad_norm is None or bool(torch.isfinite(grad_norm))
                if self.grad_bytes is None:  # measured once, for the memory record of the first step
                    self.grad_bytes = gradient_bytes(self.engine)
            if applied:
                self.engine.step()
            else:  # plain fp32 ZeRO-0, the one path where DeepSpeed does not check: step it without the update
                with mock.patch.object(self.engine.optimizer, "step", lambda *args, **kwargs: None):
                    self.engine.step()
            sums += torch.stack([loss.detach(), nll.detach()]).double()
        self.step, self.data_state = self.step + 1, self.next_micro[-1][1]
        self.reduced = self._reduce_step(sums)
        # ZeRO, bf16 and fp16 optimizers skip a non-finite step themselves (fp16 also lowers its loss scale).
        # The norm stays where the optimizer left it (a device tensor at ZeRO-1/2): testing its truth here would
        # make the host wait for the whole step before it could queue the next one.
        reported = self.engine.get_global_grad_norm()
        return {"totals": totals_on_host.values(), "sums": self.reduced[1],
                "grad_norm": grad_norm if reported is None else reported,
                "skipped": not (applied and self.engine.was_step_applied())}

    @staticmethod
    def _losses(stats: dict) -> dict:
        """A step's loss, nll and gradient norm on the host (waits for the step to finish: log steps only)."""
        sums, tokens, grad_norm = stats["sums"].values(), stats["totals"][NEXT_TGT_TOKENS], stats["grad_norm"]
        losses = {"loss": sums[LOSS] / tokens, "nll": sums[NLL] / tokens}
        return losses if grad_norm is None else {**losses, "grad_norm": float(grad_norm)}

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
        """Valid loss, and BLEU of greedy output: every rank evaluates its shard with whole parameters and no
        collective, and the sums and hypotheses are gathered at the end."""
        self.activity = f"validation after step {self.step}"
        self.engine.eval()
        data, ev = self.valid_data, self.cfg.eval
        model = self._whole_model()
        all_batches = epoch_batches(data.src_lens, data.tgt_lens, self.cfg.data.max_tokens, seed=0, epoch=0)
        sums, hypotheses = torch.zeros(3, dtype=torch.float64, device=self.engine.device), {}
        # Round robin with no collective inside: a rank may get fewer batches than another, or none.
        for k in range(self.rank, len(all_batches), self.world):
            host = self._host_batch(data.collate(all_batches[k]))
            batch = self._device_batch(host)
            loss, nll = model(batch["src"], batch["tgt_in"], batch["tgt_out"], self.cfg.train.label_smoothing,
                              padding=batch["padding"])
            sums += torch.stack([loss.double(), nll.double(), loss.new_tensor(host["tgt_tokens"], dtype=torch.float64)])
            if ev.valid_bleu:
                max_len = max_output_length(batch["src"].size(1), ev.max_len_a, ev.max_len_b,
                                            self.cfg.model.max_positions)
                found = greedy(cached_logits(model, batch["src"], batch["padding"]), len(host["indices"]),
                               self.engine.device, self.bos, self.eos, self.pad, max_len)
                hypotheses.update(zip(map(int, host["indices"]), found))
        del model
        dist.all_reduce(sums)
        loss, nll, tokens = sums.tolist()
        metrics = {"loss": loss / tokens, "nll": nll / tokens}
        if ev.valid_bleu:
            gathered = [None] * self.world
            dist.all_gather_object(gathered, hypotheses)
            merged = {i: h for part in gathered for i, h in part.items()}
            text = [self.sp.decode(merged[i]) for i in range(len(data))]
            metrics["bleu"] = sacrebleu.corpus_bleu(text, [self.references]).score
        self.engine.train()
        return metrics

    def _whole_model(self) -> torch.nn.Module:
        """The module with every parameter whole on this rank. ZeRO-3 keeps 1/world of each and gathers it in
        every forward, which decoding token by token would repeat for every token (and in lockstep across
        ranks). So its parameters are gathered once per validation, a top-level module at a time, into a plain
        replica that decodes with the key/value cache like the other stages (one copy of the weights per rank,
        freed after validation)."""
        module = self.engine.module
        if not self.engine.zero_optimization_partition_weights():
            return module
        import deepspeed

        dtype = next(module.parameters()).dtype
        replica = Transformer(self.cfg.model).to(device=self.engine.device, dtype=dtype).eval()
        targets = dict(replica.named_parameters(remove_duplicate=False))
        for name, child in module.named_children():
            params = list(child.named_parameters(prefix=name, remove_duplicate=False))
            with deepspeed.zero.GatheredParameters([p for _, p in params]):
                for key, param in params:
                    targets[key].data.copy_(param.data)
        return replica

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
        client_state = {"step": self.step, "data": self.data_state, "best_bleu": self.best_bleu,
                        "train_minutes": self.minutes(), "non_finite_steps": self.skipped_steps,
                        "config": OmegaConf.to_container(self.cfg), "spm": self.spm_paths, "spm_sha256": self.spm_sha256}
        checkpoint.save(self.engine, self.cfg.train.output_dir, self.step, client_state, self.cfg.train.keep_last, best)

    def minutes(self) -> float:
        """Wall-clock minutes of training so far, earlier runs of a resumed job included."""
        return self.minutes_before + (time.time() - self.started) / 60

    @staticmethod
    def _stop_reason(totals: list[float]) -> str | None:
        """A signal on any rank, or ``train.max_minutes`` by rank 0's clock, as all-reduced by ``_reduce_step``:
        every rank stops after the same step."""
        return "signal" if totals[SIGNALLED] else "time" if totals[OUT_OF_TIME] else None

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
            self.batches.close()
            if self.rank == 0:
                self.writer.close()
                self.log_file.close()
        if self.rank != 0:
            return
        if stop == "signal":
            tqdm.write(f"stopped by {self.stop_signal or 'a signal to another rank'} after step {self.step}; "
                       f"checkpoint saved, resume with train.resume=auto")
        for line in self._closing_lines():
            tqdm.write(line)

    def _closing_lines(self) -> list[str]:
        """Where the run's best and last checkpoints are, and the commands to use them."""
        folder = checkpoint.checkpoints_dir(self.cfg.train.output_dir)
        last = folder / checkpoint.tag_for(self.step)
        last_bleu = self.valid_bleu.get(self.step)
        last_text = f"{last} (valid BLEU {last_bleu:.2f})" if last_bleu is not None else f"{last} (not validated)"
        best = folder / "best"
        if best.is_symlink():
            chosen = best
            where = f"best checkpoint: {best} -> {os.readlink(best)} (valid BLEU {self.best_bleu:.2f}); last: {last_text}"
        else:
            chosen, where = last, f"last checkpoint: {last_text}"
        data, splits = Path(self.cfg.data.dir), [s for s in self.meta["splits"] if s != "train"]
        test = next((s for s in splits if s.startswith("test") or s.startswith("newstest")), self.cfg.data.valid_split)
        src, tgt = self.meta["src"], self.meta["tgt"]
        name = Path(self.cfg.train.output_dir).name
        return [where, f"next: dsmt evaluate --checkpoint {chosen} --src {data / f'{test}.{src}.txt'} "
                       f"--ref {data / f'{test}.{tgt}.txt'}  |  dsmt translate --checkpoint {chosen} < input.{src}  |  "
                       f"dsmt export --checkpoint {chosen} --out models/{name}"]

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
        stop = self.begin()  # a resumed run may have no time left
        done = self.step >= tc.max_steps or stop is not None
        while not done:
            step_start = time.time()
            stats = self.train_step()
            # Flags and counts all-reduced before this step (read without waiting for it): a signal or the time
            # limit seen during step k stops the run after step k + 1, on every rank alike.
            totals = stats["totals"]
            stop = self._stop_reason(totals)
            done = self.step >= tc.max_steps or stop is not None
            logging = self.step % tc.log_interval == 0 or done
            losses = self._losses(stats) if logging else None  # waits for the step: only when logging
            window_tokens += totals[NEXT_SRC_TOKENS] + totals[NEXT_TGT_TOKENS]
            window_seconds += time.time() - step_start
            progress.update()
            self._count_skip(stats)
            if self.step == started_step + 1:  # optimizer state exists after the first step
                self.log("memory", {**partitioned_bytes(self.engine), "gradient_bytes": self.grad_bytes})
            if logging:
                # Source+target tokens of the global batch per second of training steps (validation excluded).
                metrics = {**losses, "ppl": float(np.exp(losses["nll"])),
                           "lr": self.engine.get_lr()[0], "tokens_per_s": window_tokens / window_seconds,
                           "tokens_per_s_per_rank": window_tokens / window_seconds / self.world,
                           "wall_minutes": self.minutes(), "peak_rss_mb": peak_rss_mb(),
                           "skipped_steps": self.skipped_steps}
                if self.precision == "fp16":
                    metrics["loss_scale"] = float(self.engine.optimizer.loss_scale)
                self.log("train", metrics)
                progress.set_postfix(loss=f"{losses['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
                window_seconds, window_tokens = 0.0, 0
            improved = False
            if (self.step % tc.valid_interval == 0 or done) and stop != "signal":  # pre-emption: save at once
                metrics = self.validate()
                metrics["wall_minutes"] = self.minutes()
                if "bleu" in metrics:
                    self.valid_bleu[self.step] = metrics["bleu"]
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
