import os
import sys
from pathlib import Path

import pytest
import torch

# Two cores: one intra-op thread per test process keeps multi-process tests from oversubscribing.
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
MULTI30K = REPO.parent / "shared" / "data" / "multi30k"


@pytest.fixture
def multi30k_dir():
    if not (MULTI30K / "train.en.gz").exists():
        pytest.skip(f"Multi30k raw files not found in {MULTI30K}")
    return MULTI30K


def run_env(**extra):
    """Environment for subprocesses that run dsmt: the repo importable, one thread per process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.update(extra)
    return env


PYTHON = sys.executable


@pytest.fixture(scope="session")
def toy_data(tmp_path_factory):
    """The toy corpus, prepared once per test session."""
    from dsmt.data.corpora import write_toy_corpus
    from dsmt.data.prepare import PrepareOptions, prepare

    folder = tmp_path_factory.mktemp("toy")
    raw = folder / "raw"
    raw.mkdir()
    prepare(write_toy_corpus(raw), str(folder / "data"), PrepareOptions("en", "de", vocab_size=300))
    return folder / "data"
