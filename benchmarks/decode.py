"""Decoding speed: beam 5 and greedy (beam 1), with and without the key/value cache, same model and inputs.

    python benchmarks/decode.py --checkpoint runs/multi30k_en_de \
        --src data/multi30k_en_de/test2016.en.txt --ref data/multi30k_en_de/test2016.de.txt

Prints one table; speeds are also given as ratios to beam 5 without the cache, measured in this one run.
"""

import argparse
import time

import sacrebleu
import torch

from dsmt.translate import Translator, read_input


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--src", required=True)
    parser.add_argument("--ref", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-tokens", type=int, default=8000)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sources, references = read_input(args.src), read_input(args.ref)

    rows = []
    for beam in (5, 1):
        for use_cache in (False, True):
            translator = Translator(args.checkpoint, beam=beam, batch_tokens=args.batch_tokens, use_cache=use_cache)
            start = time.perf_counter()
            hypotheses = translator.translate(sources)
            seconds = time.perf_counter() - start
            tokens = sum(len(translator.sp.encode(h)) + 1 for h in hypotheses)  # + EOS
            bleu = sacrebleu.corpus_bleu(hypotheses, [references]).score
            rows.append((f"beam {beam}" if beam > 1 else "greedy", "yes" if use_cache else "no",
                         len(sources) / seconds, tokens / seconds, bleu))
    base = rows[0][2]
    print(f"{len(sources)} sentences, {args.threads} threads, checkpoint {args.checkpoint}")
    print("| search | KV cache | sentences/s | output tokens/s | speed vs beam 5 without cache | BLEU |")
    print("| --- | --- | --- | --- | --- | --- |")
    for search, cache, sentences, tokens, bleu in rows:
        print(f"| {search} | {cache} | {sentences:.1f} | {tokens:.0f} | {sentences / base:.2f}× | {bleu:.2f} |")


if __name__ == "__main__":
    main()
