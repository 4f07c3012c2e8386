"""DeepSpeed set-up: read a ds_config JSON, fill its "auto" values from the dsmt config, check it, initialize.

How dsmt reconciles token batching with DeepSpeed's sample counts (DeepSpeed issue 1051): dsmt owns the
data loader and each micro-batch is one token-bounded batch (``data.max_tokens``), so DeepSpeed's
``train_micro_batch_size_per_gpu`` is bookkeeping fixed at 1 and ``train_batch_size`` counts micro-batches
(micro × accumulation × world size). Throughput is always reported in tokens.
"""

import copy
import ctypes
import json
import os
import re
import signal
import socket
import sys
from datetime import timedelta
from pathlib import Path

from dsmt import DsmtError

AUTO = "auto"
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
# The sections dsmt reads or fills: when present, each must be a JSON object.
OBJECT_SECTIONS = ("optimizer", "optimizer.params", "fp16", "bf16", "data_types", "timers", "timers.throughput",
                   "zero_optimization", "zero_optimization.offload_optimizer", "zero_optimization.offload_param")


def read_ds_config(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise DsmtError(f"DeepSpeed config {path} not found; pick one of ds_configs/*.json")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise DsmtError(f"{path}:{e.lineno}:{e.colno}: invalid JSON ({e.msg})") from None
    if not isinstance(config, dict):
        raise DsmtError(f"{path}: a DeepSpeed config is a JSON object")
    for section in OBJECT_SECTIONS:
        value = config
        for key in section.split("."):
            value = value.get(key, {})
            if not isinstance(value, dict):
                raise DsmtError(f'{path}: "{section}" must be a JSON object ({{...}}), not {json.dumps(value)}')
    return config


def accelerator_caps() -> tuple[str, bool, bool]:
    """(name, fp16 supported, bf16 supported) of the accelerator DeepSpeed picked (CPU when there is no GPU)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    return accelerator.device_name(), bool(accelerator.is_fp16_supported()), bool(accelerator.is_bf16_supported())


def resolve_precision(requested: str, ds: dict, path: str, caps) -> str:
    """fp32, bf16 or fp16: ``train.precision`` and any explicit ``enabled: true`` in the JSON must agree."""
    if requested not in PRECISIONS:
        raise DsmtError(f"train.precision={requested!r}; choose one of {PRECISIONS}")
    in_json = [kind for kind in ("fp16", "bf16") if ds.get(kind, {}).get("enabled") is True]
    if len(in_json) > 1 or in_json and requested not in (AUTO, in_json[0]):
        raise DsmtError(f"{path} enables {' and '.join(in_json)} but train.precision={requested}; "
                        'set "enabled": "auto" in the JSON and choose with train.precision')
    device, has_fp16, has_bf16 = caps
    precision = in_json[0] if in_json else requested
    if precision == AUTO:
        precision = ("bf16" if has_bf16 else "fp16") if device != "cpu" else "fp32"
        print(f"train.precision=auto: {precision} on {device}")
    if precision == "fp16" and not has_fp16:
        raise DsmtError(f"fp16 is not supported on the {device} accelerator (asked by {path if in_json else 'train.precision'}); "
                        "use train.precision=bf16 (or fp32) with the same ds_config")
    if precision == "bf16" and not has_bf16:
        raise DsmtError(f"bf16 is not supported on the {device} accelerator; use train.precision=fp16 or fp32")
    return precision


def fill_ds_config(ds: dict, train_cfg, world_size: int, path: str, caps) -> dict:
    """A copy of ``ds`` with every "auto" filled, or a clear error on a contradiction."""
    ds = copy.deepcopy(ds)
    stage = zero_stage(ds)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise DsmtError(f"{path}: zero_optimization.stage={stage!r}; it must be 0, 1, 2 or 3 (see ds_configs/)")
    micro = ds.setdefault("train_micro_batch_size_per_gpu", AUTO)
    if micro not in (AUTO, 1):
        raise DsmtError(f'{path}: train_micro_batch_size_per_gpu={micro}; it must be 1 or "auto": dsmt batches by '
                        "tokens (data.max_tokens) and one micro-batch is one token batch")
    ds["train_micro_batch_size_per_gpu"] = 1
    if ds.setdefault("gradient_accumulation_steps", AUTO) == AUTO:
        ds["gradient_accumulation_steps"] = train_cfg.grad_accum
    accumulation = ds["gradient_accumulation_steps"]
    if ds.setdefault("train_batch_size", AUTO) == AUTO:
        ds["train_batch_size"] = accumulation * world_size
    if ds["train_batch_size"] != accumulation * world_size:
        raise DsmtError(f"{path}: train_batch_size={ds['train_batch_size']} but train_micro_batch_size_per_gpu × "
                        f"gradient_accumulation_steps × world size = 1 × {accumulation} × {world_size} = "
                        f"{accumulation * world_size}; set it to \"auto\"")

    params = ds.get("optimizer", {}).get("params", {})
    if params.get("lr") == AUTO:
        params["lr"] = train_cfg.lr
    if params.get("torch_adam") == AUTO:
        # DeepSpeed's own FusedAdam is built with nvcc at first use, which pip-only installs lack; PyTorch's
        # Adam ships a fused kernel for CUDA and CPU alike (one pass per tensor instead of a dozen).
        params["torch_adam"] = True
        params.setdefault("fused", True)

    precision = resolve_precision(train_cfg.precision, ds, path, caps)
    for kind in ("fp16", "bf16"):
        ds.setdefault(kind, {})["enabled"] = kind == precision
    _fill_gradient_dtypes(ds, precision, path)
    _fill_device_settings(ds, caps[0])
    ds.setdefault("steps_per_print", 10 ** 9)  # dsmt logs itself
    # and counts tokens/s itself: DeepSpeed's throughput timer (samples/s, on by default) synchronizes the device at
    # every forward and step, so the host cannot queue a step while the last one runs (seen on an H200: the
    # largest host waits of a ZeRO-2 step, docs/results.md).
    ds.setdefault("timers", {}).setdefault("throughput", {}).setdefault("enabled", False)
    leftover = [key for key, value in _walk(ds) if value == AUTO]
    if leftover:
        raise DsmtError(f"{path}: dsmt cannot fill \"auto\" for {leftover}; give them values")
    return ds


def _fill_gradient_dtypes(ds: dict, precision: str, path: str) -> None:
    """"auto" gradient accumulation and communication dtypes. With bf16, DeepSpeed would accumulate and
    all-reduce gradients in bf16 (8 bits of mantissa: summing 8 ranks' or 4 micro-batches' gradients loses
    the small ones); dsmt all-reduces in fp32 at every stage and accumulates in fp32 at ZeRO-2/3. ZeRO-0 has
    no fp32-accumulating bf16 optimizer in DeepSpeed 0.19, and ZeRO-1's (BF16_Optimizer) writes checkpoints
    that ``zero_to_fp32`` cannot consolidate, so those two accumulate in bf16 (exact with one micro-batch per
    step). fp16 keeps DeepSpeed's defaults, which its loss scaling is made for."""
    stage = zero_stage(ds)
    accumulate = {"fp32": "fp32", "bf16": "fp32" if stage >= 2 else "bf16", "fp16": "fp16"}[precision]
    communicate = {"fp32": "fp32", "bf16": "fp32", "fp16": "fp16"}[precision]
    if ds.get("communication_data_type") == AUTO:
        ds["communication_data_type"] = communicate
    types = ds.get("data_types", {})
    if types.get("grad_accum_dtype") == AUTO:
        types["grad_accum_dtype"] = accumulate
    if types.get("grad_accum_dtype") == "fp32" and precision == "bf16" and stage == 0:
        raise DsmtError(f'{path}: data_types.grad_accum_dtype=fp32 with bf16 needs ZeRO stage >= 1 in DeepSpeed; '
                        'use "auto" or a zero1/zero2/zero3 config')


# "auto" ZeRO settings by device: (CPU, GPU). On GPUs DeepSpeed's recommended values: parameters under 100k
# elements (biases, LayerNorms) stay whole on every rank instead of being gathered for each use; ZeRO-2
# overlaps its gradient reduction with backward; offloaded tensors sit in pinned memory for asynchronous
# copies. On a CPU there is nothing to overlap or pin, and the tests measure ZeRO-3's partitioning of every
# parameter.
DEVICE_SETTINGS = {"stage3_param_persistence_threshold": (0, 100_000), "overlap_comm": (False, True)}


def _fill_device_settings(ds: dict, device: str) -> None:
    zero = ds.get("zero_optimization", {})
    on_gpu = device != "cpu"
    for key, values in DEVICE_SETTINGS.items():
        if zero.get(key) == AUTO:
            zero[key] = values[on_gpu]
    for offload in ("offload_optimizer", "offload_param"):
        if zero.get(offload, {}).get("pin_memory") == AUTO:
            zero[offload]["pin_memory"] = on_gpu


def allow_tf32(enabled: bool) -> None:
    """fp32 matmuls on TF32 tensor cores (10-bit mantissa inputs, fp32 accumulation): several times the fp32
    rate on Ampere and later GPUs, which PyTorch leaves off by default. CUDA only: a CPU keeps full fp32."""
    import torch

    if enabled and torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")


HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)$")


def check_hostfile(path: str) -> dict[str, int]:
    """DeepSpeed's hostfile, checked line by line before any node starts: ``HOSTNAME slots=N`` per node,
    ``#`` comments and blank lines allowed. Returns {host: slots}."""
    file = Path(path)
    if not file.is_file():
        raise DsmtError(f"hostfile {path} not found")
    hosts = {}
    for number, raw in enumerate(file.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = HOSTFILE_LINE.match(line)
        if not match or int(match.group(2)) < 1:
            raise DsmtError(f"{path}:{number}: {line!r} is not 'HOSTNAME slots=N' with N >= 1 (one node per line)")
        if match.group(1) in hosts:
            raise DsmtError(f"{path}:{number}: host {match.group(1)} is listed twice")
        hosts[match.group(1)] = int(match.group(2))
    if not hosts:
        raise DsmtError(f"{path} lists no node; write one 'HOSTNAME slots=N' line per node")
    return hosts


def _walk(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _walk(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_minutes: float) -> tuple[int, int, int]:
    """Join the job the launcher (deepspeed, torchrun) describes, or become a world of one; (rank, world, local
    world). A collective that waits longer than ``timeout_minutes`` fails instead of hanging."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if "WORLD_SIZE" in os.environ:
        follow_launcher()
    else:  # plain `python launch/train.py`: no launcher, no MPI
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    timeout = timedelta(minutes=timeout_minutes)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), timeout=timeout)
    _time_out_new_groups(timeout)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _unlink_shm_buffer(rank)
    return rank, world, local_world_size(os.environ, world)


def _time_out_new_groups(timeout: timedelta) -> None:
    """Give the process groups made after this one the job's timeout too. DeepSpeed all-reduces gradients in
    groups of its own (its data-parallel group is a clone of the world) made with ``new_group(ranks)``, which
    torch gives its default timeout (30 minutes for Gloo, 10 for NCCL), so a rank stuck before a gradient
    all-reduce would hold its peers that long. torch reads that default from these module globals whenever a
    group is made without a timeout."""
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = distributed_c10d.default_pg_nccl_timeout = timeout


def local_world_size(env, world: int) -> int:
    """Ranks on this node: torchrun says LOCAL_WORLD_SIZE, DeepSpeed's launcher LOCAL_SIZE."""
    return int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or world)


def follow_launcher() -> None:
    """Have the kernel send this rank SIGTERM when the process that started it dies (Linux).

    A launcher killed with SIGKILL (OOM killer, scheduler, user) cannot stop its ranks, which would run on
    holding the master port and the GPUs. SIGTERM takes the trainer's pre-emption path: finish the step,
    save, exit. If the launcher died before this was armed, act on it at once."""
    if not sys.platform.startswith("linux"):
        return
    launcher = os.getppid()
    pr_set_pdeathsig = 1  # from linux/prctl.h
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != launcher:
        os.kill(os.getpid(), signal.SIGTERM)


def _unlink_shm_buffer(rank: int) -> None:
    """DeepSpeed's CPU all-reduce maps one /dev/shm file per rank (when all ranks share a machine) and never
    removes it, so every job, ended or killed, used to leave 69 MB per rank behind. Once every rank has
    mapped every file (the barrier), each rank unlinks its own: the mappings stay valid until exit."""
    import deepspeed.comm as ds_comm

    ds_comm.barrier()
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"
    Path("/dev/shm", name).unlink(missing_ok=True)


def close_distributed() -> None:
    """Destroy the process group before the interpreter exits: Gloo's worker threads otherwise abort the
    exit now and then ("terminate called without an active exception", SIGABRT; pytorch#190489)."""
    import deepspeed.comm as ds_comm
    import torch.distributed as dist

    if dist.is_initialized():
        ds_comm.destroy_process_group()


def inverse_sqrt(warmup_steps: int):
    """The paper's schedule as a multiplier of the peak lr: linear warmup, then 1/sqrt(step); steps count from 1."""
    def factor(updates_done: int) -> float:
        step = updates_done + 1
        return min(step / warmup_steps, (warmup_steps / step) ** 0.5)
    return factor


def zero_stage(ds: dict) -> int:
    return ds.get("zero_optimization", {}).get("stage", 0)


def build_engine(model, cfg, world_size: int, load_universal: bool = False):
    """``deepspeed.initialize`` on ``model`` with the filled ds_config and the inverse-sqrt schedule;
    ``load_universal`` makes ``load_checkpoint`` read a universal checkpoint (see ``dsmt.checkpoint``)."""
    import deepspeed
    import torch

    path = cfg.train.deepspeed_config
    ds = fill_ds_config(read_ds_config(path), cfg.train, world_size, path, accelerator_caps())
    if load_universal:
        ds.setdefault("checkpoint", {})["load_universal"] = True
    schedule = inverse_sqrt(cfg.train.warmup_steps)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds,
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule))
    if engine.zero_optimization_stage() == 0 and engine.dp_world_size == 1:
        # One data-parallel rank has nothing to average, but DeepSpeed would still flatten every gradient for it.
        engine.enable_backward_allreduce = False
    check_gradients_in_one_pass(engine.optimizer)
    return engine, ds


def check_gradients_in_one_pass(optimizer) -> None:
    """Make ZeRO-1/2's test for non-finite gradients one multi-tensor pass instead of one per gradient tensor.

    Before every step, DeepSpeed 0.19's ZeRO-1/2 optimizer (``DeepSpeedZeroOptimizer``) tests each gradient of its
    partition with ``isfinite(amax) & isfinite(amin)``: about 15 kernel launches per tensor, some 2,900 of the
    4,200 launches of a transformer_big step, and a quarter of its host time on an H200 (docs/results.md). The
    largest absolute value of every tensor, from one ``_foreach_norm(ord=inf)``, answers the same question (it is
    inf or NaN exactly when the tensor holds one: max propagates NaN). DeepSpeed keeps doing the rest: its
    all-reduce of the answer, the skipped step, the reported state. Turning its check off instead
    (``bf16.check_grad_overflow: false``) would also stop it treating a non-finite norm as one, and apply the step.
    Other optimizers (ZeRO-0 and ZeRO-3 check a global norm or a flat buffer) are left as they are."""
    import torch
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return

    def has_overflow_partitioned_grads_serial():
        grads = [g for i in range(len(optimizer.bit16_groups)) for g in optimizer.averaged_gradients[i] or []
                 if g is not None and g.numel()]
        if not grads:
            return torch.zeros(1, dtype=torch.bool, device=optimizer.device)
        largest = torch.stack(torch._foreach_norm(grads, ord=float("inf")))
        return largest.isfinite().all().logical_not().reshape(1)

    optimizer.has_overflow_partitioned_grads_serial = has_overflow_partitioned_grads_serial


def optimizer_description(engine) -> str:
    """Which optimizer DeepSpeed built, e.g. ``torch.optim.adamw.AdamW (fused) in DeepSpeed's DeepSpeedZeroOptimizer``."""
    basic, outer = engine.basic_optimizer, engine.optimizer
    text = f"{type(basic).__module__}.{type(basic).__name__}"
    if getattr(basic, "defaults", {}).get("fused"):
        text += " (fused)"
    return text if outer is basic else f"{text} in DeepSpeed's {type(outer).__name__}"


def partitioned_bytes(engine) -> dict[str, int]:
    """Bytes this rank holds of parameters and of optimizer state (Adam's moments), read from the tensors
    DeepSpeed keeps: a ZeRO-3 parameter's local shard is ``ds_tensor``; ZeRO-1/2/3 step an inner optimizer
    over flat partitions."""
    import torch

    params = sum(getattr(p, "ds_tensor", p).numel() * p.element_size() for p in engine.module.parameters())
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    state = sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    return {"param_bytes": params, "optimizer_state_bytes": state}


def gradient_bytes(engine) -> int:
    """Bytes of gradient storage this rank holds once backward has finished at an accumulation boundary:
    the parameters' ``.grad`` (ZeRO-0/1 keep them whole), ZeRO-1/2's reduced partitions
    (``averaged_gradients``) and ZeRO-3's flat partition buffer; each storage counted once."""
    import torch

    optimizer = engine.optimizer
    tensors = [p.grad for p in engine.module.parameters() if p.grad is not None]
    for group in (getattr(optimizer, "averaged_gradients", None) or {}).values():
        tensors += [t for t in (group or []) if torch.is_tensor(t)]
    flat = getattr(optimizer, "grad_partitions_flat_buffer", None)
    if torch.is_tensor(flat):
        tensors.append(flat)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())
