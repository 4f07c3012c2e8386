"""Helpers for tests that run real training jobs in subprocesses (the deepspeed launcher for several ranks)."""

import glob
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from dsmt.engine import free_port
from tests.conftest import PYTHON, REPO, run_env

DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")
# A model that trains in well under a second per step on one core; dropout off so runs of different
# world sizes are comparable.
TINY_MODEL = ["model.d_model=64", "model.n_heads=4", "model.n_encoder_layers=2", "model.n_decoder_layers=2",
              "model.d_ff=128"]
TINY = [*TINY_MODEL, "model.dropout=0", "train.threads=1", "train.log_interval=1", "data.max_tokens=1024",
        "train.lr=3e-3", "train.warmup_steps=10"]


def train_command(data_dir, out, *overrides, ranks=1, ds="ds_configs/zero0.json", launcher=None) -> list[str]:
    args = ["launch/train.py", "--deepspeed_config", ds, f"data.dir={data_dir}", f"train.output_dir={out}",
            *TINY, *overrides]
    if launcher is not None:
        return [DEEPSPEED, *launcher, *args]
    if ranks == 1:
        return [PYTHON, *args]
    return [DEEPSPEED, "--num_gpus", str(ranks), "--master_port", str(free_port()), *args]


def train(data_dir, out, *overrides, ranks=1, ds="ds_configs/zero0.json", timeout=600, check=True, faults=""):
    """One training job; ``faults`` is a ``DSMT_FAULT`` spec (see dsmt/faults.py)."""
    result = subprocess.run(train_command(data_dir, out, *overrides, ranks=ranks, ds=ds), cwd=REPO,
                            env=run_env(DSMT_FAULT=faults), capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def records(out, kind="train") -> dict[int, dict]:
    """The last logged record of each step (a resumed run logs its steps again)."""
    found = {}
    for line in (Path(out) / "train_log.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == kind:
            found[record["step"]] = record
    return found


def losses(out) -> list[float]:
    return [r["loss"] for _, r in sorted(records(out).items())]


def kill_after(command, out, step: int, timeout=300) -> int:
    """Start ``command`` and SIGKILL its whole process group once ``step`` is logged; returns the exit code."""
    process = subprocess.Popen(command, cwd=REPO, env=run_env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    log, deadline = Path(out) / "train_log.jsonl", time.time() + timeout
    while process.poll() is None and time.time() < deadline:
        if log.is_file() and step in records(out):
            import os

            os.killpg(process.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    return process.wait()


def deepspeed_shm_files() -> set[str]:
    """The shared-memory buffers of DeepSpeed's CPU all-reduce (dsmt.engine unlinks its jobs' own)."""
    return set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"))
