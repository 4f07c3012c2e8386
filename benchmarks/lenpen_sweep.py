"""Beam search across length penalties on one set: BLEU, length ratio and seconds per penalty, optionally each
paired (bootstrap, as the recipe's selection) against the same penalty of an earlier sweep, e.g. another commit's.

    python benchmarks/lenpen_sweep.py --checkpoint runs/multi30k_en_de/models/average_of_last_5 \
        --src data/multi30k_en_de/valid.en.txt --ref data/multi30k_en_de/valid.de.txt --out sweep_new.json \
        [--against sweep_old.json]

Only the valid set should choose anything: this is for comparing decoders on it, never for tuning on a test set.
"""

import argparse
import json
import os
import time

import torch
from sacrebleu.metrics import BLEU

from dsmt.selection import LENPENS, choose
from dsmt.translate import Translator, read_input


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--src", required=True)
    parser.add_argument("--ref", required=True)
    parser.add_argument("--lenpens", default=",".join(map(str, LENPENS)))
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True, help="JSON of the hypotheses and seconds per penalty")
    parser.add_argument("--against", help="an earlier --out: pair each penalty with its hypotheses there")
    args = parser.parse_args()
    if args.against and not os.path.isfile(args.against):
        parser.error(f"--against {args.against}: no such file; give the --out of an earlier sweep")
    torch.set_num_threads(args.threads)
    sources, references = read_input(args.src), read_input(args.ref)
    earlier = json.load(open(args.against)) if args.against else {}

    translator = Translator(args.checkpoint, beam=args.beam)  # loaded once: the seconds are decoding only
    sweep = {}
    for lenpen in args.lenpens.split(","):
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
