"""``dsmt prepare``: raw parallel text → a binarized data directory.

The directory holds the sentencepiece model(s), per split and language a flat array of token ids and an
array of sentence offsets (``np.load(..., mmap_mode="r")`` at train time), the raw text of the evaluation
splits (references for BLEU), and ``meta.json``. It is built in a temporary sibling and renamed into
place, so an interrupted or failed run never leaves a directory that looks complete.
"""

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm
from tqdm import tqdm

from dsmt import DsmtError
from dsmt.data.corpora import read_parallel, text_file
from dsmt.files import Product, check_replaceable, staged_dir

FORMAT_VERSION = 1
SPECIALS = {"pad": 0, "unk": 1, "bos": 2, "eos": 3}


@dataclass
class PrepareOptions:
    src: str
    tgt: str
    vocab_size: int = 8000
    joint: bool = True
    model_type: str = "unigram"  # or "bpe"
    max_len: int = 250  # subword tokens per side, training pairs only
    max_ratio: float = 3.0  # longer side / shorter side, training pairs only


def _fingerprint(splits: dict[str, str], options: PrepareOptions) -> str:
    digest = hashlib.sha256(json.dumps([FORMAT_VERSION, asdict(options), sorted(splits)]).encode())
    for name in sorted(splits):
        for lang in (options.src, options.tgt):
            with open(text_file(splits[name], lang), "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
    return digest.hexdigest()


def read_meta(data_dir) -> dict | None:
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DsmtError(f"{path} is damaged (not JSON); prepare the data again into a new --out") from None


def _written_entries(data_dir: Path) -> set[str] | None:
    """The files ``dsmt prepare`` wrote into ``data_dir``, as its meta.json tells; None if it has none."""
    meta = read_meta(data_dir)
    if meta is None:
        return None
    names = {"meta.json"} | {f for name in meta["spm"].values() for f in (name, name[:-len(".model")] + ".vocab")}
    for split in meta["splits"]:
        for lang in (meta["src"], meta["tgt"]):
            names |= {f"{split}.{lang}.ids.npy", f"{split}.{lang}.offsets.npy"}
            if split != "train":
                names.add(f"{split}.{lang}.txt")
    return names


DATA_DIR = Product("a data directory written by dsmt prepare", _written_entries)


def load_meta(data_dir) -> dict:
    """The meta.json of a prepared data directory, or a clear error saying how to make one."""
    if not Path(data_dir).is_dir():
        raise DsmtError(f"data directory {data_dir} does not exist; create it with `dsmt prepare ... --out {data_dir}`")
    meta = read_meta(data_dir)
    if meta is None:
        raise DsmtError(f"{data_dir} is not a dsmt data directory (no meta.json); "
                        f"create it with `dsmt prepare ... --out {data_dir}`")
    return meta


def _train_sentencepiece(lines: list[str], prefix: Path, options: PrepareOptions) -> spm.SentencePieceProcessor:
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_prefix=str(prefix), vocab_size=options.vocab_size,
            model_type=options.model_type, character_coverage=1.0, num_threads=os.cpu_count() or 1,
            input_sentence_size=5_000_000, shuffle_input_sentence=True, minloglevel=2,
            pad_id=SPECIALS["pad"], unk_id=SPECIALS["unk"], bos_id=SPECIALS["bos"], eos_id=SPECIALS["eos"])
    except RuntimeError as e:
        limit = re.search(r"<= (\d+)", str(e))
        if limit:
            raise DsmtError(f"--vocab-size {options.vocab_size} is larger than the training text allows; "
                            f"pass --vocab-size {limit.group(1)} or less") from None
        raise DsmtError(f"sentencepiece training failed: {e}") from None
    return spm.SentencePieceProcessor(model_file=f"{prefix}.model")


def _encode(sp: spm.SentencePieceProcessor, lines: list[str], label: str, chunk: int = 20000) -> list[list[int]]:
    ids = []
    for start in tqdm(range(0, len(lines), chunk), desc=f"encode {label}", unit="chunk", disable=None, leave=False):
        ids += sp.encode(lines[start:start + chunk], num_threads=os.cpu_count() or 1)
    return ids


def _keep_mask(src_raw, tgt_raw, src_ids, tgt_ids, options: PrepareOptions) -> tuple[np.ndarray, dict]:
    src_len = np.array([len(x) for x in src_ids])
    tgt_len = np.array([len(x) for x in tgt_ids])
    empty = np.array([not s.strip() or not t.strip() for s, t in zip(src_raw, tgt_raw)], dtype=bool)
    too_long = ~empty & ((src_len > options.max_len) | (tgt_len > options.max_len))
    ratio = np.maximum(src_len, tgt_len) / np.maximum(np.minimum(src_len, tgt_len), 1)
    bad_ratio = ~empty & ~too_long & (ratio > options.max_ratio)
    dropped = {"empty": int(empty.sum()), "too_long": int(too_long.sum()), "length_ratio": int(bad_ratio.sum())}
    return ~(empty | too_long | bad_ratio), dropped


def _write_ids(folder: Path, stem: str, ids: list[list[int]], dtype) -> int:
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    flat = np.fromiter((t for x in ids for t in x), dtype=dtype, count=int(offsets[-1]))
    np.save(folder / f"{stem}.ids.npy", flat)
    np.save(folder / f"{stem}.offsets.npy", offsets)
    return int(offsets[-1])


def _note_long_lines(name: str, paths, src_ids, tgt_ids, max_len: int) -> None:
    """Evaluation splits are kept whole; say which line training's data.max_tokens must hold."""
    lengths = [max(len(s), len(t)) + 1 for s, t in zip(src_ids, tgt_ids)]  # + EOS/BOS
    longest = int(np.argmax(lengths))
    if lengths[longest] > max_len:
        print(f"note: {paths[0]}:{longest + 1} has {lengths[longest]} tokens with EOS (more than --max-len {max_len}); "
              f"evaluation splits are kept whole, so training on split {name!r} needs data.max_tokens >= "
              f"{lengths[longest]}")


def check_options(splits: dict[str, str], options: PrepareOptions) -> None:
    """Options and split names that cannot make a usable data directory, refused before any work."""
    if options.model_type not in ("unigram", "bpe"):
        raise DsmtError(f"--model-type must be unigram or bpe, not {options.model_type!r}")
    if options.src == options.tgt:
        raise DsmtError(f"--src and --tgt are both {options.src!r}; a translation direction needs two languages")
    for flag, value, least in (("--vocab-size", options.vocab_size, 8), ("--max-len", options.max_len, 1),
                               ("--max-ratio", options.max_ratio, 1)):
        if value < least:
            raise DsmtError(f"{flag} {value}: must be at least {least}")
    missing = {"train", "valid"} - set(splits)
    if missing:
        raise DsmtError(f"dsmt prepare needs the splits {sorted(missing)} too")


def _build(corpora: dict, folder: Path, options: PrepareOptions, fingerprint: str) -> dict:
    src_train, tgt_train, _ = corpora["train"]
    langs = (options.src, options.tgt)
    if options.joint:
        shared = _train_sentencepiece(src_train + tgt_train, folder / "spm", options)
        processors, spm_files = {lang: shared for lang in langs}, {lang: "spm.model" for lang in langs}
    else:
        processors = {lang: _train_sentencepiece(lines, folder / f"spm.{lang}", options)
                      for lang, lines in zip(langs, (src_train, tgt_train))}
        spm_files = {lang: f"spm.{lang}.model" for lang in langs}
    vocab = {lang: processors[lang].vocab_size() for lang in langs}
    dtype = np.uint16 if max(vocab.values()) <= np.iinfo(np.uint16).max else np.int32

    splits = {}
    for name, (src_raw, tgt_raw, paths) in tqdm(corpora.items(), desc="binarize", unit="split", disable=None):
        src_ids = _encode(processors[options.src], src_raw, f"{name}.{options.src}")
        tgt_ids = _encode(processors[options.tgt], tgt_raw, f"{name}.{options.tgt}")
        info = {"files": [str(p) for p in paths], "raw_pairs": len(src_raw)}
        if name == "train":  # evaluation splits stay whole, so BLEU covers every reference
            keep, info["dropped"] = _keep_mask(src_raw, tgt_raw, src_ids, tgt_ids, options)
            src_raw, tgt_raw = [x for x, k in zip(src_raw, keep) if k], [x for x, k in zip(tgt_raw, keep) if k]
            src_ids, tgt_ids = [x for x, k in zip(src_ids, keep) if k], [x for x, k in zip(tgt_ids, keep) if k]
            if not src_ids:
                raise DsmtError(f"no training pair is left after filtering ({info['dropped']}); check the files "
                                f"{info['files']} or loosen --max-len/--max-ratio")
        else:
            _note_long_lines(name, paths, src_ids, tgt_ids, options.max_len)
            for lang, lines in ((options.src, src_raw), (options.tgt, tgt_raw)):
                (folder / f"{name}.{lang}.txt").write_text("".join(line + "\n" for line in lines))
        info["pairs"] = len(src_ids)
        info["tokens"] = {options.src: _write_ids(folder, f"{name}.{options.src}", src_ids, dtype),
                          options.tgt: _write_ids(folder, f"{name}.{options.tgt}", tgt_ids, dtype)}
        splits[name] = info

    meta = {"format": FORMAT_VERSION, "src": options.src, "tgt": options.tgt, "joint": options.joint,
            "model_type": options.model_type, "vocab_size": vocab, "specials": SPECIALS, "spm": spm_files,
            "options": asdict(options), "splits": splits, "fingerprint": fingerprint}
    (folder / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def prepare(splits: dict[str, str], out: str, options: PrepareOptions) -> dict:
    """Binarize ``splits`` (name → file prefix; needs 'train' and 'valid') into ``out``; returns its meta.

    Re-running on the same inputs and options reuses ``out``; changed inputs rebuild it.
    """
    check_options(splits, options)
    out_dir = Path(out)
    fingerprint = _fingerprint(splits, options)
    existing = read_meta(out_dir)
    if existing and existing.get("fingerprint") == fingerprint:
        print(f"{out_dir}: up to date with its inputs, reused")
        return existing
    check_replaceable(out_dir, DATA_DIR, "--out")

    corpora = {name: read_parallel(prefix, options.src, options.tgt) for name, prefix in splits.items()}
    for name, (src_lines, _, paths) in corpora.items():
        if not src_lines:
            raise DsmtError(f"{paths[0]} and {paths[1]} (split {name!r}) have no lines; every split needs sentence pairs")
    with staged_dir(out_dir, DATA_DIR) as staging:
        meta = _build(corpora, staging, options, fingerprint)
    train = meta["splits"]["train"]
    print(f"{out_dir}: {train['pairs']} training pairs kept of {train['raw_pairs']} (dropped {train['dropped']}), "
          f"vocabulary {meta['vocab_size']}, splits {list(meta['splits'])}")
    return meta
