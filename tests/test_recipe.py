"""The Multi30k recipe end to end (launch/multi30k.py): prepare, train, choose on valid, translate test2016 once."""

import json
import subprocess

import pytest

from dsmt.selection import SIGNIFICANCE
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
    by_model, by_lenpen = results["valid_by_model"], results["valid_by_lenpen"]
    assert {"average of last 1", "average of last 3", "average of last 5"} <= set(by_model)
    assert set(by_lenpen) == {"0.6", "1.0", "1.4", "1.8", "2.2"}
    # Each choice is its default unless a candidate beats it by more than the valid set's noise; the test set
    # only gets translated.
    for chosen, scores, default in ((results["model"], by_model, "average of last 5"),
                                    (str(results["lenpen"]), by_lenpen, "0.6")):
        assert scores[default]["p_value"] is None and all(s["length_ratio"] > 0 for s in scores.values())
        winners = {name: s["bleu"] for name, s in scores.items()
                   if name != default and s["p_value"] < SIGNIFICANCE and s["bleu"] > scores[default]["bleu"]}
        assert chosen == max(winners, key=winners.get, default=default)
        assert f"valid BLEU {scores[chosen]['bleu']:.2f}, length ratio" in done.stdout
    assert "nrefs:1|case:mixed|eff:no|tok:13a" in results["bleu_line"] and results["bleu_line"] in done.stdout
    assert len((run / "test2016.hyp").read_text().splitlines()) == 1000
