"""Checkpoints through DeepSpeed's own ``save_checkpoint``/``load_checkpoint``, plus keep-last-K and ``best``.

Layout: ``OUTPUT_DIR/checkpoints/step<N>/`` (DeepSpeed's files for every rank), ``latest`` (the newest
tag every rank finished writing, in the file DeepSpeed reads) and ``best`` (a symlink to the tag with the
best valid BLEU); ``OUTPUT_DIR/universal/step<N>/`` when a job resumes on another number of ranks.
"""

import contextlib
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from dsmt import DsmtError, faults
from dsmt.config import ModelConfig
from dsmt.engine import zero_stage
from dsmt.files import Product, check_replaceable, staged_dir
from dsmt.model import Transformer

TAG = re.compile(r"^step(\d+)$")
LATEST = "latest"  # the file DeepSpeed's load_checkpoint reads when no tag is given


def checkpoints_dir(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def tag_for(step: int) -> str:
    return f"step{step}"


def _point(link: Path, tag: str) -> None:
    """Atomically make ``link`` a symlink to ``tag``."""
    staging = link.with_name(link.name + ".new")
    staging.unlink(missing_ok=True)
    staging.symlink_to(tag)
    os.replace(staging, link)


def _write_atomic(path: Path, text: str) -> None:
    staging = path.with_name(path.name + ".new")
    with open(staging, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(staging, path)


def latest_tag(folder: Path) -> str | None:
    """The tag ``latest`` names: the newest checkpoint that every rank finished writing."""
    path = folder / LATEST
    return path.read_text().strip() or None if path.is_file() else None


def prune(folder: Path, keep_last: int, newest_step: int) -> None:
    """Remove step checkpoints older than the newest ``keep_last`` up to ``newest_step``; never the ones
    ``latest`` or ``best`` name, nor any newer than ``newest_step`` (say, left by a run resumed from earlier)."""
    tags = sorted((int(m.group(1)), p.name) for p in folder.iterdir() if (m := TAG.match(p.name)) and p.is_dir())
    tags = [(step, name) for step, name in tags if step <= newest_step]
    protected = {name for _, name in tags[-keep_last:]} | {latest_tag(folder)}
    if (folder / "best").is_symlink():
        protected.add(os.readlink(folder / "best"))
    for _, name in tags:
        if name not in protected:
            shutil.rmtree(folder / name, ignore_errors=True)


def save(engine, output_dir: str, step: int, client_state: dict, keep_last: int, best: bool) -> None:
    """Every rank writes its part of ``step<N>``; only once all have succeeded does rank 0 point ``latest``
    (and ``best``) at it and prune. A crash or a failed write before that leaves ``latest`` on the previous
    checkpoint, which nothing has touched; a failed write stops the run with one clear error on every rank."""
    folder, tag, rank = checkpoints_dir(output_dir), tag_for(step), dist.get_rank()
    error = None
    try:
        engine.save_checkpoint(str(folder), tag=tag, client_state=client_state, save_latest=False)
        faults.trigger("enospc", step, rank)
        faults.trigger("kill_in_save", step, rank)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
        error = e
    failures = torch.tensor([float(error is not None)], device=engine.device)
    dist.all_reduce(failures)
    if failures.item():
        raise DsmtError(f"writing checkpoint {folder / tag} failed ({error or 'on another rank'}); the last "
                        f"complete checkpoint ({latest_tag(folder) or 'none'}) is untouched: free disk space or "
                        "fix the permissions of train.output_dir, then resume")
    if rank == 0:
        _write_atomic(folder / LATEST, tag)
        if best:
            _point(folder / "best", tag)
        prune(folder, keep_last, step)
    dist.barrier()


def check_output_dir(output_dir: str) -> None:
    """Every rank must see one and the same ``output_dir``, and be able to write to it: rank 0 alone writes
    ``latest`` and prunes, while every rank writes its part of each checkpoint and reads ``latest`` to resume.
    With node-local folders the nodes would resume from different steps and hang. Rank 0 writes a random
    token there; after a barrier every other rank reads it and writes a file of its own. All ranks then fail
    with the same line if any could not, before any work."""
    folder, rank = Path(output_dir), dist.get_rank()
    token = [secrets.token_hex(8)]
    dist.broadcast_object_list(token, src=0)
    probe = folder / f".dsmt-probe-{token[0]}"
    problem = _probe(folder, probe, token[0], rank) if rank == 0 else None
    dist.barrier()
    if rank != 0:
        problem = _probe(folder, probe, token[0], rank)
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, (socket.gethostname(), output_dir, problem))
    dist.barrier()
    if rank == 0 and not problem:
        probe.unlink(missing_ok=True)
    failed = [(r, host, path, why) for r, (host, path, why) in enumerate(reports) if why]
    if not failed:
        return
    r, host, path, why = failed[0]
    if r == 0:
        raise DsmtError(f"train.output_dir={path} does not work for rank 0 on {host}: {why}; choose a new or "
                        "empty folder that can be written, or the output dir of an earlier dsmt run")
    raise DsmtError(f"train.output_dir={path} does not work for rank {r} on {host}: {why}; every rank must "
                    f"write to the one folder rank 0 uses ({reports[0][1]}), on a filesystem all nodes share, "
                    f"since rank 0 alone writes `latest` and every rank resumes from it ({len(failed)} of "
                    f"{len(reports)} ranks failed)")


TRAIN_LOG = "train_log.jsonl"  # what dsmt train writes first, before any step: the log it appends to


def is_run_dir(folder: Path) -> bool:
    return (folder / TRAIN_LOG).is_file()


def _probe(folder: Path, probe: Path, token: str, rank: int) -> str | None:
    """Rank 0 creates ``probe``; any other rank reads it back and writes a file of its own. None, or what failed."""
    try:
        if rank == 0:
            if folder.is_dir() and not is_run_dir(folder) and any(
                    not p.name.startswith(".dsmt-probe-") for p in folder.iterdir()):
                return "it holds files but is not the output dir of a dsmt run (no train_log.jsonl)"
            folder.mkdir(parents=True, exist_ok=True)
            probe.write_text(token)
            return None
        if probe.read_text() != token:
            return f"{probe} holds another job's token"
        own = probe.with_name(f"{probe.name}-rank{rank}")
        own.write_text(token)
        own.unlink()
    except OSError as e:
        verb = "cannot write there" if rank == 0 else "does not see the file rank 0 wrote there, or cannot write"
        return f"it {verb} ({e.strerror or e}: {e.filename})"
    return None


def resume_source(output_dir: str, mode: str) -> Path | None:
    """The tag folder to resume from per ``train.resume``: 'auto' (what ``latest`` names, if anything),
    'none', or a step<N> folder."""
    if mode == "none":
        return None
    if mode == "auto":
        folder = checkpoints_dir(output_dir)
        tag = latest_tag(folder)
        if tag is None:
            return None
        if not (folder / tag).is_dir():
            raise DsmtError(f"{folder / LATEST} names {tag}, which is missing; pass train.resume=<a step folder>")
        return folder / tag
    path = Path(mode)
    if not path.is_dir():
        raise DsmtError(f"train.resume={mode}: no such checkpoint directory; use auto, none or a step<N> folder")
    return path


# Keys that fix the parameters' shapes or meaning; dropout and the like may change on resume.
ARCHITECTURE = ("vocab_size", "src_vocab_size", "pad_id", "d_model", "n_heads", "n_encoder_layers",
                "n_decoder_layers", "d_ff", "norm_first", "share_embeddings", "positions", "max_positions")


def require_dsmt_states(tag_dir: Path, states: dict) -> None:
    """DeepSpeed model states that carry dsmt's client state (model config, vocabulary)."""
    if not isinstance(states.get("config"), dict) or not isinstance(states.get("spm"), dict):
        raise DsmtError(f"{tag_dir} was not written by this version of dsmt train (no model config and "
                        "vocabulary in its client state); use a checkpoint of this version or train.resume=none")


def check_resumable(tag_dir: Path, states: dict, model_cfg, spm_sha256: dict, data_dir: str) -> None:
    """The checkpoint must be of this model on this vocabulary; one clear error names the difference."""
    require_dsmt_states(tag_dir, states)
    saved = states["config"]["model"]
    differ = [k for k in ARCHITECTURE if saved.get(k) != model_cfg[k]]
    if {"vocab_size", "src_vocab_size"} & set(differ) or states.get("spm_sha256") != spm_sha256:
        raise DsmtError(f"{tag_dir} was trained on the vocabulary of data.dir={states['config']['data']['dir']}, "
                        f"not on that of {data_dir}; resume with the data it was trained on, or set a new "
                        "train.output_dir")
    if differ:
        found = "; ".join(f"{k}={saved.get(k)} there, {model_cfg[k]} here" for k in differ)
        raise DsmtError(f"{tag_dir} is a checkpoint of another model ({found}); use its model config "
                        "or a new train.output_dir")


def zero_layout(states: dict) -> tuple[int, int]:
    """(ZeRO stage, data-parallel world size) a checkpoint was written with."""
    return zero_stage(states["ds_config"]), states["dp_world_size"]


def to_universal(tag_dir: Path, output_dir: str) -> Path:
    """DeepSpeed's universal checkpoint of ``tag_dir`` (``ds_to_universal``, run once on rank 0), which a
    job with any number of ranks and any ZeRO stage ≥ 1 loads with its optimizer state. The other ranks wait
    for it in a group of their own without a practical timeout: converting a big model can take longer than
    ``train.dist_timeout_minutes``. A failure is the same one line on every rank."""
    target = Path(output_dir) / "universal" / tag_dir.name
    patient = dist.new_group(backend="gloo", timeout=timedelta(days=1))
    outcome = [None]
    if dist.get_rank() == 0 and not target.is_dir():
        print(f"resume: converting {tag_dir} to a universal checkpoint in {target}", flush=True)
        try:
            with staged_dir(target, None) as staging:
                done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                                       str(tag_dir), "--output_folder", str(staging), "--inject_missing_state"],
                                      capture_output=True, text=True)
                if done.returncode:
                    raise DsmtError(f"ds_to_universal failed on {tag_dir}: {done.stderr.strip().splitlines()[-1]}")
        except DsmtError as e:
            outcome = [str(e)]
    dist.broadcast_object_list(outcome, src=0, group=patient)
    dist.destroy_process_group(patient)
    if outcome[0]:
        raise DsmtError(outcome[0])
    return target


def load(engine, tag_dir: Path) -> dict:
    load_path, client_state = engine.load_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    if load_path is None:
        raise DsmtError(f"cannot load the checkpoint {tag_dir}")
    return client_state


# ---- Leaving DeepSpeed: one self-contained model directory ---------------------------------------------
# MODEL_DIR holds model.pt (an fp32 state dict), config.yaml (the model config) and the source and target
# sentencepiece models (the same model twice for a joint vocabulary), and loads without DeepSpeed.

MODEL_FILE, CONFIG_FILE = "model.pt", "config.yaml"
SPM_FILES = {"src": "spm.src.model", "tgt": "spm.tgt.model"}
MODEL_DIR = Product("a model dir written by dsmt export or average",
                    lambda folder: {MODEL_FILE, CONFIG_FILE, *SPM_FILES.values()}
                    if (folder / MODEL_FILE).is_file() and (folder / CONFIG_FILE).is_file() else None)


def _tag_dir(path: Path) -> Path:
    """A DeepSpeed tag folder from a tag folder, a checkpoints folder or an output folder (``latest``)."""
    for folder in (path, path / "checkpoints"):
        if tag := latest_tag(folder):
            return folder / tag
    return path


def model_states(tag_dir: Path) -> dict:
    files = sorted(tag_dir.glob("*mp_rank_00_model_states.pt"))
    if not files:
        raise DsmtError(f"{tag_dir} is not a complete checkpoint (no DeepSpeed model states, no {MODEL_FILE}); "
                        "pass a checkpoint folder written by dsmt train or dsmt export")
    return torch.load(files[0], map_location="cpu", weights_only=False)


def _deepspeed_weights(tag_dir: Path, states: dict, model) -> dict:
    """The fp32 weights of a DeepSpeed checkpoint of ``model``: the master weights the optimizer steps, never
    the bf16/fp16 copies the forward ran with."""
    if zero_layout(states)[0] == 0:
        return _zero0_weights(tag_dir, states, model)
    # ZeRO-1/2/3 keep the fp32 master weights partitioned in the optimizer states: DeepSpeed's zero_to_fp32
    # puts them back together. It reports on stdout, where `dsmt translate` writes translations.
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        try:
            return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
        except (FileNotFoundError, ValueError, KeyError) as e:
            raise DsmtError(f"{tag_dir}: the ZeRO shards are incomplete ({e}); use another checkpoint") from None


def _zero0_weights(tag_dir: Path, states: dict, model) -> dict:
    """ZeRO-0 saves the module in its training dtype; with bf16/fp16, DeepSpeed's mixed-precision optimizer
    keeps the fp32 masters in its own state, as lists (``fp32_groups``) or flat buffers (``fp32_groups_flat``)
    in the order of the parameters handed to ``deepspeed.initialize``: the model's, tied ones once."""
    weights = states["module"]
    if all(t.dtype == torch.float32 for t in weights.values()):
        return weights
    optimizer = states.get("optimizer") or {}
    params = list(model.parameters())
    if "fp32_groups" in optimizer:
        masters = [t for group in optimizer["fp32_groups"] for t in group]
    elif "fp32_groups_flat" in optimizer:
        flat = torch.cat([t.flatten() for t in optimizer["fp32_groups_flat"]])
        masters = list(flat.split([p.numel() for p in params])) if flat.numel() == sum(p.numel() for p in params) else []
    else:
        masters = []
    if len(masters) != len(params) or any(m.numel() != p.numel() for m, p in zip(masters, params)):
        raise DsmtError(f"{tag_dir}: a {next(iter(weights.values())).dtype} ZeRO-0 checkpoint without fp32 master "
                        "weights that fit the model; export a checkpoint written by dsmt train")
    master_of = {id(p): m.view(p.shape) for p, m in zip(params, masters)}
    return {**weights, **{name: master_of[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}}


def load_model(path: str):
    """(model in eval mode, model config, {"src", "tgt"} sentencepiece model paths) from a MODEL_DIR or a DeepSpeed checkpoint."""
    folder = Path(path)
    if not folder.exists():
        raise DsmtError(f"checkpoint {path} does not exist")
    if (folder / MODEL_FILE).is_file():
        model_cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(folder / CONFIG_FILE))
        model = Transformer(model_cfg)
        weights = torch.load(folder / MODEL_FILE, map_location="cpu")
        spm_paths = {side: folder / name for side, name in SPM_FILES.items()}
    else:
        tag_dir = _tag_dir(folder)
        states = model_states(tag_dir)
        require_dsmt_states(tag_dir, states)
        model_cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), states["config"]["model"])
        model = Transformer(model_cfg)
        weights, spm_paths = _deepspeed_weights(tag_dir, states, model), {k: Path(v) for k, v in states["spm"].items()}
    # Tied weights may be stored once (DeepSpeed issue 1896: zero_to_fp32 dropped them); tying restores them.
    tied = {name for name, p in model.named_parameters(remove_duplicate=False)} - dict(model.named_parameters()).keys()
    try:
        missing, unexpected = model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    except RuntimeError as e:  # a tensor of another shape
        raise DsmtError(f"{path} does not fit its model config: {str(e).splitlines()[1].strip()}") from None
    if set(missing) - tied or unexpected:
        raise DsmtError(f"{path} does not fit model {dict(model_cfg)}: missing {sorted(set(missing) - tied)[:3]}, "
                        f"unexpected {sorted(unexpected)[:3]}")
    for spm_path in spm_paths.values():
        if not spm_path.is_file():
            raise DsmtError(f"{path}: sentencepiece model {spm_path} not found")
    return model.eval(), model_cfg, spm_paths


def write_model_dir(out: str, state_dict: dict, model_cfg, spm_paths: dict) -> None:
    with staged_dir(Path(out), MODEL_DIR) as staging:
        torch.save(state_dict, staging / MODEL_FILE)
        (staging / CONFIG_FILE).write_text(OmegaConf.to_yaml(model_cfg))
        for side, name in SPM_FILES.items():
            shutil.copy(spm_paths[side], staging / name)


def export(checkpoint: str, out: str) -> None:
    check_replaceable(Path(out), MODEL_DIR, "--out")
    model, model_cfg, spm_paths = load_model(checkpoint)
    write_model_dir(out, model.state_dict(), model_cfg, spm_paths)


def average(checkpoints: list[str], out: str) -> None:
    """Parameter averaging of several checkpoints of one model (fairseq's practice)."""
    check_replaceable(Path(out), MODEL_DIR, "--out")
    loaded = [load_model(path) for path in checkpoints]
    model, model_cfg, spm_paths = loaded[0]
    states = [m.state_dict() for m, _, _ in loaded]
    if any(s.keys() != states[0].keys() or any(s[k].shape != states[0][k].shape for k in s) for s in states):
        raise DsmtError(f"checkpoints {checkpoints} are of different models; average checkpoints of one run")
    averaged = {k: torch.stack([s[k].float() for s in states]).mean(0) for k in states[0]}
    write_model_dir(out, averaged, model_cfg, spm_paths)
