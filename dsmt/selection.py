"""Choosing among decodings of the valid set (checkpoint averages, length penalties) without following its noise.

A valid set of a thousand sentences has BLEU noise of several tenths: the best of five candidates usually wins
by chance. So a candidate replaces the default only when sacreBLEU's paired bootstrap resampling (1000 resamples
of the valid sentences, seeded) finds its gain over the default significant (p < 0.05), and then the best such
candidate wins. Each candidate is reported with its length ratio (hypotheses / references), where a length
penalty's effect shows.
"""

from dataclasses import dataclass

from sacrebleu.metrics import BLEU
from sacrebleu.significance import PairedTest

SIGNIFICANCE = 0.05
RESAMPLES = 1000
LENPENS = (0.6, 1.0, 1.4, 1.8, 2.2)  # the length penalties a selection tries; the first is dsmt translate's default


@dataclass(frozen=True)
class Scored:
    bleu: float
    length_ratio: float
    p_value: float | None  # of the gain over the default by paired bootstrap; None for the default itself


def choose(hypotheses: dict[str, list[str]], references: list[str], default: str) -> tuple[str, dict[str, Scored]]:
    """The name of the chosen candidate, and every candidate's score. ``hypotheses`` maps candidate names to their
    detokenized output for ``references``; ``default`` is one of the names."""
    names = [default, *(name for name in hypotheses if name != default)]
    test = PairedTest([(name, hypotheses[name]) for name in names], {"BLEU": BLEU()}, [references],
                      test_type="bs", n_samples=RESAMPLES)
    results = test()[1]["BLEU"]  # the default first, then the others in order, each with its p-value
    scored = {name: Scored(result.score, BLEU().corpus_score(hypotheses[name], [references]).ratio, result.p_value)
              for name, result in zip(names, results)}
    winners = [name for name in names[1:]
               if scored[name].bleu > scored[default].bleu and scored[name].p_value < SIGNIFICANCE]
    return max(winners, key=lambda name: scored[name].bleu, default=default), scored


def describe(name: str, score: Scored) -> str:
    versus = "the default" if score.p_value is None else f"p = {score.p_value:.3f} against the default"
    return f"valid BLEU {score.bleu:.2f}, length ratio {score.length_ratio:.3f} ({versus}): {name}"
