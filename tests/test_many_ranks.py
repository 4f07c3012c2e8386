"""Data parallelism beyond two ranks and across nodes: every rank gets batches at any rank count, ranks follow
their launcher, all nodes share one output folder, and a stuck collective ends with one clear line."""

import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

from dsmt.checkpoint import latest_tag, load_model
from dsmt.data.batching import shard
from dsmt.data.corpora import write_toy_corpus
from dsmt.data.prepare import PrepareOptions, prepare
from dsmt.engine import free_port, local_world_size
from tests.conftest import REPO, run_env
from tests.training import records, train, train_command

QUIET = ("eval.valid_bleu=false", f"train.valid_interval={10 ** 6}")


@pytest.mark.parametrize("batches, world", [(1, 3), (2, 8), (3, 16), (7, 3), (6, 3)])
def test_every_rank_gets_the_same_number_of_batches_and_at_least_one(batches, world):
    shards = [shard(list(range(batches)), rank, world) for rank in range(world)]
    per_rank = max(1, -(-batches // world))
    assert [len(s) for s in shards] == [per_rank] * world
    assert set().union(*map(set, shards)) == set(range(batches))  # every batch is seen


def test_threads_are_divided_among_this_nodes_ranks():
    """DeepSpeed's launcher says LOCAL_SIZE, torchrun LOCAL_WORLD_SIZE; neither is the global world size."""
    assert local_world_size({"LOCAL_SIZE": "8"}, world=16) == 8
    assert local_world_size({"LOCAL_WORLD_SIZE": "4"}, world=16) == 4
    assert local_world_size({}, world=2) == 2


@pytest.fixture(scope="module")
def four_pair_valid_set(tmp_path_factory):
    """The toy corpus with a valid set of 4 pairs: two batches at data.max_tokens=48, fewer than 3 ranks."""
    folder = tmp_path_factory.mktemp("four_pair_valid")
    raw = folder / "raw"
    raw.mkdir()
    prefixes = write_toy_corpus(raw)
    for lang in ("en", "de"):
        path = Path(f"{prefixes['valid']}.{lang}")
        path.write_text("".join(path.read_text().splitlines(keepends=True)[:4]))
    prepare(prefixes, str(folder / "data"), PrepareOptions("en", "de", vocab_size=300))
    return folder / "data"


@pytest.mark.slow
def test_three_ranks_validate_fewer_batches_than_ranks_like_one_rank(four_pair_valid_set, tmp_path):
    """Two valid batches on three ranks: the third rank repeats one (it used to get none and hang the job), and
    repeats do not count. With lr=0 the weights are the initial ones at any rank count, so the valid loss and
    BLEU must equal one rank's."""
    common = ("train.max_steps=2", "train.valid_interval=2", "train.lr=0", "data.max_tokens=48",
              "train.dist_timeout_minutes=1")
    train(four_pair_valid_set, tmp_path / "one", *common, ranks=1)
    train(four_pair_valid_set, tmp_path / "three", *common, ranks=3, timeout=300)
    one, three = records(tmp_path / "one", "valid")[2], records(tmp_path / "three", "valid")[2]
    assert three["loss"] == pytest.approx(one["loss"], rel=1e-9)
    assert three["nll"] == pytest.approx(one["nll"], rel=1e-9)
    assert three["bleu"] == one["bleu"]


def final_parameters(out) -> dict:
    return load_model(str(out))[0].state_dict()


@pytest.mark.slow
def test_ranks_whose_launcher_is_killed_save_and_exit(toy_data, tmp_path):
    """kill -9 of the per-node launcher (deepspeed.launcher.launch): its ranks get SIGTERM from the kernel,
    finish the step, save and exit; resuming then ends at the parameters of a run never interrupted."""
    out, common = tmp_path / "orphaned", (f"train.save_interval={10 ** 6}", *QUIET)
    runner = subprocess.Popen(train_command(toy_data, out, "train.max_steps=400", *common, ranks=2), cwd=REPO,
                              env=run_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not ((out / "train_log.jsonl").is_file() and 3 in records(out)) and time.time() < deadline:
        time.sleep(0.05)
    launcher = next(p for p in psutil.Process(runner.pid).children(recursive=True)
                    if "deepspeed.launcher.launch" in p.cmdline())
    ranks = launcher.children()
    assert len(ranks) == 2
    launcher.kill()
    _, alive = psutil.wait_procs(ranks, timeout=30)
    runner.wait(timeout=30)
    assert not alive, f"ranks left running: {alive}"
    stopped = max(records(out))  # they saved the step they were in (orphans' exit codes reach no one)
    assert stopped >= 3 and latest_tag(out / "checkpoints") == f"step{stopped}"

    train(toy_data, out, f"train.max_steps={stopped + 3}", *common, ranks=2)
    reference = tmp_path / "reference"
    train(toy_data, reference, f"train.max_steps={stopped + 3}", *common, ranks=2)
    resumed, expected = final_parameters(out), final_parameters(reference)
    assert [k for k in expected if not torch.equal(resumed[k], expected[k])] == []


def start_nodes(toy_data, tmp_path, outputs: list, *overrides) -> list[subprocess.Popen]:
    """A two-node job on loopback: one launcher per node, each with its own train.output_dir."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    port = str(free_port())
    nodes = []
    for node_rank, out in enumerate(outputs):
        launcher = ["--hostfile", str(hostfile), "--no_ssh", f"--node_rank={node_rank}", "--master_addr=127.0.0.1",
                    f"--master_port={port}"]
        nodes.append(subprocess.Popen(train_command(toy_data, out, *overrides, launcher=launcher), cwd=REPO,
                                      env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return nodes


def error_lines(output: str) -> list[str]:
    return [line[line.index("dsmt: error:"):] for line in output.splitlines() if "dsmt: error:" in line]


@pytest.mark.slow
def test_nodes_with_different_output_dirs_fail_at_start_on_every_rank(toy_data, tmp_path):
    nodes = start_nodes(toy_data, tmp_path, [tmp_path / "node0", tmp_path / "node1"], "train.max_steps=5", *QUIET)
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert all(node.returncode != 0 for node in nodes), outputs
    lines = [error_lines(output) for output in outputs]
    assert all(lines) and lines[0][0] == lines[1][0], outputs
    assert f"train.output_dir={tmp_path / 'node1'} does not work for rank 1" in lines[0][0]
    assert f"the one folder rank 0 uses ({tmp_path / 'node0'}), on a filesystem all nodes share" in lines[0][0]
    assert "Traceback" not in "".join(outputs)
    assert not (tmp_path / "node0" / "checkpoints").exists() and not (tmp_path / "node1").exists()
    assert not list((tmp_path / "node0").glob(".dsmt-probe-*"))


@pytest.mark.slow
def test_an_output_dir_that_is_a_file_is_the_same_line_on_every_rank(toy_data, tmp_path):
    users_file, logs = tmp_path / "results.txt", tmp_path / "rank_logs"
    users_file.write_text("mine")
    launcher = ["--num_gpus", "3", "--master_port", str(free_port()), f"--enable_each_rank_log={logs}"]
    result = subprocess.run(train_command(toy_data, users_file, "train.max_steps=5", *QUIET, launcher=launcher),
                            cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    # Every rank reaches the same line; the launcher may end the others before they print theirs.
    lines = [error_lines(log.read_text()) for log in sorted(logs.glob("*"))]
    assert len(lines) == 3 and lines[0] and all(found in ([], lines[0]) for found in lines), lines
    assert f"train.output_dir={users_file} does not work for rank 0" in lines[0][0] and "cannot write there" in lines[0][0]
    assert "Traceback" not in "".join(log.read_text() for log in logs.glob("*")) and users_file.read_text() == "mine"


@pytest.mark.slow
def test_a_stuck_rank_ends_the_job_with_the_step_it_hung_in(toy_data, tmp_path):
    """Rank 1 stops at the start of step 3 (DSMT_FAULT hang); rank 0's collective times out after
    train.dist_timeout_minutes and the job ends with a line naming the step, instead of hanging."""
    started = time.time()
    result = train(toy_data, tmp_path / "run", "train.max_steps=10", "train.dist_timeout_minutes=0.1", *QUIET,
                   ranks=2, check=False, faults="hang@3@1", timeout=240)
    assert result.returncode != 0
    lines = error_lines(result.stdout + result.stderr)
    assert lines and "train.dist_timeout_minutes=0.1" in lines[0] and "during training step 3" in lines[0], lines
    assert time.time() - started < 180


def test_deterministic_switch_sets_torch_and_cublas(monkeypatch):
    from dsmt.train import use_deterministic_kernels

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        use_deterministic_kernels(True)
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.slow
def test_training_runs_with_deterministic_kernels_only(toy_data, tmp_path):
    """Every op of training (dropout on), validation and saving has a deterministic kernel, else PyTorch raises."""
    common = ("train.max_steps=4", "train.deterministic=true", "model.dropout=0.1", "train.valid_interval=4")
    runs = [tmp_path / "a", tmp_path / "b"]
    for out in runs:
        train(toy_data, out, *common)
    assert [r["loss"] for r in records(runs[0]).values()] == [r["loss"] for r in records(runs[1]).values()]
    assert records(runs[0], "valid")[4]["bleu"] == records(runs[1], "valid")[4]["bleu"]
