"""The ``dsmt`` command: thin verbs that parse arguments, call one function, and print.

A ``DsmtError`` becomes one line on stderr and exit status 2, never a traceback.
"""

import argparse
import sys

from omegaconf import OmegaConf

from dsmt import DsmtError, __version__


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="experiment YAML (e.g. launch/configs/toy.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. model.d_model=512")


def _config(args) -> None:
    from dsmt.config import load_config

    print(OmegaConf.to_yaml(load_config(args.config, args.overrides)), end="")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsmt", description="DeepSpeed-configured Transformer training for machine translation.")
    parser.add_argument("--version", action="version", version=f"dsmt {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    config = verbs.add_parser("config", help="print the resolved experiment config (checks every key)")
    _add_config_arguments(config)
    config.set_defaults(func=_config)
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
