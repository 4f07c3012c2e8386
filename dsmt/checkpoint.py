"""Checkpoints through DeepSpeed's own ``save_checkpoint``/``load_checkpoint``, plus keep-last-K and ``best``.

Layout: ``OUTPUT_DIR/checkpoints/step<N>/`` (DeepSpeed's files for every rank), ``latest`` (DeepSpeed's
pointer to the newest tag) and ``best`` (a symlink to the tag with the best valid BLEU).
"""

import os
import re
import shutil
from pathlib import Path

import torch.distributed as dist

from dsmt import DsmtError

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
