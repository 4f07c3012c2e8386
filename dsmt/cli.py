"""The ``dsmt`` command: thin verbs that parse arguments, call one function, and print.

A ``DsmtError`` becomes one line on stderr and exit status 2, never a traceback.
"""

import argparse
import os
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


def _launch(args) -> None:
    """``deepspeed ARGS`` once the hostfile (if any) has passed ``check_hostfile``."""
    import shutil

    from dsmt.engine import check_hostfile

    for i, arg in enumerate(args.arguments):
        if arg == "--hostfile" and i + 1 < len(args.arguments):
            check_hostfile(args.arguments[i + 1])
        elif arg.startswith("--hostfile="):
            check_hostfile(arg.split("=", 1)[1])
    deepspeed = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")
    sys.stdout.flush()
    os.execv(deepspeed, [deepspeed, *args.arguments])


def _translator(args):
    from dsmt.translate import Translator

    return Translator(args.checkpoint, beam=args.beam, lenpen=args.lenpen, max_len_a=args.max_len_a,
                      max_len_b=args.max_len_b, batch_tokens=args.batch_tokens, nbest=getattr(args, "nbest", 1),
                      device=args.device)


def _translate(args) -> None:
    from dsmt.files import check_input_file, check_output_file
    from dsmt.translate import translate_stream

    check_input_file(args.input, "--input")
    check_output_file(args.output, "--output")
    translate_stream(_translator(args), args.input, args.output)


def _evaluate(args) -> None:
    from dsmt.files import check_input_file, check_output_file
    from dsmt.translate import evaluate

    check_input_file(args.src, "--src")
    check_input_file(args.ref, "--ref")
    check_output_file(args.hypotheses, "--hypotheses")
    scores = evaluate(_translator(args), args.src, args.ref, args.hypotheses)
    print(scores["bleu_line"])
    print(scores["chrf_line"])


def _export(args) -> None:
    if args.format == "ctranslate2":
        from dsmt.ct2 import export_ctranslate2

        export_ctranslate2(args.checkpoint, args.out, args.quantization)
    elif args.quantization:
        raise DsmtError("--quantization applies to --format ctranslate2; dsmt's own model dir keeps fp32 weights")
    else:
        from dsmt.checkpoint import export

        export(args.checkpoint, args.out)
    print(f"{args.out}: exported ({args.format})")


def _average(args) -> None:
    from dsmt.checkpoint import average

    average(args.checkpoints, args.out)
    print(f"{args.out}: average of {len(args.checkpoints)} checkpoints")


def _add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="a DeepSpeed checkpoint, or a model dir of dsmt export (either --format: ctranslate2 "
                             "decodes through CTranslate2)")
    parser.add_argument("--beam", type=int, default=5, help="beam size; 1 is greedy (default: 5)")
    parser.add_argument("--lenpen", type=float, default=0.6, help="GNMT length penalty alpha (default: 0.6)")
    parser.add_argument("--max-len-a", type=float, default=1.2, help="max output length = a * source length + b")
    parser.add_argument("--max-len-b", type=int, default=10)
    parser.add_argument("--batch-tokens", type=int, default=8000, help="source tokens × beam per batch")
    parser.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: auto, the GPU when there is one)")


def _prepare(args) -> None:
    import tempfile

    from dsmt.data.corpora import multi30k_prefixes, write_toy_corpus
    from dsmt.data.prepare import PrepareOptions, prepare

    vocab_size = args.vocab_size if args.vocab_size is not None else {"toy": 300, "wmt14": 32000}.get(args.corpus, 8000)
    options = PrepareOptions(src=args.src, tgt=args.tgt, vocab_size=vocab_size, joint=not args.separate_vocab,
                             model_type=args.model_type, max_len=args.max_len, max_ratio=args.max_ratio,
                             **({} if args.spm_sample is None else {"spm_sample": args.spm_sample}))
    if args.corpus == "multi30k":
        prepare(multi30k_prefixes(args.src, args.tgt, args.raw_dir, args.url), args.out, options)
    elif args.corpus == "wmt14":
        from dsmt.data.wmt14 import wmt14_prefixes

        prepare(wmt14_prefixes(args.src, args.tgt, args.raw_dir), args.out, options)
    elif args.corpus == "toy":
        with tempfile.TemporaryDirectory() as folder:
            prepare(write_toy_corpus(Path(folder)), args.out, options)
    else:
        if not (args.train and args.valid):
            raise DsmtError("dsmt prepare needs --train PREFIX and --valid PREFIX (or a built-in corpus: multi30k, wmt14, toy)")
        splits = {"train": args.train, "valid": args.valid}
        for prefix in args.test:
            name = Path(prefix).name
            if name in splits:
                raise DsmtError(f"--test {prefix}: its split would be named {name!r} (the file name before "
                                f".{args.src}), like the split from {splits[name]}; rename its files, e.g. to "
                                f"test.{args.src}/test.{args.tgt}")
            splits[name] = prefix
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

    launch = verbs.add_parser(
        "launch", help="run the deepspeed launcher after checking its hostfile",
        description="dsmt launch --hostfile hostfile [deepspeed options] launch/train.py [train arguments]: "
                    "the same as `deepspeed ...`, but a malformed hostfile is one clear error before any node starts.")
    launch.add_argument("arguments", nargs=argparse.REMAINDER, help="deepspeed launcher arguments")
    launch.set_defaults(func=_launch)

    prepare = verbs.add_parser(
        "prepare", help="train sentencepiece and binarize parallel text into a data directory",
        description="Read PREFIX.SRC/PREFIX.TGT (plain or .gz) for each split, or a built-in corpus.")
    prepare.add_argument("corpus", nargs="?", choices=["multi30k", "wmt14", "toy"],
                         help="a built-in corpus instead of files (wmt14: en-de or en-fr, the paper's data)")
    prepare.add_argument("--src", default="en", help="source language suffix (default: en)")
    prepare.add_argument("--tgt", default="de", help="target language suffix (default: de)")
    prepare.add_argument("--train", help="training file prefix")
    prepare.add_argument("--valid", help="validation file prefix")
    prepare.add_argument("--test", action="append", default=[], help="test file prefix (repeatable)")
    prepare.add_argument("--out", required=True, help="output data directory")
    prepare.add_argument("--vocab-size", type=int, help="sentencepiece vocabulary (default: 8000; wmt14: 32000; toy: 300)")
    prepare.add_argument("--separate-vocab", action="store_true", help="one sentencepiece model per language")
    prepare.add_argument("--model-type", default="unigram", choices=["unigram", "bpe"])
    prepare.add_argument("--max-len", type=int, default=250, help="drop training pairs longer than this (subwords)")
    prepare.add_argument("--max-ratio", type=float, default=3.0, help="drop training pairs with a longer length ratio")
    prepare.add_argument("--spm-sample", type=int, metavar="N",
                         help="train sentencepiece on N training pairs drawn at random (default: 200000)")
    prepare.add_argument("--raw-dir", help="multi30k: folder with the raw .gz files (default: ../shared/data/multi30k); "
                                           "wmt14: folder with its archives (default: download them)")
    prepare.add_argument("--url", help="multi30k: base URL to download the raw files from")
    prepare.set_defaults(func=_prepare)

    translate = verbs.add_parser("translate", help="translate raw text, one line per line")
    _add_decoding_arguments(translate)
    translate.add_argument("--input", default="-", help="a file, or - for stdin (default)")
    translate.add_argument("--output", default="-", help="a file, or - for stdout (default)")
    translate.add_argument("--nbest", type=int, default=1,
                           help="print the N best per line as 'index ||| translation ||| score' (N <= beam)")
    translate.set_defaults(func=_translate)

    evaluate = verbs.add_parser("evaluate", help="translate a test set and print sacreBLEU and chrF")
    _add_decoding_arguments(evaluate)
    evaluate.add_argument("--src", required=True, help="source text file")
    evaluate.add_argument("--ref", required=True, help="reference text file")
    evaluate.add_argument("--hypotheses", help="also write the translations here")
    evaluate.set_defaults(func=_evaluate)

    export = verbs.add_parser("export", help="consolidate a (ZeRO) checkpoint into a self-contained model dir")
    export.add_argument("--checkpoint", required=True, help="a step<N> folder, checkpoints folder or output dir")
    export.add_argument("--out", required=True, help="the model dir to write")
    export.add_argument("--format", default="dsmt", choices=["dsmt", "ctranslate2"],
                        help="dsmt: model.pt + config.yaml (default); ctranslate2: a CTranslate2 model dir")
    export.add_argument("--quantization", help="ctranslate2 only: int8, int8_float32, int8_float16, float16, "
                                               "bfloat16 or float32 (default: the weights' fp32)")
    export.set_defaults(func=_export)

    average = verbs.add_parser("average", help="average the parameters of several checkpoints")
    average.add_argument("--checkpoints", nargs="+", required=True)
    average.add_argument("--out", required=True)
    average.set_defaults(func=_average)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.verb == "launch":  # everything after the verb belongs to deepspeed, options included
        args.arguments = (sys.argv[1:] if argv is None else list(argv))[1:]
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        args.func(args)
        code = 0
    except DsmtError as e:
        print(f"dsmt: error: {e}", file=sys.stderr)
        code = 2
    if args.verb == "train":
        _leave(code)
    return code


def _leave(code: int) -> None:
    """A training process ends without interpreter finalization. A Gloo worker thread that drops its last
    reference to a tensor while Python finalizes needs the GIL, is made to exit, and aborts the whole process
    ("terminate called without an active exception", SIGABRT; pytorch#38228, #190489): a finished run would
    now and then be reported as failed. Everything dsmt writes is closed by now; flush what Python buffers."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
