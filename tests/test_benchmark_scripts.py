"""Benchmark scripts run (not timed): the BLEU plot from TensorBoard scalars, the GPU check on a CPU, the throughput table."""

import subprocess

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


def test_gpu_check_runs_on_cpu_and_prints_its_row():
    """The GPU script cannot be timed here, but its set-up, loop and FLOPs count run on a CPU as well."""
    done = subprocess.run([PYTHON, "benchmarks/gpu_check.py", "--preset", "small", "--vocab", "500", "--batch", "4",
                           "--length", "8", "--steps", "2", "--warmup", "1", "--precision", "fp32"],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    row = [line for line in done.stdout.splitlines() if line.startswith("| cpu | small")]
    assert len(row) == 1 and "TFLOP/s" in row[0] and "n/a" in row[0]


def test_train_throughput_takes_turns_and_prints_the_table(toy_data):
    done = subprocess.run([PYTHON, "benchmarks/train_throughput.py", "--data", str(toy_data), "--steps", "2",
                           "--warmup", "1", "--max-tokens", "256", "--tutorial-batch", "8", "--threads", "1"],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| ") and "×" in line]
    assert [row[0] for row in rows] == ["| plain PyTorch nn.Transformer"] * 2 + ["| dsmt, DeepSpeed ZeRO-0"]
    assert rows[0][4] == "1.00×" and all(float(row[3]) > 0 for row in rows)
    assert "dsmt vs baseline, per step: median" in done.stdout
