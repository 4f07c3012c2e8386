import json
import subprocess
from pathlib import Path

import pytest
import sacrebleu
import sentencepiece as spm
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

import dsmt.loss
from dsmt import DsmtError
from dsmt.checkpoint import latest_tag, load_model, prune
from dsmt.data.batching import ParallelData, epoch_batches
from dsmt.data.prepare import PrepareOptions, load_meta, prepare
from dsmt.decode import cached_logits, greedy, max_output_length
from dsmt.engine import fill_ds_config, free_port, inverse_sqrt, read_ds_config
from dsmt.loss import label_smoothed_nll
from tests.conftest import MULTI30K, PYTHON, REPO, run_env
from tests.training import kill_after, losses, records, train, train_command

DS_CONFIGS = sorted((REPO / "ds_configs").glob("*.json"))
CPU = ("cpu", False, True)  # accelerator name, fp16 supported, bf16 supported
CUDA = ("cuda", True, True)


# ---- units: loss, schedule, greedy, ds_config filling, pruning ---------------------------------------

@pytest.mark.parametrize("chunk_logits", [7 * 11, 2 ** 23])  # several chunks with a remainder; one chunk
def test_label_smoothed_loss_and_gradients_equal_torch_cross_entropy(monkeypatch, chunk_logits):
    monkeypatch.setattr(dsmt.loss, "CHUNK_LOGITS", chunk_logits)
    torch.manual_seed(0)
    hidden, weight, target = torch.randn(3, 6, 4, dtype=torch.float64), torch.randn(11, 4, dtype=torch.float64), \
        torch.randint(1, 11, (3, 6))
    target[0, 3:] = 0
    target[2, :] = 0
    hidden.requires_grad_(), weight.requires_grad_()
    loss, nll = label_smoothed_nll(hidden, weight, target, 0.1, pad_id=0)
    (3 * loss).backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    flat = (hidden @ weight.t()).flatten(0, 1), target.flatten()
    expected = F.cross_entropy(*flat, ignore_index=0, label_smoothing=0.1, reduction="sum")
    (3 * expected).backward()
    assert torch.allclose(loss, expected) and not nll.requires_grad
    assert torch.allclose(nll, F.cross_entropy(*flat, ignore_index=0, reduction="sum"))
    assert torch.allclose(grads[0], hidden.grad) and torch.allclose(grads[1], weight.grad)
    assert grads[0][2].abs().sum() == 0  # an all-padding row gets no gradient
    with torch.no_grad():
        assert torch.allclose(torch.stack(label_smoothed_nll(hidden, weight, target, 0.1, 0)), torch.stack([loss, nll]))


def test_label_smoothed_loss_in_bf16_keeps_fp32_sums_and_bf16_gradients():
    torch.manual_seed(0)
    hidden, weight, target = torch.randn(40, 16), torch.randn(300, 16) * 0.3, torch.randint(1, 300, (40,))
    low = [t.bfloat16().requires_grad_() for t in (hidden, weight)]
    loss, nll = label_smoothed_nll(*low, target, 0.1, pad_id=0)
    loss.backward()
    exact = [t.bfloat16().double().requires_grad_() for t in (hidden, weight)]
    expected, _ = label_smoothed_nll(*exact, target, 0.1, pad_id=0)
    expected.backward()
    assert loss.dtype == nll.dtype == torch.float32 and torch.allclose(loss.double(), expected, rtol=1e-2)
    for got, want in zip(low, exact):
        assert got.grad.dtype == torch.bfloat16
        assert torch.allclose(got.grad.double(), want.grad, rtol=0.02, atol=0.02 * want.grad.abs().max().item())


def test_inverse_sqrt_schedule():
    factor = inverse_sqrt(warmup_steps=100)
    assert factor(0) == pytest.approx(0.01) and factor(49) == pytest.approx(0.5) and factor(99) == pytest.approx(1)
    assert factor(399) == pytest.approx(0.5)  # sqrt(100 / 400)


def test_greedy_follows_argmax_and_stops_at_eos():
    script = {0: [5, 6, 3, 7], 1: [8, 3, 9, 9]}  # row → tokens the fake model prefers at each step

    def logits_of(prefix):
        t = prefix.size(1) - 1
        out = torch.zeros(2, prefix.size(1), 10)
        for row in range(2):
            out[row, -1, script[row][t]] = 1.0
        return out

    assert greedy(logits_of, 2, "cpu", bos=2, eos=3, pad=0, max_len=10) == [[5, 6], [8]]
    assert greedy(logits_of, 2, "cpu", bos=2, eos=3, pad=0, max_len=1) == [[5], [8]]


def fill(ds, world=2, caps=CPU, **train):
    from dsmt.config import TrainConfig

    return fill_ds_config(ds, TrainConfig(**train), world, "x.json", caps)


def test_ds_config_autos_are_filled():
    ds = fill(read_ds_config(REPO / "ds_configs" / "zero2.json"), world=4, grad_accum=3, lr=5e-4, precision="bf16")
    assert ds["train_micro_batch_size_per_gpu"] == 1 and ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 12 and ds["optimizer"]["params"]["lr"] == 5e-4
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    assert ds["optimizer"]["params"]["torch_adam"] is True and ds["optimizer"]["params"]["fused"] is True  # on CPU


def test_cuda_gets_torchs_fused_adam_not_a_kernel_built_with_nvcc():
    ds = fill(read_ds_config(REPO / "ds_configs" / "zero2.json"), caps=CUDA)
    assert ds["optimizer"]["params"]["torch_adam"] is True and ds["optimizer"]["params"]["fused"] is True
    assert ds["bf16"]["enabled"] is True  # precision auto on a bf16 GPU


@pytest.mark.parametrize("name", ["zero2", "zero2_offload", "zero3", "zero3_offload"])
def test_zero_settings_are_deepspeeds_gpu_values_on_cuda_and_unchanged_on_cpu(name):
    """"auto" ZeRO settings: on a GPU, parameters under 100k elements persist, ZeRO-2 overlaps its reduction
    with backward and offloaded tensors are pinned; on a CPU, what the CPU tests have always run."""
    expected = {CUDA: {"stage3_param_persistence_threshold": 100_000, "overlap_comm": True, "pin_memory": True},
                CPU: {"stage3_param_persistence_threshold": 0, "overlap_comm": False, "pin_memory": False}}
    raw = read_ds_config(REPO / "ds_configs" / f"{name}.json")["zero_optimization"]
    for caps, values in expected.items():
        zero = fill(read_ds_config(REPO / "ds_configs" / f"{name}.json"), caps=caps)["zero_optimization"]
        for key in ("stage3_param_persistence_threshold", "overlap_comm"):
            if key in raw:
                assert raw[key] == "auto" and zero[key] == values[key], (key, caps)
        for offload in ("offload_optimizer", "offload_param"):
            if offload in raw:
                assert zero[offload]["pin_memory"] is values["pin_memory"]
    assert "overlap_comm" in raw or "stage3_param_persistence_threshold" in raw


def test_deepspeeds_synchronizing_throughput_timer_is_off_unless_the_json_asks_for_it():
    for caps in (CPU, CUDA):
        assert fill(read_ds_config(REPO / "ds_configs" / "zero2.json"), caps=caps)["timers"]["throughput"] == {
            "enabled": False}
    asked = {"timers": {"throughput": {"enabled": True, "synchronized": True}}}
    assert fill(asked, caps=CUDA)["timers"] == asked["timers"]


@pytest.mark.parametrize("stage, accumulate", [(0, "bf16"), (1, "bf16"), (2, "fp32"), (3, "fp32")])
def test_bf16_gradients_are_all_reduced_in_fp32_and_accumulated_in_fp32_where_deepspeed_can(stage, accumulate):
    for caps in (CPU, CUDA):
        ds = fill(read_ds_config(REPO / "ds_configs" / f"zero{stage}.json"), precision="bf16", caps=caps)
        assert ds["communication_data_type"] == "fp32"
        assert ds["data_types"]["grad_accum_dtype"] == accumulate
    ds = fill(read_ds_config(REPO / "ds_configs" / f"zero{stage}.json"), precision="fp32")
    assert ds["communication_data_type"] == "fp32" and ds["data_types"]["grad_accum_dtype"] == "fp32"


def test_fp32_accumulation_of_bf16_at_zero0_is_refused_clearly():
    ds = read_ds_config(REPO / "ds_configs" / "zero0.json") | {"data_types": {"grad_accum_dtype": "fp32"}}
    with pytest.raises(DsmtError, match="grad_accum_dtype=fp32 with bf16 needs ZeRO stage >= 1"):
        fill(ds, precision="bf16")


@pytest.mark.parametrize("ds, train, words", [
    ({"train_batch_size": 8, "gradient_accumulation_steps": 2}, {}, ["train_batch_size=8", "1 × 2 × 2 = 4"]),
    ({"train_micro_batch_size_per_gpu": 16}, {}, ["train_micro_batch_size_per_gpu=16", "tokens"]),
    ({"fp16": {"enabled": True}}, {}, ["fp16 is not supported", "x.json", "bf16"]),
    ({}, {"precision": "fp16"}, ["fp16 is not supported", "train.precision", "bf16"]),
    ({"bf16": {"enabled": True}}, {"precision": "fp32"}, ["bf16", "train.precision=fp32"]),
    ({}, {"precision": "half"}, ["train.precision='half'"]),
    ({"zero_optimization": {"stage": "auto"}}, {}, ["zero_optimization.stage"]),
    ({"zero_optimization": {"stage": 4}}, {}, ["x.json", "zero_optimization.stage=4", "0, 1, 2 or 3"]),
])
def test_ds_config_contradictions_are_refused(ds, train, words):
    with pytest.raises(DsmtError) as error:
        fill(ds, **train)
    for word in words:
        assert word in str(error.value)


def test_invalid_json_names_line_and_column(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "train_batch_size": 8,\n  "zero_optimization": {"stage": 2,}\n}\n')
    with pytest.raises(DsmtError, match=r"bad.json:3:\d+: invalid JSON"):
        read_ds_config(str(bad))


@pytest.mark.parametrize("ds, section", [
    ({"timers": True}, "timers"),
    ({"bf16": "auto"}, "bf16"),
    ({"timers": {"throughput": 1}}, "timers.throughput"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": "cpu"}}, "zero_optimization.offload_optimizer"),
    ({"optimizer": {"type": "AdamW", "params": []}}, "optimizer.params"),
])
def test_a_section_that_is_not_an_object_is_a_one_line_error(tmp_path, ds, section):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(ds))
    with pytest.raises(DsmtError) as error:
        read_ds_config(str(bad))
    assert str(error.value).startswith(f'{bad}: "{section}" must be a JSON object')


def test_freed_memory_is_reused_without_page_faults():
    """A 200 MB tensor allocated and freed again and again: by default each round faults its pages in
    afresh; after keep_freed_memory (which the Trainer calls) the heap hands back the same pages."""
    script = """
import resource, sys, torch
from dsmt.train import keep_freed_memory
def faults_per_round():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        torch.empty(50_000_000).fill_(1.0)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5
default = faults_per_round()
keep_freed_memory()
faults_per_round()  # the heap grows once
print(default, faults_per_round())
"""
    result = subprocess.run([PYTHON, "-c", script], cwd=REPO, env=run_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    default, kept = map(float, result.stdout.split())
    pages = 200e6 / 4096
    assert default > 0.9 * pages and kept < 0.01 * pages, (default, kept)


def test_prune_keeps_newest_latest_and_best(tmp_path):
    for step in (10, 20, 30, 40, 50, 60):
        (tmp_path / f"step{step}").mkdir()
    (tmp_path / "latest").write_text("step50")
    (tmp_path / "best").symlink_to("step20")
    prune(tmp_path, keep_last=2, newest_step=50)  # step60: a save that never completed, or another timeline
    assert sorted(p.name for p in tmp_path.glob("step*")) == ["step20", "step40", "step50", "step60"]


# ---- real training runs ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stage_runs(toy_data, tmp_path_factory):
    """20 steps at ZeRO 0-3 on 2 ranks, and 1 rank with accumulation 2, validating (greedy BLEU) every 10."""
    root = tmp_path_factory.mktemp("stages")
    runs = {}
    for stage in (0, 1, 2, 3):
        runs[stage] = root / f"zero{stage}"
        train(toy_data, runs[stage], "train.max_steps=20", "train.valid_interval=10", "train.save_interval=20",
              ranks=2, ds=f"ds_configs/zero{stage}.json")
    runs["accum"] = root / "accum"
    train(toy_data, runs["accum"], "train.max_steps=20", "train.valid_interval=10", "train.save_interval=20",
          "train.grad_accum=2")
    return runs


def relative_close(a, b, tol=1e-4):
    return len(a) == len(b) and all(abs(x - y) <= tol * abs(y) for x, y in zip(a, b))


@pytest.mark.slow
def test_loss_curves_agree_across_zero_stages_and_with_accumulation(stage_runs):
    reference = losses(stage_runs[0])
    assert len(reference) == 20 and reference[-1] < reference[0] - 0.5  # it learns
    for stage in (1, 2, 3):
        assert relative_close(losses(stage_runs[stage]), reference), stage
    # One rank accumulating 2 batches sees the same global batches as 2 ranks; the ranks' batches hold
    # different token counts, and the global-token normalization makes the updates equal anyway.
    assert relative_close(losses(stage_runs["accum"]), reference)
    tokens = [r["tokens_per_s"] > 0 for r in records(stage_runs[0]).values()]
    assert all(tokens)


@pytest.mark.slow
def test_partitioned_memory_halves_with_two_ranks(stage_runs):
    memory = {stage: records(stage_runs[stage], "memory")[1] for stage in (0, 1, 2, 3)}
    base = memory[0]
    for stage in (1, 2):
        assert 0.45 <= memory[stage]["optimizer_state_bytes"] / base["optimizer_state_bytes"] <= 0.55
        assert memory[stage]["param_bytes"] == base["param_bytes"]
    assert 0.45 <= memory[3]["param_bytes"] / base["param_bytes"] <= 0.55
    assert 0.45 <= memory[3]["optimizer_state_bytes"] / base["optimizer_state_bytes"] <= 0.55
    assert base["gradient_bytes"] == base["param_bytes"]  # fp32 gradients of every parameter
    for stage in (2, 3):  # gradients partitioned
        assert 0.45 <= memory[stage]["gradient_bytes"] / base["gradient_bytes"] <= 0.55


@pytest.mark.slow
def test_zero3_validation_equals_cached_decoding_of_its_weights(stage_runs):
    """ZeRO-3 validates with its parameters gathered once into a whole replica per rank, decoding with the
    key/value cache and no collective (the ranks' shards take different numbers of steps, and nothing hangs);
    decoding the checkpoint's weights on one process gives the same BLEU. ZeRO-0's run is no
    reference: its weights differ from ZeRO-3's by round-off, and greedy output of a 20-step model hangs on
    near-ties."""
    run = stage_runs[3]
    logged = [r["bleu"] for _, r in sorted(records(run, "valid").items())]
    assert len(logged) == 2  # it finished
    model, _, spm_paths = load_model(str(run / "checkpoints" / "step20"))
    cfg = OmegaConf.load(run / "config.yaml")
    data, sp = ParallelData(cfg.data.dir, "valid"), spm.SentencePieceProcessor(model_file=str(spm_paths["tgt"]))
    hypotheses = {}
    with torch.no_grad():
        for indices in epoch_batches(data.src_lens, data.tgt_lens, cfg.data.max_tokens, seed=0, epoch=0):
            src = data.collate(indices)["src"]
            max_len = max_output_length(src.size(1), cfg.eval.max_len_a, cfg.eval.max_len_b, cfg.model.max_positions)
            found = greedy(cached_logits(model, src), len(indices), "cpu", sp.bos_id(), sp.eos_id(), sp.pad_id(),
                           max_len)
            hypotheses.update(zip(map(int, indices), found))
    references = (Path(cfg.data.dir) / f"valid.{load_meta(cfg.data.dir)['tgt']}.txt").read_text().splitlines()
    text = [sp.decode(hypotheses[i]) for i in range(len(data))]
    assert sacrebleu.corpus_bleu(text, [references]).score == pytest.approx(logged[-1], abs=1e-9)


@pytest.mark.slow
def test_tensorboard_holds_the_scalars(stage_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(stage_runs[0] / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("train/loss", "train/nll", "train/ppl", "train/lr", "train/grad_norm", "train/tokens_per_s",
                "train/tokens_per_s_per_rank", "train/wall_minutes", "valid/loss", "valid/bleu", "valid/nll"):
        assert tag in tags, tag
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 21))
    assert events.Scalars("train/loss")[-1].value == pytest.approx(losses(stage_runs[0])[-1], rel=1e-6)


@pytest.mark.slow
def test_checkpoints_on_disk(stage_runs):
    folder = stage_runs[2] / "checkpoints"
    assert (folder / "latest").read_text().strip() == "step20"
    assert sorted(p.name for p in (folder / "step20").iterdir() if p.name.endswith("optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert (folder / "best").is_symlink()
    assert (stage_runs[2] / "config.yaml").is_file()


@pytest.mark.slow
def test_two_nodes_on_loopback_match_one_node(stage_runs, toy_data, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    port, out = str(free_port()), tmp_path / "two_nodes"
    nodes = []
    for node_rank in (0, 1):
        launcher = ["--hostfile", str(hostfile), "--no_ssh", f"--node_rank={node_rank}", "--master_addr=127.0.0.1",
                    f"--master_port={port}"]
        command = train_command(toy_data, out, "train.max_steps=20", "train.valid_interval=10",
                                "train.save_interval=20", launcher=launcher)
        nodes.append(subprocess.Popen(command, cwd=REPO, env=run_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert relative_close(losses(out), losses(stage_runs[0]))


@pytest.mark.slow
def test_torchrun_entry_point_matches_deepspeed_launcher(stage_runs, toy_data, tmp_path):
    out = tmp_path / "torchrun"
    command = train_command(toy_data, out, "train.max_steps=20", "train.valid_interval=10", "train.save_interval=20")
    torchrun = str(Path(PYTHON).parent / "torchrun")
    result = subprocess.run([torchrun, "--nproc_per_node=2", f"--master_port={free_port()}", *command[1:]],
                            cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert relative_close(losses(out), losses(stage_runs[0]))


@pytest.mark.slow
def test_resume_after_kill_continues_identically(toy_data, tmp_path):
    # Dropout on, so the resumed run must also restore the random streams.
    overrides = ["train.max_steps=20", "train.save_interval=10", "train.valid_interval=100", "model.dropout=0.1",
                 "model.d_model=128", "data.max_tokens=2048"]
    straight = tmp_path / "straight"
    train(toy_data, straight, *overrides)
    interrupted = tmp_path / "interrupted"
    code = kill_after(train_command(toy_data, interrupted, *overrides), interrupted, step=12)
    assert code != 0 and 20 not in records(interrupted)  # really killed mid-run
    assert (interrupted / "checkpoints" / "latest").read_text().strip() == "step10"
    train(toy_data, interrupted, *overrides, "train.resume=auto")
    expected, resumed = records(straight), records(interrupted)
    assert [resumed[s]["loss"] for s in range(11, 21)] == [expected[s]["loss"] for s in range(11, 21)]


@pytest.mark.slow
def test_bf16_trains_and_exports_the_fp32_master_weights(toy_data, tmp_path):
    """bf16 at ZeRO-0 (one rank) and ZeRO-2 (two ranks, accumulating 2 micro-batches in fp32) learns; the
    ZeRO-0 export holds the optimizer's fp32 masters, not the bf16 weights the forward ran with."""
    from dsmt.checkpoint import model_states

    common = ("train.max_steps=12", "train.precision=bf16", "eval.valid_bleu=false", "train.valid_interval=100")
    runs = {"zero0": tmp_path / "zero0", "zero2": tmp_path / "zero2"}
    train(toy_data, runs["zero0"], *common)
    train(toy_data, runs["zero2"], *common, "train.grad_accum=2", ranks=2, ds="ds_configs/zero2.json")
    for out in runs.values():
        assert losses(out)[-1] < losses(out)[0] - 0.5, losses(out)

    model, _, _ = load_model(str(runs["zero0"]))
    states = model_states(runs["zero0"] / "checkpoints" / "step12")
    masters = dict(zip((name for name, _ in model.named_parameters()), states["optimizer"]["fp32_groups"][0]))
    exported = model.state_dict()
    assert all(torch.equal(exported[name], master) for name, master in masters.items())
    assert all(torch.equal(exported[name].bfloat16(), weight) for name, weight in states["module"].items())
    assert any(not torch.equal(w, w.bfloat16().float()) for w in exported.values())  # finer than bf16


def test_every_ds_config_initializes_on_cpu(toy_data, tmp_path):
    """Each JSON in ds_configs/ builds an engine and takes a step, in fp32 and in bf16 (one process)."""
    script = f"""
import json, sys, torch
from dsmt.config import load_config
from dsmt.engine import build_engine, close_distributed, init_distributed
from dsmt.model import Transformer
init_distributed(timeout_minutes=30)
for path in {[str(p) for p in DS_CONFIGS]!r}:
    for precision in ("fp32", "bf16"):
        cfg = load_config(overrides=["model.vocab_size=50", "model.d_model=32", "model.n_heads=2", "model.d_ff=64",
                                     "train.deepspeed_config=" + path, "train.precision=" + precision])
        engine, ds = build_engine(Transformer(cfg.model), cfg, 1)
        src = torch.randint(1, 50, (2, 5))
        loss = engine(src, src).float().logsumexp(-1).mean()
        engine.backward(loss)
        engine.step()
        print("OK", path, precision, ds["zero_optimization"]["stage"], flush=True)
close_distributed()
"""
    result = subprocess.run([PYTHON, "-c", script], cwd=REPO, env=run_env(), capture_output=True, text=True,
                            timeout=900)
    ok = [line for line in result.stdout.splitlines() if line.startswith("OK")]
    assert result.returncode == 0 and len(ok) == 2 * len(DS_CONFIGS), result.stdout[-2000:] + result.stderr[-3000:]


def test_zero2_non_finite_check_is_one_pass_and_finds_what_deepspeeds_finds(tmp_path):
    """dsmt's multi-tensor test of ZeRO-1/2 gradients (engine.check_gradients_in_one_pass) answers as DeepSpeed's
    per-tensor one does: no for finite gradients, yes for a NaN, +inf or -inf anywhere in any of them."""
    script = """
import torch
from deepspeed.runtime.utils import has_inf_or_nan
from dsmt.config import load_config
from dsmt.engine import build_engine, close_distributed, init_distributed
from dsmt.model import Transformer
init_distributed(timeout_minutes=30)
cfg = load_config(overrides=["model.vocab_size=50", "model.d_model=32", "model.n_heads=2", "model.d_ff=64",
                             "train.deepspeed_config=ds_configs/zero2.json", "train.precision=bf16"])
engine, _ = build_engine(Transformer(cfg.model), cfg, 1)
optimizer = engine.optimizer
src = torch.randint(1, 50, (2, 5))
engine.backward(engine(src, src).float().logsumexp(-1).mean())
grads = [g for g in optimizer.averaged_gradients[0] if g is not None]
def deepspeeds():
    return any(bool(has_inf_or_nan(g)) for g in grads)
answers = [(bool(optimizer.has_overflow_partitioned_grads_serial()), deepspeeds())]
for k, bad in ((0, float("nan")), (len(grads) // 2, float("inf")), (len(grads) - 1, -float("inf"))):
    flat = grads[k].view(-1)
    kept = flat[-1].clone()
    flat[-1] = bad
    answers.append((bool(optimizer.has_overflow_partitioned_grads_serial()), deepspeeds()))
    flat[-1] = kept
assert "check_gradients_in_one_pass" in optimizer.has_overflow_partitioned_grads_serial.__qualname__
assert not engine.tput_timer.config.enabled  # DeepSpeed reads dsmt's timer setting
print("ANSWERS", answers, len(grads))
close_distributed()
"""
    result = subprocess.run([PYTHON, "-c", script], cwd=REPO, env=run_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("ANSWERS"))
    answers, count = eval(line.split(" ", 1)[1].rsplit(" ", 1)[0]), int(line.rsplit(" ", 1)[1])
    assert answers == [(False, False), (True, True), (True, True), (True, True)] and count > 10


def test_fp16_on_cpu_is_one_clear_error(toy_data, tmp_path):
    result = train(toy_data, tmp_path / "fp16", "train.precision=fp16", "train.max_steps=1", check=False)
    assert result.returncode == 2
    assert "fp16 is not supported on the cpu accelerator" in result.stderr and "bf16" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "fp16" / "checkpoints").exists()


@pytest.mark.slow
def test_bf16_zero2_trains_on_multi30k(tmp_path):
    if not (MULTI30K / "train.en.gz").exists():
        pytest.skip("Multi30k raw files not found")
    from dsmt.data.corpora import multi30k_prefixes

    data = tmp_path / "m30k"
    prepare(multi30k_prefixes("en", "de", str(MULTI30K), None), str(data), PrepareOptions("en", "de", vocab_size=4000))
    out = tmp_path / "bf16"
    train(data, out, "train.precision=bf16", "train.max_steps=50", "train.valid_interval=1000",
          "train.save_interval=1000", "eval.valid_bleu=false", ds="ds_configs/zero2.json")
    curve = losses(out)
    assert len(curve) == 50 and sum(curve[-5:]) / 5 < sum(curve[:5]) / 5 - 1.0


@pytest.mark.slow
def test_max_minutes_ends_the_run_validated_and_saved_and_counts_across_resume(toy_data, tmp_path):
    out = tmp_path / "timed"
    budget = ("train.max_steps=100000", "train.max_minutes=0.1", "train.valid_interval=100000",
              "train.save_interval=100000")
    train(toy_data, out, *budget)
    steps = max(records(out))
    assert 1 < steps < 100000 and records(out)[steps]["wall_minutes"] >= 0.1
    assert steps in records(out, "valid") and latest_tag(out / "checkpoints") == f"step{steps}"
    train(toy_data, out, *budget)  # the budget is spent: the resumed run stops before any step
    assert max(records(out)) == steps

