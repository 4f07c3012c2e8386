"""Declarative configuration: structured dataclasses, model presets, YAML files and key=value overrides.

Precedence, lowest first: dataclass defaults, the chosen ``model.preset``, the YAML file, the command line.
Every key is checked against the schema before any work starts.
"""

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dsmt import DsmtError


def ranged(default, low=None, high=None, *, low_open=False, high_open=False, choices=None):
    """A field whose value must lie in the interval (or be one of ``choices``); checked when a config loads."""
    return field(default=default, metadata={"range": (low, high, low_open, high_open), "choices": choices})


@dataclass
class ModelConfig:
    preset: str = "small"
    vocab_size: int = ranged(8000, 1)  # filled from the data directory at train time
    pad_id: int = ranged(0, 0)  # likewise
    d_model: int = ranged(256, 2)
    n_heads: int = ranged(4, 1)
    n_encoder_layers: int = ranged(3, 1)
    n_decoder_layers: int = ranged(3, 1)
    d_ff: int = ranged(1024, 1)
    dropout: float = ranged(0.1, 0.0, 1.0, high_open=True)
    attention_dropout: float = ranged(0.0, 0.0, 1.0, high_open=True)
    activation_dropout: float = ranged(0.0, 0.0, 1.0, high_open=True)
    norm_first: bool = True
    share_embeddings: bool = True
    positions: str = ranged("sinusoidal", choices=("sinusoidal", "learned"))
    max_positions: int = ranged(1024, 1)
    src_vocab_size: int = ranged(0, 0)  # 0: the same as vocab_size (one joint vocabulary)


# Preset values sit between the dataclass defaults and the user's YAML/CLI, which may override any of them.
MODEL_PRESETS = {
    "small": dict(d_model=256, n_heads=4, n_encoder_layers=3, n_decoder_layers=3, d_ff=1024,
                  dropout=0.1, norm_first=True),
    "transformer_base": dict(d_model=512, n_heads=8, n_encoder_layers=6, n_decoder_layers=6, d_ff=2048,
                             dropout=0.1, norm_first=False),
    "transformer_big": dict(d_model=1024, n_heads=16, n_encoder_layers=6, n_decoder_layers=6, d_ff=4096,
                            dropout=0.3, norm_first=False),
}


@dataclass
class SubwordSamplingConfig:
    """Training sentences segmented anew each epoch (unigram sentencepiece models); evaluation is never sampled."""
    enabled: bool = False
    sides: str = ranged("both", choices=("both", "src", "tgt"))
    # Kudo's (2018) n-best sampling: one of the n best segmentations, drawn with probability ∝ P(x)^alpha
    alpha: float = ranged(0.1, 0.0, 1.0, low_open=True)
    nbest: int = ranged(16, 2)
    # threads segmenting an epoch; 0: this rank's share of the cores on a GPU (idle there), 1 on a CPU (training)
    threads: int = ranged(0, 0)


@dataclass
class DataConfig:
    dir: str = "data/toy"  # a `dsmt prepare` output
    max_tokens: int = ranged(4096, 1)  # per micro-batch, padded source and padded target each
    valid_split: str = "valid"
    subword_sampling: SubwordSamplingConfig = field(default_factory=SubwordSamplingConfig)


@dataclass
class TrainConfig:
    output_dir: str = "runs/toy"
    deepspeed_config: str = "ds_configs/zero0.json"
    # auto | fp32 | bf16 | fp16: fills "enabled": "auto" in the ds_config
    precision: str = ranged("auto", choices=("auto", "fp32", "bf16", "fp16"))
    max_steps: int = ranged(1000, 1)
    max_minutes: float = ranged(0.0, 0.0)  # stop (validate, save) after this much wall-clock training time; 0: no limit
    seed: int = ranged(1, 0)
    lr: float = ranged(1e-3, 0.0)  # peak, reached at the end of warmup
    warmup_steps: int = ranged(1000, 1)
    grad_accum: int = ranged(1, 1)  # fills gradient_accumulation_steps: "auto"
    label_smoothing: float = ranged(0.1, 0.0, 1.0, high_open=True)
    log_interval: int = ranged(50, 1)
    valid_interval: int = ranged(500, 1)
    save_interval: int = ranged(500, 1)
    keep_last: int = ranged(3, 1)
    max_skips_in_a_row: int = ranged(10, 1)  # steps with a non-finite loss/gradient (bf16/fp32) before the run stops
    resume: str = "auto"  # auto | none | a checkpoint directory
    threads: int = ranged(0, 0)  # torch threads per rank; 0: the cores divided among this node's ranks
    # a collective waiting longer than this fails with the step it was in
    dist_timeout_minutes: float = ranged(30.0, 0.0, low_open=True)
    deterministic: bool = False  # deterministic kernels only (GPUs: slower; CPU runs are deterministic anyway)
    tf32: bool = True  # fp32 matmuls on TF32 tensor cores (CUDA; no effect on a CPU)


@dataclass
class EvalConfig:
    max_len_a: float = ranged(1.2, 0.0)  # hypotheses stop at a * source length + b tokens
    max_len_b: int = ranged(10, 0)
    valid_bleu: bool = True  # greedy-decode the valid set at each validation


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def _interval(low, high, low_open, high_open) -> str:
    return f"{'(' if low_open else '['}{'-inf' if low is None else low}, {'inf' if high is None else high}" \
           f"{')' if high_open or high is None else ']'}"


def _out_of_range(value, low, high, low_open, high_open) -> bool:
    return (low is not None and (value < low or low_open and value == low)) or \
           (high is not None and (value > high or high_open and value == high))


def check_values(cfg: DictConfig) -> None:
    """Every value within its field's range or choices, and the few rules that tie keys together."""
    for key in _schema_keys(Config):
        spec = _field(key).metadata
        if "range" not in spec:
            continue
        value = OmegaConf.select(cfg, key)
        if spec["choices"] is not None:
            if value not in spec["choices"]:
                raise DsmtError(f"config key '{key}'={value!r}; choose one of {list(spec['choices'])}")
        elif _out_of_range(value, *spec["range"]):
            raise DsmtError(f"config key '{key}'={value!r} is out of range; allowed: {_interval(*spec['range'])}")
    model = cfg.model
    if model.d_model % model.n_heads:
        raise DsmtError(f"config key 'model.n_heads'={model.n_heads} does not divide model.d_model={model.d_model}; "
                        "each head gets d_model / n_heads dimensions")
    if model.positions == "sinusoidal" and model.d_model % 2:
        raise DsmtError(f"config key 'model.d_model'={model.d_model} is odd; sinusoidal positions need an even width")
    if cfg.eval.max_len_a == 0 and cfg.eval.max_len_b == 0:
        raise DsmtError("config keys 'eval.max_len_a'=0 and 'eval.max_len_b'=0 leave no room for any output token")


def _schema_keys(schema, prefix="") -> list[str]:
    keys = []
    for f in dataclasses.fields(schema):
        path = prefix + f.name
        keys.append(path)
        if dataclasses.is_dataclass(f.type):
            keys += _schema_keys(f.type, path + ".")
    return keys


def _field(path: str) -> dataclasses.Field:
    schema, found = Config, None
    for name in path.split("."):
        found = {f.name: f for f in dataclasses.fields(schema)}[name]
        schema = found.type
    return found


def _field_type(path: str):
    return _field(path).type


def _user_keys(node, prefix="") -> list[str]:
    keys = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        keys.append(path)
        if isinstance(value, dict):
            keys += _user_keys(value, path + ".")
    return keys


def _check_keys(user: dict, source: str) -> None:
    valid = _schema_keys(Config)
    sections = {k for k in valid if dataclasses.is_dataclass(_field_type(k))}
    for key in _user_keys(user):
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid sections are {sorted(sections)}"
            raise DsmtError(f"unknown config key '{key}' in {source}{hint}")
        if key in sections and not isinstance(_get(user, key), dict):
            raise DsmtError(f"config key '{key}' in {source} is a section; set its fields, e.g. '{key}.<name>=...'")


def _get(node: dict, path: str):
    for name in path.split("."):
        node = node[name]
    return node


def _load_yaml(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise DsmtError(f"config file {path} not found")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        raise DsmtError(f"config file {path}{where} is not valid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise DsmtError(f"config file {path} must hold a mapping of sections (model:, data:, ...)")
    return data


def _parse_overrides(overrides) -> dict:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise DsmtError(f"override '{item}' is not of the form key=value (e.g. model.d_model=512)")
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)))
    except OmegaConfBaseException as e:
        raise DsmtError(f"cannot parse overrides {list(overrides)}: {e}") from None


def _value_error(error: OmegaConfBaseException, data: dict, source: str) -> DsmtError:
    key = getattr(error, "full_key", None)
    if not key:
        return DsmtError(f"invalid value in {source}: {error}")
    expected = getattr(_field_type(key), "__name__", _field_type(key))
    return DsmtError(f"config key '{key}' in {source} expects {expected}, got {_get(data, key)!r}")


def load_config(path: str | None = None, overrides=()) -> DictConfig:
    """The experiment config: defaults, then the preset, then ``path`` (YAML), then ``key=value`` overrides."""
    layers = [(_load_yaml(path), f"config file {path}")] if path else []
    layers.append((_parse_overrides(overrides), "command-line overrides"))
    for data, source in layers:
        _check_keys(data, source)

    preset = OmegaConf.select(OmegaConf.merge(*[OmegaConf.create(d) for d, _ in layers]), "model.preset",
                              default=ModelConfig.preset)
    if preset not in MODEL_PRESETS:
        raise DsmtError(f"model.preset={preset!r} is not a preset; choose one of {sorted(MODEL_PRESETS)}")

    cfg = OmegaConf.structured(Config)
    for data, source in [({"model": MODEL_PRESETS[preset]}, "preset")] + layers:
        try:
            cfg = OmegaConf.merge(cfg, data)
        except OmegaConfBaseException as e:
            raise _value_error(e, data, source) from None
    check_values(cfg)
    return cfg
