"""Benchmark scripts run (not timed): the BLEU plot from TensorBoard scalars, the GPU check on a CPU, the throughput
table, the sampling pass."""

import re
import subprocess
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from tests.conftest import PYTHON, REPO, run_env


def test_bleu_plot_is_drawn_from_tensorboard_scalars(tmp_path):
    run = tmp_path / "run"
    writer = SummaryWriter(str(run / "tensorboard"))
    for step, (minutes, bleu) in enumerate([(1.0, 5.0), (2.5, 20.0), (4.0, 31.0)], 1):
        writer.add_scalar("valid/bleu", bleu, step * 100)
        writer.add_scalar("valid/wall_minutes", minutes, step * 100)
    writer.close()
    png = tmp_path / "bleu.png"
    done = subprocess.run([PYTHON, "benchmarks/plot_bleu.py", str(run), "--out", str(png)], cwd=REPO, env=run_env(),
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    empty = tmp_path / "empty"
    SummaryWriter(str(empty / "tensorboard")).close()
    done = subprocess.run([PYTHON, "benchmarks/plot_bleu.py", str(empty)], cwd=REPO, env=run_env(),
                          capture_output=True, text=True)
    assert done.returncode != 0 and "no valid/bleu scalars" in done.stderr


@pytest.mark.slow
def test_gpu_check_runs_end_to_end_on_cpu_and_prints_a_row_per_stage(tmp_path):
    """The GPU check cannot be timed here, but all of it (generated corpus, prepare, the real Trainer under the
    deepspeed launcher at ZeRO-0/2/3, the FLOPs count) runs on a CPU as well, so it cannot rot."""
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--preset", "small", "--precision", "fp32",
                           "--max-tokens", "512", "--steps", "2", "--warmup", "1", "--profile", str(tmp_path),
                           "model.d_model=64", "model.d_ff=128", "train.threads=1"],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=run_env(PAIRS="2000", VOCAB="400", PYTHON=PYTHON,
                                      DEEPSPEED=str(Path(PYTHON).parent / "deepspeed")))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| cpu |")]
    assert [row[3] for row in rows] == [f"ds_configs/zero{stage}.json" for stage in (0, 2, 3)]
    for row in rows:
        assert row[1] == "1" and float(row[6].replace(",", "")) > 0 and float(row[7]) >= 0 and "n/a" in row[8]
    assert len({row[2] for row in rows}) == 1  # ZeRO-3 counts its partitioned parameters whole
    for stage in (0, 2, 3):  # --profile: one operator table per run
        text = (tmp_path / f"profile-zero{stage}-1.txt").read_text()
        assert "ms a step under the profiler" in text and "aten::mm" in text


def test_train_throughput_takes_turns_and_prints_the_table(toy_data):
    done = subprocess.run([PYTHON, "benchmarks/train_throughput.py", "--data", str(toy_data), "--steps", "2",
                           "--warmup", "1", "--max-tokens", "256", "--tutorial-batch", "8", "--threads", "1"],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| ") and "×" in line]
    assert [row[0] for row in rows] == ["| plain PyTorch nn.Transformer"] * 2 + ["| dsmt, DeepSpeed ZeRO-0"]
    assert rows[0][4] == "1.00×" and all(float(row[3]) > 0 for row in rows)
    assert "dsmt vs baseline, per step: median" in done.stdout
    sampled = re.search(r"dsmt with subword sampling \(data.subword_sampling.enabled=true\): (\d+) real src\+tgt "
                        r"tokens/s, ([\d.]+)× dsmt's .* epoch plan (\d+) ms a step, included", done.stdout)
    assert sampled and int(sampled[1]) > 0 and float(sampled[2]) > 0, done.stdout[-2000:]


def test_sampling_pass_prints_a_row_per_thread_count(toy_data):
    done = subprocess.run([PYTHON, "benchmarks/sampling_pass.py", "--data", str(toy_data), "--threads", "1,2",
                           "--rounds", "1"], cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.strip("| ").split(" | ") for line in done.stdout.splitlines() if re.match(r"\| \d", line)]
    assert [row[0] for row in rows] == ["1", "2"] and rows[0][3] == "1.00×"
    assert all(float(row[1]) > 0 and float(row[3].rstrip("×")) > 0 for row in rows)
