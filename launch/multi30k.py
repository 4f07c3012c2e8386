"""The Multi30k recipe end to end: prepare, train for a wall-clock budget, pick on valid, test once.

    python launch/multi30k.py --src en --tgt de          # 60 minutes of training on 2 CPU cores
    python launch/multi30k.py --src de --tgt en train.max_minutes=30   # a shorter budget

Extra ``key=value`` arguments override ``launch/configs/multi30k_en_de.yaml``. After training, the candidates
are the best-BLEU checkpoint and the averages of the last 1, 3 and 5 checkpoints; each is decoded on
valid with beam 5, then the length penalty (0.6 to 2.2) for the chosen one. Each choice keeps its default (the
average of the last 5; `dsmt translate`'s penalty 0.6) unless a candidate beats it by more than the valid set's
noise (``dsmt.selection``). Only that model and penalty translate test2016. The result (test sacreBLEU and chrF
with signatures, the choices with valid BLEU, length ratio and p-value, minutes, machine) is printed and written
to OUTPUT_DIR/results.json.
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
from dsmt.selection import LENPENS, choose, describe
from dsmt.translate import Translator, evaluate, read_input

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "launch" / "configs" / "multi30k_en_de.yaml"  # De→En overrides its data and output dirs
DEFAULT_MODEL = "average of last 5"


def valid_choice(kind: str, decoders: dict, valid: tuple, decoded: dict, default: str) -> tuple[str, dict]:
    """Decode ``valid`` (sources, references) with beam 5 by each of ``decoders`` (name -> (model dir, length
    penalty)) not yet in ``decoded`` ((model dir, length penalty) -> hypotheses; one model loaded at a time),
    choose one (``dsmt.selection``), print why."""
    sources, references = valid
    for model_dir, lenpen in decoders.values():
        if (model_dir, lenpen) not in decoded:
            decoded[model_dir, lenpen] = Translator(model_dir, beam=5, lenpen=lenpen).translate(sources)
    chosen, scored = choose({name: decoded[decoder] for name, decoder in decoders.items()}, references, default)
    for name, score in scored.items():
        print(describe(name, score), flush=True)
    print(f"{kind}: {chosen}", flush=True)
    return chosen, {name: vars(score) for name, score in scored.items()}


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

    models = {}
    for name, paths in candidates(run).items():
        models[name] = str(run / "models" / name.replace(" ", "_"))
        average(paths, models[name])
    default = DEFAULT_MODEL if DEFAULT_MODEL in models else next(iter(models))  # fewer than 5 checkpoints: last 1
    valid = read_input(str(data / f"valid.{args.src}.txt")), read_input(str(data / f"valid.{args.tgt}.txt"))
    decoded = {}  # the chosen model at the first penalty is decoded once, for both choices
    chosen, by_model = valid_choice("model", {name: (path, LENPENS[0]) for name, path in models.items()},
                                    valid, decoded, default)
    model_dir = models[chosen]
    lenpen, by_lenpen = valid_choice("length penalty", {str(lp): (model_dir, lp) for lp in LENPENS},
                                     valid, decoded, str(LENPENS[0]))
    lenpen = float(lenpen)

    test = evaluate(Translator(model_dir, beam=5, lenpen=lenpen), str(data / f"test2016.{args.src}.txt"),
                    str(data / f"test2016.{args.tgt}.txt"), str(run / "test2016.hyp"))
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    last = [r for r in log if r["kind"] == "train"][-1]
    results = {"direction": f"{args.src}-{args.tgt}", "test_set": "test2016_flickr", "bleu": test["bleu"],
               "bleu_line": test["bleu_line"], "chrf_line": test["chrf_line"], "model": chosen, "lenpen": lenpen,
               "valid_by_model": by_model, "valid_by_lenpen": by_lenpen,
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
