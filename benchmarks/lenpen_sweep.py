"""Beam search across length penalties on one set: BLEU, length ratio and seconds per penalty, optionally each
paired (bootstrap, as the recipe's selection) against the same penalty of an earlier sweep, e.g. another commit's.

    python benchmarks/lenpen_sweep.py --checkpoint runs/multi30k_en_de/models/average_of_last_5 \
        --src data/multi30k_en_de/valid.en.txt --ref data/multi30k_en_de/valid.de.txt --out sweep_new.json \
        [--against sweep_old.json]

Only the valid set should choose anything: this is for comparing decoders on it, never for tuning on a test set.
"""

import argparse
import json
import time

import torch
from sacrebleu.metrics import BLEU

from dsmt import DsmtError
from dsmt.files import check_input_file, check_output_file
from dsmt.selection import LENPENS, choose
from dsmt.translate import Translator, read_input


def penalties(text: str) -> list[str]:
    """``--lenpens``: kept as written, since they name the penalties in the JSON an ``--against`` pairs by."""
    values = text.split(",")
    try:
        for value in values:
            float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated numbers, e.g. 0.6,1.4") from None
    return values


def read_inputs(args) -> tuple[list[str], list[str], dict]:
    """Sources, references and the earlier sweep, each checked before the model is loaded."""
    for path, flag in ((args.src, "--src"), (args.ref, "--ref"), (args.against, "--against")):
        if path:
            check_input_file(path, flag)
    check_output_file(args.out, "--out")
    sources, references = read_input(args.src), read_input(args.ref)
    if len(sources) != len(references):
        raise DsmtError(f"{args.src} has {len(sources)} lines but {args.ref} has {len(references)}")
    if not args.against:
        return sources, references, {}
    try:
        earlier = json.loads(open(args.against, encoding="utf-8").read())
        counts = {lenpen: len(run["hypotheses"]) for lenpen, run in earlier.items()}
    except (ValueError, TypeError, KeyError, AttributeError):
        raise DsmtError(f"--against {args.against} is not a sweep's JSON; give the --out of an earlier sweep") from None
    for lenpen, count in counts.items():
        if count != len(references):
            raise DsmtError(f"--against {args.against}: lenpen {lenpen} has {count} hypotheses "
                            f"but {args.ref} has {len(references)} lines; give a sweep of the same set")
    return sources, references, earlier


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--src", required=True)
    parser.add_argument("--ref", required=True)
    parser.add_argument("--lenpens", type=penalties, default=",".join(map(str, LENPENS)))
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True, help="JSON of the hypotheses and seconds per penalty")
    parser.add_argument("--against", help="an earlier --out: pair each penalty with its hypotheses there")
    args = parser.parse_args()
    try:
        sources, references, earlier = read_inputs(args)
    except DsmtError as e:
        parser.error(str(e))
    torch.set_num_threads(args.threads)

    translator = Translator(args.checkpoint, beam=args.beam)  # loaded once: the seconds are decoding only
    sweep = {}
    for lenpen in args.lenpens:
        translator.lenpen = float(lenpen)
        start = time.perf_counter()
        hypotheses = translator.translate(sources)
        sweep[lenpen] = {"seconds": time.perf_counter() - start, "hypotheses": hypotheses}
        if lenpen in earlier:
            _, paired = choose({"earlier": earlier[lenpen]["hypotheses"], "this": hypotheses}, references, "earlier")
            this, before = paired["this"], paired["earlier"]
            versus = (f"; earlier BLEU {before.bleu:.2f}, length ratio {before.length_ratio:.3f},"
                      f" {earlier[lenpen]['seconds']:.1f} s; difference p = {this.p_value:.3f}")
            bleu, ratio = this.bleu, this.length_ratio
        else:
            score = BLEU().corpus_score(hypotheses, [references])
            versus, bleu, ratio = "", score.score, score.ratio
        print(f"lenpen {lenpen}: BLEU {bleu:.2f}, length ratio {ratio:.3f}, {sweep[lenpen]['seconds']:.1f} s{versus}",
              flush=True)
    with open(args.out, "w") as stream:
        json.dump(sweep, stream)


if __name__ == "__main__":
    main()
