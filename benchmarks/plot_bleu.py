"""Valid BLEU against wall-clock minutes, read from the TensorBoard scalars of one or more runs.

    python benchmarks/plot_bleu.py runs/multi30k_en_de runs/multi30k_de_en --out docs/bleu_vs_minutes.png
"""

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def bleu_curve(run: Path) -> tuple[list[float], list[float]]:
    """(minutes, valid BLEU) at each validation of ``run``; minutes as the trainer logged them."""
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    if "valid/bleu" not in tags:
        raise SystemExit(f"{run}/tensorboard has no valid/bleu scalars (was eval.valid_bleu off?)")
    minutes = {e.step: e.value for e in events.Scalars("valid/wall_minutes")}
    points = [(minutes[e.step], e.value) for e in events.Scalars("valid/bleu") if e.step in minutes]
    return [m for m, _ in points], [b for _, b in points]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="train.output_dir folders")
    parser.add_argument("--out", default="docs/bleu_vs_minutes.png")
    parser.add_argument("--title", default="Multi30k valid BLEU (greedy) on 2 CPU cores")
    args = parser.parse_args()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for run in args.runs:
        minutes, bleu = bleu_curve(run)
        ax.plot(minutes, bleu, marker=".", label=run.name)
    ax.set(xlabel="wall-clock minutes of training (validation included)", ylabel="valid BLEU", title=args.title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(f"{args.out}: {len(args.runs)} curve(s)")


if __name__ == "__main__":
    main()
