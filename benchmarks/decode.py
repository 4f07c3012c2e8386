"""Decoding speed: dsmt's beam 5 and greedy (beam 1), with and without the key/value cache, and the same model
exported to CTranslate2 (float32 and int8), same inputs and threads, measured side by side in one run.

    python benchmarks/decode.py --checkpoint runs/multi30k_en_de \
        --src data/multi30k_en_de/test2016.en.txt --ref data/multi30k_en_de/test2016.de.txt

Prints one table; speeds are also given as ratios to dsmt's beam 5 without the cache and to its cached beam 5.
The CTranslate2 rows decode through `dsmt translate`'s own path (`Translator`), so the same batches, lengths and
length penalty apply.
"""

import argparse
import tempfile
import time
from pathlib import Path

import sacrebleu
import torch

from dsmt.ct2 import export_ctranslate2
from dsmt.translate import Translator, read_input


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--src", required=True)
    parser.add_argument("--ref", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-tokens", type=int, default=8000)
    parser.add_argument("--device", default="auto", help="cpu, cuda (default: auto, the GPU when there is one)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sources, references = read_input(args.src), read_input(args.ref)

    with tempfile.TemporaryDirectory() as exported:
        engines = [("dsmt", args.checkpoint, False), ("dsmt", args.checkpoint, True)]
        for quantization in ("float32", "int8"):
            path = str(Path(exported) / quantization)
            export_ctranslate2(args.checkpoint, path, quantization)
            engines.append((f"CTranslate2 {quantization}", path, True))
        rows = []
        for beam in (5, 1):
            for engine, path, use_cache in engines:
                translator = Translator(path, beam=beam, batch_tokens=args.batch_tokens, use_cache=use_cache,
                                        device=args.device)
                start = time.perf_counter()
                hypotheses = translator.translate(sources)  # ends with the hypotheses on the host
                seconds = time.perf_counter() - start
                tokens = sum(len(translator.sp.encode(h)) + 1 for h in hypotheses)  # + EOS
                bleu = sacrebleu.corpus_bleu(hypotheses, [references]).score
                rows.append((engine, f"beam {beam}" if beam > 1 else "greedy",
                             "yes" if use_cache else "no", len(sources) / seconds, tokens / seconds, bleu))
    base, cached_beam5 = rows[0][3], rows[1][3]
    print(f"{len(sources)} sentences on {translator.device}, {args.threads} threads, checkpoint {args.checkpoint}")
    print("| engine | search | KV cache | sentences/s | output tokens/s | vs dsmt beam 5 without cache "
          "| vs dsmt cached beam 5 | BLEU |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for engine, search, cache, sentences, tokens, bleu in rows:
        print(f"| {engine} | {search} | {cache} | {sentences:.1f} | {tokens:.0f} | {sentences / base:.2f}× "
              f"| {sentences / cached_beam5:.2f}× | {bleu:.2f} |")


if __name__ == "__main__":
    main()
