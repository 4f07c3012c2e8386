"""The Multi30k recipe end to end: prepare, train for a wall-clock budget, pick on valid, test once.

    python launch/multi30k.py --src en --tgt de          # 60 minutes of training on 2 CPU cores
    python launch/multi30k.py --src de --tgt en train.max_minutes=30   # a shorter budget

Extra ``key=value`` arguments override ``launch/configs/multi30k_en_de.yaml``. After training, the candidates
are the best-BLEU checkpoint and the averages of the last 1, 3 and 5 checkpoints; each is decoded on
valid with beam 5, and the length penalty (0.6 to 2.2) is chosen on valid for the best one. Only that
model and penalty translate test2016. The result (test sacreBLEU and chrF with signatures, the choices, minutes,
machine) is printed and written to OUTPUT_DIR/results.json.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from dsmt import DsmtError
from dsmt.checkpoint import TAG, average, checkpoints_dir
from dsmt.cli import main as dsmt
from dsmt.config import load_config
from dsmt.translate import Translator, evaluate

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "launch" / "configs" / "multi30k_en_de.yaml"  # De→En overrides its data and output dirs
LENPENS = (0.6, 1.0, 1.4, 1.8, 2.2)  # 1.4 won every earlier run: the grid reaches past it


def valid_bleu(model_dir: str, data: Path, src: str, tgt: str, lenpen: float) -> float:
    translator = Translator(model_dir, beam=5, lenpen=lenpen)
    return evaluate(translator, str(data / f"valid.{src}.txt"), str(data / f"valid.{tgt}.txt"))["bleu"]


def candidates(run: Path) -> dict[str, list[str]]:
    folder = checkpoints_dir(str(run))
    steps = sorted(int(m.group(1)) for p in folder.iterdir() if (m := TAG.match(p.name)))
    found = {f"average of last {k}": [str(folder / f"step{s}") for s in steps[-k:]] for k in (1, 3, 5)
             if len(steps) >= k}
    if (folder / "best").exists():
        found["best valid BLEU (greedy)"] = [str((folder / "best").resolve())]
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="de")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    pair = f"{args.src}_{args.tgt}"
    overrides = [f"data.dir=data/multi30k_{pair}", f"train.output_dir=runs/multi30k_{pair}", *args.overrides]
    cfg = load_config(str(CONFIG), overrides)
    data, run = Path(cfg.data.dir), Path(cfg.train.output_dir)

    if dsmt(["prepare", "multi30k", "--src", args.src, "--tgt", args.tgt, "--out", str(data)]):
        sys.exit(2)
    subprocess.run([sys.executable, str(REPO / "launch" / "train.py"), "--config", str(CONFIG), *overrides], check=True)

    scores = {}
    for name, paths in candidates(run).items():
        model_dir = str(run / "models" / name.replace(" ", "_"))
        average(paths, model_dir)
        scores[name] = (valid_bleu(model_dir, data, args.src, args.tgt, LENPENS[0]), model_dir)
        print(f"valid BLEU {scores[name][0]:.2f}: {name}", flush=True)
    chosen = max(scores, key=lambda k: scores[k][0])
    model_dir = scores[chosen][1]
    by_lenpen = {LENPENS[0]: scores[chosen][0]}
    by_lenpen.update({lp: valid_bleu(model_dir, data, args.src, args.tgt, lp) for lp in LENPENS[1:]})
    lenpen = max(by_lenpen, key=by_lenpen.get)
    print(f"valid BLEU by length penalty: {by_lenpen}; chosen {lenpen}", flush=True)

    test = evaluate(Translator(model_dir, beam=5, lenpen=lenpen), str(data / f"test2016.{args.src}.txt"),
                    str(data / f"test2016.{args.tgt}.txt"), str(run / "test2016.hyp"))
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    last = [r for r in log if r["kind"] == "train"][-1]
    results = {"direction": f"{args.src}-{args.tgt}", "test_set": "test2016_flickr", "bleu": test["bleu"],
               "bleu_line": test["bleu_line"], "chrf_line": test["chrf_line"], "model": chosen, "lenpen": lenpen,
               "valid_bleu": {name: s for name, (s, _) in scores.items()}, "valid_bleu_by_lenpen": by_lenpen,
               "steps": last["step"], "train_minutes": last["wall_minutes"],
               "machine": f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
                          f"torch {torch.__version__}"}
    (run / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(test["bleu_line"])
    print(test["chrf_line"])
    print(f"{chosen}, lenpen {lenpen}, {last['step']} steps in {last['wall_minutes']:.1f} min -> {run / 'results.json'}")


if __name__ == "__main__":
    try:
        main()
    except DsmtError as e:
        sys.exit(f"multi30k: error: {e}")
