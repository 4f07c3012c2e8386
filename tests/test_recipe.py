"""The Multi30k recipe end to end (launch/multi30k.py): prepare, train, choose on valid, translate test2016 once."""

import json
import subprocess

import pytest

from tests.conftest import PYTHON, REPO, run_env
from tests.training import TINY_MODEL

SHORT_RUN = ["train.threads=1", "train.max_steps=5", "train.save_interval=1", "train.valid_interval=2"]


@pytest.mark.slow
def test_multi30k_recipe_chooses_on_valid_and_writes_its_test_result(tmp_path, multi30k_dir):
    data, run = tmp_path / "data", tmp_path / "run"
    command = [PYTHON, "launch/multi30k.py", "--src", "de", "--tgt", "en",
               f"data.dir={data}", f"train.output_dir={run}", *TINY_MODEL, *SHORT_RUN]
    done = subprocess.run(command, cwd=REPO, env=run_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((run / "results.json").read_text())
    assert results["direction"] == "de-en" and results["steps"] == 5
    assert {"average of last 1", "average of last 3", "average of last 5"} <= set(results["valid_bleu"])
    # The model and the length penalty are the valid set's best; the test set only gets translated.
    assert results["model"] == max(results["valid_bleu"], key=results["valid_bleu"].get)
    by_lenpen = {float(k): v for k, v in results["valid_bleu_by_lenpen"].items()}
    assert results["lenpen"] == max(by_lenpen, key=by_lenpen.get)
    assert "nrefs:1|case:mixed|eff:no|tok:13a" in results["bleu_line"] and results["bleu_line"] in done.stdout
    assert len((run / "test2016.hyp").read_text().splitlines()) == 1000
