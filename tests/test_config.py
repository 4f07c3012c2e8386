import subprocess

import pytest

from dsmt import DsmtError
from dsmt.config import load_config
from tests.conftest import PYTHON, run_env


def dsmt(*args):
    return subprocess.run([PYTHON, "-m", "dsmt.cli", *args], capture_output=True, text=True, env=run_env())


@pytest.mark.parametrize("args, words", [
    (["config", "model.d_modle=512"], ["model.d_modle", "did you mean 'model.d_model'"]),
    (["config", "modle.d_model=512"], ["modle", "did you mean 'model'"]),
    (["config", "model.d_model=abc"], ["model.d_model", "expects int", "abc"]),
    (["config", "model.norm_first=maybe"], ["model.norm_first", "expects bool"]),
    (["config", "model.preset=huge"], ["model.preset", "transformer_base"]),
    (["config", "model.d_model"], ["key=value"]),
    (["config", "--config", "missing.yaml"], ["missing.yaml", "not found"]),
])
def test_config_errors_exit_nonzero_naming_the_key(args, words):
    result = dsmt(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    for word in words:
        assert word in result.stderr


def test_yaml_errors_name_file_and_key(tmp_path):
    bad_key = tmp_path / "bad_key.yaml"
    bad_key.write_text("model:\n  n_head: 8\n")
    result = dsmt("config", "--config", str(bad_key))
    assert result.returncode == 2 and "model.n_head" in result.stderr and "model.n_heads" in result.stderr
    assert str(bad_key) in result.stderr

    broken = tmp_path / "broken.yaml"
    broken.write_text("model:\n  d_model: [1, 2\n")
    result = dsmt("config", "--config", str(broken))
    assert result.returncode == 2 and f"{broken}:" in result.stderr and "not valid YAML" in result.stderr


def test_precedence_defaults_preset_yaml_cli(tmp_path):
    experiment = tmp_path / "exp.yaml"
    experiment.write_text("model:\n  preset: transformer_base\n  d_ff: 1000\n  dropout: 0.2\n")
    cfg = load_config(str(experiment), ["model.dropout=0.3"])
    assert cfg.model.d_model == 512  # from the preset
    assert cfg.model.d_ff == 1000  # YAML over preset
    assert cfg.model.dropout == 0.3  # CLI over YAML
    assert cfg.model.max_positions == 1024  # dataclass default


def test_config_verb_prints_resolved_yaml():
    result = dsmt("config", "model.preset=transformer_big")
    assert result.returncode == 0, result.stderr
    assert "d_model: 1024" in result.stdout and "n_heads: 16" in result.stdout


def test_wrong_type_raises_dsmt_error_in_process():
    with pytest.raises(DsmtError, match="model.n_heads.*expects int"):
        load_config(overrides=["model.n_heads=four"])


def test_shipped_experiment_configs_load():
    from tests.conftest import REPO

    configs = sorted((REPO / "launch" / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        cfg = load_config(str(path))
        assert (REPO / cfg.train.deepspeed_config).is_file()
