"""Reliability: crash-safe checkpoints, exact resume after kill -9, elastic resume, signals, numerical and
disk faults (injected through ``DSMT_FAULT``, see ``dsmt/faults.py``), and the bad-input matrix."""

import hashlib
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

from dsmt import DsmtError
from dsmt.checkpoint import latest_tag, load_model
from dsmt.data.batching import BatchStream, ParallelData
from dsmt.engine import check_hostfile
from tests.conftest import PYTHON, REPO, run_env
from tests.training import TINY_MODEL, deepspeed_shm_files, records, train, train_command

QUIET = ("eval.valid_bleu=false", f"train.valid_interval={10 ** 6}")


def final_parameters(out) -> dict:
    model, _, _ = load_model(str(out))
    return model.state_dict()


def assert_same_parameters(a, b):
    pa, pb = final_parameters(a), final_parameters(b)
    assert pa.keys() == pb.keys()
    different = [k for k in pa if not torch.equal(pa[k], pb[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def run_with_faults(data, out, faults: str, *overrides, ranks=2, ds="ds_configs/zero0.json"):
    return train(data, out, *overrides, ranks=ranks, ds=ds, check=False, faults=faults)


# ---- exact resume -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_kill_loop_resumes_to_the_uninterrupted_parameters(toy_data, tmp_path):
    """Five kill -9 points chosen by seed, each of one rank (the launcher then ends the job), one of them
    while a checkpoint is being written; after each, resume=auto. The final parameters are bitwise those
    of the run that was never interrupted. No job, killed or not, leaves a /dev/shm buffer behind."""
    shm_before = deepspeed_shm_files()
    steps, every = 30, 4
    common = (f"train.max_steps={steps}", f"train.save_interval={every}", *QUIET)
    reference = tmp_path / "reference"
    train(toy_data, reference, *common, ranks=2)

    rng = random.Random(7)
    kill_steps = sorted(rng.sample(range(2, steps), 4))
    in_save = rng.choice([s for s in range(every, steps, every) if s not in kill_steps])
    points = sorted([(s, "kill") for s in kill_steps] + [(in_save, "kill_in_save")])
    out = tmp_path / "interrupted"
    for step, kind in points:
        result = run_with_faults(toy_data, out, f"{kind}@{step}@{rng.randrange(2)}", *common)
        assert result.returncode != 0, f"{kind}@{step} did not stop the job"
        assert max(records(out)) == step - (kind == "kill"), (kind, step)
        # A kill at the start of a step leaves the last save before it; one during a save leaves the one before.
        newest_complete = (step - 1) // every * every
        assert latest_tag(out / "checkpoints") == (f"step{newest_complete}" if newest_complete else None), (kind, step)
    train(toy_data, out, *common, ranks=2)
    assert max(records(out)) == steps
    assert_same_parameters(reference, out)
    assert deepspeed_shm_files() <= shm_before


@pytest.mark.slow
def test_zero2_checkpoint_resumes_on_one_and_three_ranks(toy_data, tmp_path):
    """A 2-rank ZeRO-2 checkpoint continues on 1 and on 3 ranks through DeepSpeed's universal checkpoint:
    the loss goes on from where it was, and Adam's second moments are kept (a fresh optimizer's would be
    (1 - beta2) = 2% of them)."""
    common = ("train.save_interval=10", *QUIET)
    base = tmp_path / "two_ranks"
    train(toy_data, base, "train.max_steps=10", *common, ranks=2, ds="ds_configs/zero2.json")
    runs = {}
    for ranks in (2, 1, 3):
        runs[ranks] = tmp_path / f"on_{ranks}"
        shutil.copytree(base, runs[ranks])
        train(toy_data, runs[ranks], "train.max_steps=11", "train.save_interval=1", *common, ranks=ranks,
              ds="ds_configs/zero2.json")
        assert 11 in records(runs[ranks])
    assert not (runs[2] / "universal").exists()  # same layout: loaded as it is
    assert (runs[1] / "universal" / "step10").is_dir() and (runs[3] / "universal" / "step10").is_dir()
    before = records(base)[10]["loss"]
    for ranks in (1, 3):
        after = records(runs[ranks])[11]["loss"]
        assert abs(after - records(runs[2])[11]["loss"]) < 0.1 * before, (ranks, after)
        ratio = second_moment_norm(runs[ranks] / "checkpoints" / "step11") / second_moment_norm(
            runs[2] / "checkpoints" / "step11")
        assert 0.8 < ratio < 1.25, (ranks, ratio)


def second_moment_norm(tag_dir: Path) -> float:
    """The norm of Adam's exp_avg_sq over all parameters, from every rank's ZeRO partition."""
    total = 0.0
    files = sorted(tag_dir.glob("zero_pp_rank_*_mp_rank_00_optim_states.pt"))
    assert files, tag_dir
    for file in files:
        state = torch.load(file, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        total += sum(float(s["exp_avg_sq"].double().pow(2).sum()) for s in state["base_optimizer_state"]["state"].values())
    return total ** 0.5


def test_batch_stream_resumes_on_another_world_size(toy_data):
    data = ParallelData(str(toy_data), "train")
    two = BatchStream(data, 512, seed=1, rank=0, world_size=2)
    for _ in range(5):
        next(two)
    one = BatchStream(data, 512, seed=1, rank=0, world_size=1)
    one.load_state_dict(two.state_dict())
    assert (one.epoch, one.position) == (0, 10)  # 5 steps of 2 ranks: 10 global batches consumed
    three = BatchStream(data, 512, seed=1, rank=0, world_size=3)
    three.load_state_dict(two.state_dict())
    assert three.position == 4  # ceil(10 / 3): none seen twice


# ---- signals, numerical faults, disk faults ------------------------------------------------------------

def rank_processes(launcher: subprocess.Popen) -> list[psutil.Process]:
    return [p for p in psutil.Process(launcher.pid).children(recursive=True)
            if any(arg.startswith("--local_rank") for arg in p.cmdline())]


@pytest.mark.slow
def test_sigterm_saves_at_the_step_boundary_and_exits_zero(toy_data, tmp_path):
    """SIGTERM to the ranks (as a scheduler pre-empting the job sends it): checkpoint, exit 0; resume goes on."""
    out, common = tmp_path / "run", ("train.max_steps=400", f"train.save_interval={10 ** 6}", *QUIET)
    launcher = subprocess.Popen(train_command(toy_data, out, *common, ranks=2), cwd=REPO, env=run_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not ((out / "train_log.jsonl").is_file() and 5 in records(out)) and time.time() < deadline:
        time.sleep(0.05)
    for process in rank_processes(launcher):
        process.send_signal(signal.SIGTERM)
    output, _ = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, output[-3000:]
    assert "stopped by SIGTERM" in output
    stopped = max(records(out))
    assert 5 <= stopped < 400 and latest_tag(out / "checkpoints") == f"step{stopped}"
    train(toy_data, out, f"train.max_steps={stopped + 3}", *common[1:], ranks=2)
    assert sorted(records(out))[-3:] == [stopped + 1, stopped + 2, stopped + 3]


@pytest.mark.slow
def test_injected_nan_is_skipped_counted_and_training_converges(toy_data, tmp_path):
    out = tmp_path / "nan"
    result = run_with_faults(toy_data, out, "nan@5@1,nan@6", "train.max_steps=60", *QUIET,
                             ds="ds_configs/zero2.json")
    assert result.returncode == 0, result.stderr[-3000:]
    skips = records(out, "skip")
    assert sorted(skips) == [5, 6] and skips[6]["skipped_steps"] == 2
    log = records(out)
    assert log[60]["skipped_steps"] == 2
    assert log[60]["loss"] < 0.6 * log[1]["loss"]
    assert all(torch.isfinite(t).all() for t in final_parameters(out).values())


@pytest.mark.slow
def test_non_finite_steps_in_a_row_stop_with_the_last_good_checkpoint(toy_data, tmp_path):
    """Plain fp32 ZeRO-0 on one process: the path where DeepSpeed itself does not skip."""
    out = tmp_path / "nan"
    faults = ",".join(f"nan@{s}" for s in (4, 5, 6))
    result = run_with_faults(toy_data, out, faults, "train.max_steps=20", "train.max_skips_in_a_row=3", *QUIET,
                             ranks=1)
    assert result.returncode == 2
    assert "3 steps in a row had a non-finite loss" in result.stderr
    assert latest_tag(out / "checkpoints") == "step6"
    good = tmp_path / "good"  # the same run stopped before the faults
    train(toy_data, good, "train.max_steps=3", *QUIET)
    assert_same_parameters(good, out)


@pytest.mark.slow
def test_failed_checkpoint_write_stops_clearly_and_keeps_the_previous(toy_data, tmp_path):
    out = tmp_path / "run"
    common = ("train.max_steps=10", "train.save_interval=3", *QUIET)
    result = run_with_faults(toy_data, out, "enospc@6", *common)
    assert result.returncode == 2
    line = next(line for line in result.stderr.splitlines() if line.startswith("dsmt: error:"))
    assert "writing checkpoint" in line and "No space left on device" in line and "(step3) is untouched" in line
    assert latest_tag(out / "checkpoints") == "step3"
    final_parameters(out)  # loads
    train(toy_data, out, *common, ranks=2)  # and resumes
    assert max(records(out)) == 10


# ---- the bad-input matrix -----------------------------------------------------------------------------

def dsmt(*args, cwd=REPO):
    return subprocess.run([PYTHON, "-m", "dsmt.cli", *map(str, args)], cwd=cwd, env=run_env(),
                          capture_output=True, text=True, timeout=300)


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


@pytest.fixture(scope="module")
def checkpointed(toy_data, tmp_path_factory):
    """A 2-step run with its checkpoint, and the digest of every file in it."""
    out = tmp_path_factory.mktemp("checkpointed") / "run"
    train(toy_data, out, "train.max_steps=2", *QUIET)
    return out


def tree_digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.suffix != ".jsonl"}


def bad_inputs(tmp: Path, toy: Path, checkpointed: Path) -> dict:
    """name → (dsmt arguments, words the one-line error must contain)."""
    run = ["train", "--config", "launch/configs/toy.yaml", f"data.dir={toy}", f"train.output_dir={tmp / 'out'}"]
    ds = REPO / "ds_configs" / "zero0.json"
    other_vocab = tmp / "toy_200"
    resume = ["train", f"train.output_dir={checkpointed}", "train.max_steps=4", *TINY_MODEL]
    write(tmp / "corpus" / "train.en", "a b\nc d\ne f\n")
    write(tmp / "corpus" / "train.de", "a b\nc d\n")
    write(tmp / "utf8" / "train.en", "ein\nzwei\n")
    write(tmp / "utf8" / "train.de", b"one\n\xff two\n")
    for lang in ("en", "de"):
        write(tmp / "long" / f"train.{lang}", "a b c d e f g h\n" * 50)
    prepare = ["prepare", "--valid", tmp / "corpus" / "train", "--out", tmp / "data"]
    batch_json = write(tmp / "batch.json", ds.read_text().replace('"train_batch_size": "auto"', '"train_batch_size": 7'))
    bad_json = write(tmp / "bad.json", '{\n  "stage": 2,\n}')
    stage7 = write(tmp / "stage7.json", ds.read_text().replace('"stage": 0', '"stage": 7'))
    users_folder = write(tmp / "mine" / "notes.txt", "my notes").parent
    users_file = write(tmp / "results.txt", "my results")
    for name in ("model.pt", "config.yaml", "README"):  # an exported model dir, and a file the user added
        write(tmp / "model_extra" / name, name)
    for lang in ("en", "de"):
        write(tmp / "small" / f"train.{lang}", "".join(f"the {lang} line {i} is short\n" for i in range(40)))
        write(tmp / "small" / f"long.{lang}", " ".join(["word"] * 300) + "\n")
        write(tmp / "small" / f"empty.{lang}", "")
        write(tmp / "elsewhere" / f"train.{lang}", "other\n")
    small = ["prepare", "--train", tmp / "small" / "train", "--vocab-size", "25"]
    long_valid = small + ["--valid", tmp / "small" / "long", "--out", tmp / "long_valid", "&&", *run[:-2],
                          f"data.dir={tmp / 'long_valid'}", f"train.output_dir={tmp / 'out'}", *TINY_MODEL]
    translate = ["translate", "--checkpoint", checkpointed]
    evaluate = ["evaluate", "--checkpoint", checkpointed, "--src", tmp / "small" / "train.en", "--ref",
                tmp / "small" / "train.de"]
    return {
        "unknown config key": (run + ["model.d_modle=3"], ["unknown config key 'model.d_modle'", "did you mean 'model.d_model'"]),
        "wrong value type": (run + ["train.max_steps=many"], ["train.max_steps", "expects int", "'many'"]),
        "inconsistent ZeRO batch sizes": (
            run + [f"train.deepspeed_config={batch_json}"],
            ["train_batch_size=7", "1 × 1 × 1 = 1"]),
        "fp16 on CPU": (run + ["train.precision=fp16"], ["fp16 is not supported on the cpu", "bf16"]),
        "missing data dir": (run + [f"data.dir={tmp / 'nowhere'}"], ["does not exist", "dsmt prepare"]),
        "data dir of another vocabulary": (
            ["prepare", "toy", "--vocab-size", "200", "--out", other_vocab, "&&"] + resume + [f"data.dir={other_vocab}"],
            ["trained on the vocabulary of data.dir=", str(other_vocab)]),
        "source/target line counts differ": (prepare[:-2] + ["--train", tmp / "corpus" / "train", "--out", tmp / "data"],
                                              ["has 3 lines but", "has 2"]),
        "non-UTF-8 input": (["prepare", "--train", tmp / "utf8" / "train", "--valid", tmp / "utf8" / "train",
                             "--out", tmp / "data"], ["train.de:2: not valid UTF-8"]),
        "empty training set after filtering": (
            ["prepare", "--train", tmp / "long" / "train", "--valid", tmp / "long" / "train", "--max-len", "2",
             "--vocab-size", "14", "--out", tmp / "data"], ["no training pair is left after filtering"]),
        "checkpoint of another model size": (resume + [f"data.dir={toy}", "model.d_model=32"],
                                             ["another model", "d_model=64 there, 32 here"]),
        "invalid ds_config JSON": (run + [f"train.deepspeed_config={bad_json}"],
                                   ["bad.json:3:1: invalid JSON"]),
        "malformed hostfile": (["launch", "--hostfile", write(tmp / "hostfile", "localhost slots=1\nworker-2 slot=8\n"),
                                "launch/train.py"], ["hostfile:2:", "'worker-2 slot=8'", "HOSTNAME slots=N"]),
        # Nothing already written is replaced unless the verb wrote it.
        "export over a user's folder": (["export", "--checkpoint", checkpointed, "--out", users_folder],
                                        ["--out", "exists and is not a model dir", "replaces only what it wrote"]),
        "export over the run itself": (["export", "--checkpoint", checkpointed, "--out", checkpointed],
                                       [f"--out {checkpointed} exists and is not a model dir"]),
        "average over a user's file": (["average", "--checkpoints", checkpointed, "--out", users_file],
                                       [f"--out {users_file} exists and is not a model dir"]),
        "export over a model dir holding a user's file": (
            ["export", "--checkpoint", checkpointed, "--out", tmp / "model_extra"],
            ["--out", "model_extra", "is a model dir written by dsmt export or average but also holds 'README'"]),
        "prepare over a user's file": (small + ["--valid", tmp / "small" / "train", "--out", users_file],
                                       [f"--out {users_file} exists and is not a data directory"]),
        # Config values out of range: the key, the value and what is allowed.
        "negative learning rate": (run + ["train.lr=-0.001"], ["'train.lr'=-0.001", "[0.0, inf)"]),
        "heads that do not divide the width": (run + ["model.n_heads=3"], ["'model.n_heads'=3", "model.d_model=128"]),
        "dropout of 1.5": (run + ["model.dropout=1.5"], ["'model.dropout'=1.5", "[0.0, 1.0)"]),
        "no warmup": (run + ["train.warmup_steps=0"], ["'train.warmup_steps'=0", "[1, inf)"]),
        "save interval 0": (run + ["train.save_interval=0"], ["'train.save_interval'=0"]),
        "accumulation 0": (run + ["train.grad_accum=0"], ["'train.grad_accum'=0"]),
        "negative max_steps": (run + ["train.max_steps=-1"], ["'train.max_steps'=-1", "[1, inf)"]),
        "ZeRO stage 7": (run + [f"train.deepspeed_config={stage7}"], ["stage7.json", "zero_optimization.stage=7"]),
        "subword sampling alpha 0": (run + ["data.subword_sampling.alpha=0"],
                                     ["'data.subword_sampling.alpha'=0.0", "(0.0, 1.0]"]),
        "subword sampling nbest 0": (run + ["data.subword_sampling.nbest=0"],
                                     ["'data.subword_sampling.nbest'=0", "[2, inf)"]),
        # Paths, checked before any work.
        "output in a missing folder": (translate + ["--input", tmp / "small" / "train.en", "--output",
                                                    tmp / "nowhere" / "out.de"], ["--output", "does not exist"]),
        "hypotheses in a missing folder": (evaluate + ["--hypotheses", tmp / "nowhere" / "hyp.de"],
                                           ["--hypotheses", "does not exist"]),
        "input that is a folder": (translate + ["--input", tmp / "small"], ["--input", "is a folder"]),
        "output_dir that is a file": (run[:-1] + [f"train.output_dir={users_file}"],
                                      ["train.output_dir=", "results.txt", "cannot write there"]),
        "output_dir that is a user's folder": (run[:-1] + [f"train.output_dir={users_folder}"],
                                               ["train.output_dir=", "mine", "not the output dir of a dsmt run"]),
        # Data that training cannot use, refused at prepare or before step 1.
        "empty valid split": (small + ["--valid", tmp / "small" / "empty", "--out", tmp / "data"],
                              ["empty.en", "have no lines"]),
        "valid sentence longer than a batch": (long_valid + ["data.max_tokens=128"],
                                               ["pair 1 of split 'valid'", "data.max_tokens=128",
                                                "evaluation splits are kept whole"]),
        "valid sentence longer than the positions": (long_valid + ["model.max_positions=200"],
                                                     ["pair 1 of split 'valid'", "model.max_positions=200"]),
        # What used to succeed silently.
        "vocabulary size 0": (["prepare", "toy", "--vocab-size", "0", "--out", tmp / "data"], ["--vocab-size 0"]),
        "source language equal to target": (small + ["--valid", tmp / "small" / "train", "--src", "en", "--tgt", "en",
                                                     "--out", tmp / "data"], ["--src and --tgt are both 'en'"]),
        "test split named like train": (small + ["--valid", tmp / "small" / "train", "--test", tmp / "elsewhere" / "train",
                                                 "--out", tmp / "data"], ["--test", "'train'", "rename"]),
        "outputs that can hold no token": (translate + ["--max-len-a", "-1", "--max-len-b", "0"],
                                           ["--max-len-a -1.0 --max-len-b 0", "no token"]),
        "outputs of length 0": (translate + ["--max-len-a", "0", "--max-len-b", "0"], ["--max-len-a 0.0 --max-len-b 0"]),
        "a GPU that is not there": (translate + ["--device", "cuda:99"], ["--device cuda:99", "CUDA device(s)",
                                                                         "--device cpu"]),
        "a device that does not exist": (evaluate + ["--device", "gpu"], ["--device gpu: not a device", "cuda:N"]),
        "an unknown quantization": (["export", "--checkpoint", checkpointed, "--out", tmp / "ct2", "--format",
                                     "ctranslate2", "--quantization", "int3"], ["--quantization int3", "int8"]),
        "quantizing dsmt's own format": (["export", "--checkpoint", checkpointed, "--out", tmp / "m", "--quantization",
                                          "int8"], ["--quantization applies to --format ctranslate2"]),
    }


BAD_INPUTS = ["unknown config key", "wrong value type", "inconsistent ZeRO batch sizes", "fp16 on CPU",
              "missing data dir", "data dir of another vocabulary", "source/target line counts differ",
              "non-UTF-8 input", "empty training set after filtering", "checkpoint of another model size",
              "invalid ds_config JSON", "malformed hostfile",
              "export over a user's folder", "export over the run itself", "average over a user's file",
              "export over a model dir holding a user's file", "prepare over a user's file",
              "negative learning rate", "heads that do not divide the width", "dropout of 1.5", "no warmup",
              "save interval 0", "accumulation 0", "negative max_steps", "ZeRO stage 7",
              "subword sampling alpha 0", "subword sampling nbest 0",
              "output in a missing folder", "hypotheses in a missing folder", "input that is a folder",
              "output_dir that is a file", "output_dir that is a user's folder", "empty valid split", "valid sentence longer than a batch",
              "valid sentence longer than the positions", "vocabulary size 0", "source language equal to target",
              "test split named like train", "outputs that can hold no token", "outputs of length 0",
              "a GPU that is not there", "a device that does not exist", "an unknown quantization",
              "quantizing dsmt's own format"]


@pytest.mark.slow
@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_is_one_clear_line_and_loses_nothing(name, tmp_path, toy_data, checkpointed):
    """Exit status 2, one line naming the key/file/line, no traceback, and every file that existed before
    (the test's own and a checkpoint's) byte for byte unchanged."""
    args, words = bad_inputs(tmp_path, toy_data, checkpointed)[name]
    if "&&" in args:  # a preparation step first
        cut = args.index("&&")
        prepared = dsmt(*args[:cut])
        assert prepared.returncode == 0, prepared.stderr[-2000:]
        args = args[cut + 1:]
    before = tree_digest(checkpointed), tree_digest(tmp_path)
    result = dsmt(*args)
    errors = [line for line in result.stderr.splitlines() if line.startswith("dsmt: error:")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and len(set(errors)) == 1, result.stderr[-2000:]
    for word in words:
        assert word in errors[0], errors[0]
    after = tree_digest(checkpointed), tree_digest(tmp_path)
    assert after[0] == before[0]
    assert {k: v for k, v in after[1].items() if k in before[1]} == before[1]


def test_hostfile_check_accepts_comments_and_refuses_duplicates(tmp_path):
    good = write(tmp_path / "good", "# two nodes\nworker-1 slots=8\n\nworker-2 slots=8\n")
    assert check_hostfile(str(good)) == {"worker-1": 8, "worker-2": 8}
    twice = write(tmp_path / "twice", "worker-1 slots=8\nworker-1 slots=4\n")
    with pytest.raises(DsmtError, match="twice:2: host worker-1 is listed twice"):
        check_hostfile(str(twice))
    with pytest.raises(DsmtError, match="lists no node"):
        check_hostfile(str(write(tmp_path / "empty", "# nothing\n")))


def test_fault_spec_is_checked():
    from dsmt.faults import _parse

    assert _parse("nan@5, kill_in_save@20@1") == {("nan", 5, None), ("kill_in_save", 20, 1)}
    with pytest.raises(ValueError, match="expected KIND@STEP"):
        _parse("explode@3")
