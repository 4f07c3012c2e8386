"""The ``dsmt`` command: thin verbs that parse arguments, call one function, and print.

A ``DsmtError`` becomes one line on stderr and exit status 2, never a traceback.
"""

import argparse
import sys
from pathlib import Path

from omegaconf import OmegaConf

from dsmt import DsmtError, __version__


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="experiment YAML (e.g. launch/configs/toy.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. model.d_model=512")


def _config(args) -> None:
    from dsmt.config import load_config

    print(OmegaConf.to_yaml(load_config(args.config, args.overrides)), end="")


def _train(args) -> None:
    from dsmt.config import load_config
    from dsmt.train import train

    overrides = list(args.overrides)
    if args.deepspeed_config:
        overrides.append(f"train.deepspeed_config={args.deepspeed_config}")
    train(load_config(args.config, overrides))


def _prepare(args) -> None:
    import tempfile

    from dsmt.data.corpora import multi30k_prefixes, write_toy_corpus
    from dsmt.data.prepare import PrepareOptions, prepare

    vocab_size = args.vocab_size or (300 if args.corpus == "toy" else 8000)
    options = PrepareOptions(src=args.src, tgt=args.tgt, vocab_size=vocab_size, joint=not args.separate_vocab,
                             model_type=args.model_type, max_len=args.max_len, max_ratio=args.max_ratio)
    if args.corpus == "multi30k":
        prepare(multi30k_prefixes(args.src, args.tgt, args.raw_dir, args.url), args.out, options)
    elif args.corpus == "toy":
        with tempfile.TemporaryDirectory() as folder:
            prepare(write_toy_corpus(Path(folder)), args.out, options)
    else:
        if not (args.train and args.valid):
            raise DsmtError("dsmt prepare needs --train PREFIX and --valid PREFIX (or a built-in corpus: multi30k, toy)")
        splits = {"train": args.train, "valid": args.valid}
        for prefix in args.test:
            splits[Path(prefix).name] = prefix
        prepare(splits, args.out, options)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsmt", description="DeepSpeed-configured Transformer training for machine translation.")
    parser.add_argument("--version", action="version", version=f"dsmt {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    config = verbs.add_parser("config", help="print the resolved experiment config (checks every key)")
    _add_config_arguments(config)
    config.set_defaults(func=_config)

    train = verbs.add_parser("train", help="train a model (the `deepspeed` launcher runs launch/train.py)")
    _add_config_arguments(train)
    train.add_argument("--deepspeed_config", "--deepspeed-config", help="a ds_configs/*.json (train.deepspeed_config)")
    train.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    train.set_defaults(func=_train)

    prepare = verbs.add_parser(
        "prepare", help="train sentencepiece and binarize parallel text into a data directory",
        description="Read PREFIX.SRC/PREFIX.TGT (plain or .gz) for each split, or a built-in corpus.")
    prepare.add_argument("corpus", nargs="?", choices=["multi30k", "toy"], help="a built-in corpus instead of files")
    prepare.add_argument("--src", default="en", help="source language suffix (default: en)")
    prepare.add_argument("--tgt", default="de", help="target language suffix (default: de)")
    prepare.add_argument("--train", help="training file prefix")
    prepare.add_argument("--valid", help="validation file prefix")
    prepare.add_argument("--test", action="append", default=[], help="test file prefix (repeatable)")
    prepare.add_argument("--out", required=True, help="output data directory")
    prepare.add_argument("--vocab-size", type=int, help="sentencepiece vocabulary (default: 8000; toy: 300)")
    prepare.add_argument("--separate-vocab", action="store_true", help="one sentencepiece model per language")
    prepare.add_argument("--model-type", default="unigram", choices=["unigram", "bpe"])
    prepare.add_argument("--max-len", type=int, default=250, help="drop training pairs longer than this (subwords)")
    prepare.add_argument("--max-ratio", type=float, default=3.0, help="drop training pairs with a longer length ratio")
    prepare.add_argument("--raw-dir", help="multi30k: folder with the raw .gz files (default: ../shared/data/multi30k)")
    prepare.add_argument("--url", help="multi30k: base URL to download the raw files from")
    prepare.set_defaults(func=_prepare)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except DsmtError as e:
        print(f"dsmt: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
