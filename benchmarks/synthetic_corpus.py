"""A WMT-shaped parallel corpus from a seeded generator, for benchmarks on machines without the real data.

    python benchmarks/synthetic_corpus.py --out /tmp/corpus --pairs 200000

Writes OUT/train.{en,de} and OUT/valid.{en,de}. Sentence lengths follow a log-normal law with WMT14 En-De's
shape (median ~22 words, a long tail, at most 120), words a Zipf law over a made-up vocabulary of
--words entries; the target is the source word by word through a fixed random mapping, with some words
dropped and a few reordered, so that source and target lengths differ as in real pairs.
"""

import argparse
from pathlib import Path

import numpy as np

LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyzäöü"))


def vocabulary(rng, size: int) -> np.ndarray:
    """``size`` made-up words of 2 to 10 letters (duplicates are harmless)."""
    letters = rng.choice(LETTERS, (size, 10))
    return np.array(["".join(row[:n]) for row, n in zip(letters.tolist(), rng.integers(2, 11, size).tolist())])


def write_split(prefix: Path, pairs: int, rng, source_words, target_words) -> None:
    ranks = np.arange(1, len(source_words) + 1)
    zipf = 1.0 / ranks
    zipf /= zipf.sum()
    with open(f"{prefix}.en", "w", encoding="utf-8") as en, open(f"{prefix}.de", "w", encoding="utf-8") as de:
        for start in range(0, pairs, 10_000):
            count = min(10_000, pairs - start)
            lengths = np.clip(rng.lognormal(np.log(22), 0.55, count).astype(int), 1, 120)
            words = rng.choice(len(source_words), int(lengths.sum()), p=zipf)
            for sentence in np.split(words, np.cumsum(lengths)[:-1]):
                kept = sentence[rng.random(len(sentence)) > 0.1] if len(sentence) > 3 else sentence
                if len(kept) > 2 and rng.random() < 0.3:
                    kept = np.roll(kept, 1)
                en.write(" ".join(source_words[sentence]) + "\n")
                de.write(" ".join(target_words[kept]) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--pairs", type=int, default=200_000)
    parser.add_argument("--valid-pairs", type=int, default=3000)
    parser.add_argument("--words", type=int, default=50_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    source_words, target_words = vocabulary(rng, args.words), vocabulary(rng, args.words)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_split(out / "train", args.pairs, rng, source_words, target_words)
    write_split(out / "valid", args.valid_pairs, rng, source_words, target_words)


if __name__ == "__main__":
    main()
