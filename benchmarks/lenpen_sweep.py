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

from dsmt.selection import choose
from dsmt.translate import Translator, read_input


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--src", required=True)
    parser.add_argument("--ref", required=True)
    parser.add_argument("--lenpens", default="0.6,1.0,1.4,1.8,2.2")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True, help="JSON of the hypotheses and seconds per penalty")
    parser.add_argument("--against", help="an earlier --out: pair each penalty with its hypotheses there")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sources, references = read_input(args.src), read_input(args.ref)
    earlier = json.load(open(args.against)) if args.against else {}

    sweep = {}
    for lenpen in args.lenpens.split(","):
        start = time.perf_counter()
        hypotheses = Translator(args.checkpoint, beam=args.beam, lenpen=float(lenpen)).translate(sources)
        sweep[lenpen] = {"seconds": time.perf_counter() - start, "hypotheses": hypotheses}
        score = BLEU().corpus_score(hypotheses, [references])
        line = f"lenpen {lenpen}: BLEU {score.score:.2f}, length ratio {score.ratio:.3f}, {sweep[lenpen]['seconds']:.1f} s"
        if lenpen in earlier:
            _, paired = choose({"earlier": earlier[lenpen]["hypotheses"], "this": hypotheses}, references, "earlier")
            line += (f"; earlier BLEU {paired['earlier'].bleu:.2f}, length ratio {paired['earlier'].length_ratio:.3f},"
                     f" {earlier[lenpen]['seconds']:.1f} s; difference p = {paired['this'].p_value:.3f}")
        print(line, flush=True)
    with open(args.out, "w") as stream:
        json.dump(sweep, stream)


if __name__ == "__main__":
    main()
