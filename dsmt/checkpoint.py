"""Checkpoints through DeepSpeed's own ``save_checkpoint``/``load_checkpoint``, plus keep-last-K and ``best``.

Layout: ``OUTPUT_DIR/checkpoints/step<N>/`` (DeepSpeed's files for every rank), ``latest`` (DeepSpeed's
pointer to the newest tag) and ``best`` (a symlink to the tag with the best valid BLEU).
"""

import contextlib
import os
import re
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from dsmt import DsmtError
from dsmt.config import ModelConfig
from dsmt.files import staged_dir
from dsmt.model import Transformer

TAG = re.compile(r"^step(\d+)$")


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


def prune(folder: Path, keep_last: int) -> None:
    """Remove all but the newest ``keep_last`` step checkpoints; never the one ``latest`` or ``best`` names."""
    tags = sorted((int(m.group(1)), p.name) for p in folder.iterdir() if (m := TAG.match(p.name)) and p.is_dir())
    protected = {name for _, name in tags[-keep_last:]}
    for pointer in ("latest", "best"):
        path = folder / pointer
        if path.is_symlink():
            protected.add(os.readlink(path))
        elif path.is_file():
            protected.add(path.read_text().strip())
    for _, name in tags:
        if name not in protected:
            shutil.rmtree(folder / name, ignore_errors=True)


def save(engine, output_dir: str, step: int, client_state: dict, keep_last: int, best: bool) -> None:
    folder = checkpoints_dir(output_dir)
    engine.save_checkpoint(str(folder), tag=tag_for(step), client_state=client_state)
    if dist.get_rank() == 0:
        if best:
            _point(folder / "best", tag_for(step))
        prune(folder, keep_last)
    dist.barrier()


def resume(engine, output_dir: str, mode: str) -> dict | None:
    """Load per ``train.resume``: 'auto' (the newest checkpoint, if any), 'none', or a checkpoint directory."""
    if mode == "none":
        return None
    if mode == "auto":
        folder, tag = checkpoints_dir(output_dir), None
        if not (folder / "latest").is_file():
            return None
    else:
        path = Path(mode)
        if not path.is_dir():
            raise DsmtError(f"train.resume={mode}: no such checkpoint directory; use auto, none or a step<N> folder")
        folder, tag = path.parent, path.name
    load_path, client_state = engine.load_checkpoint(str(folder), tag=tag)
    if load_path is None:
        raise DsmtError(f"cannot load a checkpoint from {folder} (tag {tag or 'latest'})")
    return client_state


# ---- Leaving DeepSpeed: one self-contained model directory ---------------------------------------------
# MODEL_DIR holds model.pt (an fp32 state dict), config.yaml (the model config) and the source and target
# sentencepiece models (the same model twice for a joint vocabulary), and loads without DeepSpeed.

MODEL_FILE, CONFIG_FILE = "model.pt", "config.yaml"
SPM_FILES = {"src": "spm.src.model", "tgt": "spm.tgt.model"}


def _tag_dir(path: Path) -> Path:
    """A DeepSpeed tag folder from a tag folder, a checkpoints folder or an output folder (``latest``)."""
    for folder in (path, path / "checkpoints"):
        if (folder / "latest").is_file():
            return folder / (folder / "latest").read_text().strip()
    return path


def _model_states(tag_dir: Path) -> dict:
    files = sorted(tag_dir.glob("*mp_rank_00_model_states.pt"))
    if not files:
        raise DsmtError(f"{tag_dir} is not a complete checkpoint (no DeepSpeed model states, no {MODEL_FILE}); "
                        "pass a checkpoint folder written by dsmt train or dsmt export")
    return torch.load(files[0], map_location="cpu", weights_only=False)


def _deepspeed_weights(tag_dir: Path, states: dict) -> dict:
    if states["ds_config"].get("zero_optimization", {}).get("stage", 0) == 0:
        return states["module"]
    # ZeRO-1/2/3 keep the fp32 master weights partitioned in the optimizer states: DeepSpeed's zero_to_fp32
    # puts them back together. It reports on stdout, where `dsmt translate` writes translations.
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        try:
            return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
        except (FileNotFoundError, ValueError, KeyError) as e:
            raise DsmtError(f"{tag_dir}: the ZeRO shards are incomplete ({e}); use another checkpoint") from None


def load_model(path: str):
    """(model in eval mode, model config, {"src", "tgt"} sentencepiece model paths) from a MODEL_DIR or a DeepSpeed checkpoint."""
    folder = Path(path)
    if not folder.exists():
        raise DsmtError(f"checkpoint {path} does not exist")
    if (folder / MODEL_FILE).is_file():
        model_cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(folder / CONFIG_FILE))
        weights = torch.load(folder / MODEL_FILE, map_location="cpu")
        spm_paths = {side: folder / name for side, name in SPM_FILES.items()}
    else:
        tag_dir = _tag_dir(folder)
        states = _model_states(tag_dir)
        if not isinstance(states.get("config"), dict) or not isinstance(states.get("spm"), dict):
            raise DsmtError(f"{tag_dir} was not written by this version of dsmt train (no model config and "
                            "vocabulary in its client state)")
        model_cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), states["config"]["model"])
        weights, spm_paths = _deepspeed_weights(tag_dir, states), {k: Path(v) for k, v in states["spm"].items()}
    model = Transformer(model_cfg)
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
    with staged_dir(Path(out)) as staging:
        torch.save(state_dict, staging / MODEL_FILE)
        (staging / CONFIG_FILE).write_text(OmegaConf.to_yaml(model_cfg))
        for side, name in SPM_FILES.items():
            shutil.copy(spm_paths[side], staging / name)


def export(checkpoint: str, out: str) -> None:
    model, model_cfg, spm_paths = load_model(checkpoint)
    write_model_dir(out, model.state_dict(), model_cfg, spm_paths)


def average(checkpoints: list[str], out: str) -> None:
    """Parameter averaging of several checkpoints of one model (fairseq's practice)."""
    loaded = [load_model(path) for path in checkpoints]
    model, model_cfg, spm_paths = loaded[0]
    states = [m.state_dict() for m, _, _ in loaded]
    if any(s.keys() != states[0].keys() or any(s[k].shape != states[0][k].shape for k in s) for s in states):
        raise DsmtError(f"checkpoints {checkpoints} are of different models; average checkpoints of one run")
    averaged = {k: torch.stack([s[k].float() for s in states]).mean(0) for k in states[0]}
    write_model_dir(out, averaged, model_cfg, spm_paths)
