"""``dsmt prepare``: raw parallel text → a binarized data directory.

The directory holds the sentencepiece model(s), per split and language a flat array of token ids and an
array of sentence offsets (``np.load(..., mmap_mode="r")`` at train time), the training text the same way
(UTF-8 bytes and offsets, for subword sampling), the raw text of the evaluation splits (references for
BLEU), and ``meta.json``. It is built in a temporary sibling and renamed into
place, so an interrupted or failed run never leaves a directory that looks complete.

It streams, so memory does not grow with the corpus (WMT14 En-Fr has 36M pairs): a first pass checks every
line and draws a random sample for sentencepiece (``--spm-sample`` pairs), a second encodes chunks of pairs
on all cores and appends their ids to files on disk.
"""

import hashlib
import itertools
import json
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm
from tqdm import tqdm

from dsmt import DsmtError
from dsmt.data.corpora import read_pairs, text_file
from dsmt.files import Product, check_replaceable, staged_dir

FORMAT_VERSION = 2  # 2: the training text is kept (train.LANG.utf8.npy, train.LANG.utf8_offsets.npy)
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
    spm_sample: int = 200_000  # training pairs sentencepiece learns from (both sides for a joint model): ~1.3 GB


CHUNK_PAIRS = 20_000  # pairs encoded at once, on all cores (their ids as Python lists: ~50 MB)


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
            elif meta["format"] >= 2:
                names |= {f"train.{lang}.utf8.npy", f"train.{lang}.utf8_offsets.npy"}
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


def _keep_mask(src_raw, tgt_raw, src_ids, tgt_ids, options: PrepareOptions) -> tuple[np.ndarray, dict]:
    src_len = np.array([len(x) for x in src_ids])
    tgt_len = np.array([len(x) for x in tgt_ids])
    empty = np.array([not s.strip() or not t.strip() for s, t in zip(src_raw, tgt_raw)], dtype=bool)
    too_long = ~empty & ((src_len > options.max_len) | (tgt_len > options.max_len))
    ratio = np.maximum(src_len, tgt_len) / np.maximum(np.minimum(src_len, tgt_len), 1)
    bad_ratio = ~empty & ~too_long & (ratio > options.max_ratio)
    dropped = {"empty": int(empty.sum()), "too_long": int(too_long.sum()), "length_ratio": int(bad_ratio.sum())}
    return ~(empty | too_long | bad_ratio), dropped


class RaggedWriter:
    """Sequences of one split and language (token ids, or UTF-8 bytes), appended chunk by chunk to raw files
    beside the target and turned into ``VALUES.npy`` and ``OFFSETS.npy`` at the end; memory holds one chunk."""

    def __init__(self, folder: Path, values: str, offsets: str, dtype):
        self.dtype, self.total = np.dtype(dtype), 0
        self.values, self.offsets = open(folder / f"{values}.raw", "wb"), open(folder / f"{offsets}.raw", "wb")
        self.offsets.write(np.zeros(1, np.int64).tobytes())

    def append(self, values: np.ndarray, lengths: np.ndarray) -> None:
        self.values.write(values.astype(self.dtype, copy=False).tobytes())
        self.offsets.write((self.total + np.cumsum(lengths, dtype=np.int64)).tobytes())
        self.total += int(values.size)

    def append_ids(self, ids: list[list[int]]) -> None:
        lengths = np.fromiter(map(len, ids), np.int64, count=len(ids))
        self.append(np.fromiter(itertools.chain.from_iterable(ids), self.dtype, count=int(lengths.sum())), lengths)

    def append_text(self, lines: list[str]) -> None:
        encoded = [line.encode("utf-8") for line in lines]
        self.append(np.frombuffer(b"".join(encoded), np.uint8), np.fromiter(map(len, encoded), np.int64, len(encoded)))

    def close(self) -> int:
        """Write the two .npy files; returns the number of values (tokens, or bytes)."""
        for raw, dtype in ((self.values, self.dtype), (self.offsets, np.dtype(np.int64))):
            raw.close()
            _raw_to_npy(Path(raw.name), dtype)
        return self.total


def ids_writer(folder: Path, stem: str, dtype) -> RaggedWriter:
    return RaggedWriter(folder, f"{stem}.ids", f"{stem}.offsets", dtype)


def text_writer(folder: Path, stem: str) -> RaggedWriter:
    return RaggedWriter(folder, f"{stem}.utf8", f"{stem}.utf8_offsets", np.uint8)


def _raw_to_npy(raw: Path, dtype: np.dtype) -> None:
    """``NAME.raw`` (headerless) → ``NAME.npy``: the header, then the bytes copied as a stream (a
    memory map of the output would count towards this process's resident memory)."""
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
              "shape": (raw.stat().st_size // dtype.itemsize,)}
    with open(raw, "rb") as source, open(raw.with_suffix(".npy"), "wb") as target:
        np.lib.format.write_array_header_1_0(target, header)
        shutil.copyfileobj(source, target, 1 << 24)
    raw.unlink()


def _chunks(pairs, size: int = CHUNK_PAIRS):
    while chunk := list(itertools.islice(pairs, size)):
        yield chunk


def check_options(splits: dict[str, str], options: PrepareOptions) -> None:
    """Options and split names that cannot make a usable data directory, refused before any work."""
    if options.model_type not in ("unigram", "bpe"):
        raise DsmtError(f"--model-type must be unigram or bpe, not {options.model_type!r}")
    if options.src == options.tgt:
        raise DsmtError(f"--src and --tgt are both {options.src!r}; a translation direction needs two languages")
    for flag, value, least in (("--vocab-size", options.vocab_size, 8), ("--max-len", options.max_len, 1),
                               ("--max-ratio", options.max_ratio, 1),
                               ("--spm-sample", options.spm_sample, 1)):
        if value < least:
            raise DsmtError(f"{flag} {value}: must be at least {least}")
    missing = {"train", "valid"} - set(splits)
    if missing:
        raise DsmtError(f"dsmt prepare needs the splits {sorted(missing)} too")


def _scan(splits: dict[str, str], options: PrepareOptions) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The first pass, before any work: every line of every split is checked (UTF-8, equal line counts) and
    counted, and a uniform random sample of ``spm_sample`` training pairs is drawn (reservoir sampling; all
    of them, in order, when there are fewer)."""
    rng, counts, sample = random.Random(0), {}, []
    for name, prefix in splits.items():
        count = 0
        pairs = read_pairs(prefix, options.src, options.tgt)
        for count, pair in enumerate(tqdm(pairs, desc=f"check {name}", unit=" pairs", disable=None, leave=False), 1):
            if name != "train":
                continue
            if len(sample) < options.spm_sample:
                sample.append(pair)
            elif (slot := rng.randrange(count)) < options.spm_sample:
                sample[slot] = pair
        if count == 0:
            paths = [text_file(prefix, lang) for lang in (options.src, options.tgt)]
            raise DsmtError(f"{paths[0]} and {paths[1]} (split {name!r}) have no lines; every split needs sentence pairs")
        counts[name] = count
    return counts, sample


def _sentencepiece_models(sample: list[tuple[str, str]], folder: Path, options: PrepareOptions):
    """{lang: processor} and {lang: model file name}: one joint model, or one per language."""
    langs = (options.src, options.tgt)
    sides = {options.src: [s for s, _ in sample], options.tgt: [t for _, t in sample]}
    if options.joint:
        shared = _train_sentencepiece(sides[options.src] + sides[options.tgt], folder / "spm", options)
        return {lang: shared for lang in langs}, {lang: "spm.model" for lang in langs}
    return ({lang: _train_sentencepiece(sides[lang], folder / f"spm.{lang}", options) for lang in langs},
            {lang: f"spm.{lang}.model" for lang in langs})


def _binarize(name: str, prefix: str, pairs: int, folder: Path, processors: dict, dtype, options) -> dict:
    """The second pass over one split: encode chunks on all cores, filter training pairs, append the ids (and
    an evaluation split's text, kept whole for BLEU) to the files on disk."""
    langs = (options.src, options.tgt)
    info = {"files": [str(text_file(prefix, lang)) for lang in langs], "raw_pairs": pairs}
    writers = {lang: ids_writer(folder, f"{name}.{lang}", dtype) for lang in langs}
    if name == "train":  # the kept pairs' text, for subword sampling
        train_texts = {lang: text_writer(folder, f"{name}.{lang}") for lang in langs}
    else:  # the whole split's text, for BLEU
        texts = {lang: open(folder / f"{name}.{lang}.txt", "w", encoding="utf-8") for lang in langs}
    dropped, longest, done = {"empty": 0, "too_long": 0, "length_ratio": 0}, (0, 0), 0
    progress = tqdm(total=pairs, desc=f"encode {name}", unit=" pairs", disable=None, leave=False)
    for chunk in _chunks(read_pairs(prefix, *langs)):
        raw = {lang: [pair[side] for pair in chunk] for side, lang in enumerate(langs)}
        ids = {lang: processors[lang].encode(raw[lang], num_threads=os.cpu_count() or 1) for lang in langs}
        if name == "train":
            keep, counts = _keep_mask(raw[langs[0]], raw[langs[1]], ids[langs[0]], ids[langs[1]], options)
            dropped = {k: dropped[k] + counts[k] for k in dropped}
            ids = {lang: [x for x, k in zip(ids[lang], keep) if k] for lang in langs}
            for lang in langs:
                train_texts[lang].append_text([x for x, k in zip(raw[lang], keep) if k])
        else:
            lengths = [max(len(s), len(t)) + 1 for s, t in zip(ids[langs[0]], ids[langs[1]])]  # + EOS/BOS
            index = int(np.argmax(lengths))
            if lengths[index] > longest[0]:
                longest = (lengths[index], done + index + 1)  # (tokens, line number)
            for lang in langs:
                texts[lang].write("".join(line + "\n" for line in raw[lang]))
        for lang in langs:
            writers[lang].append_ids(ids[lang])
        done += len(chunk)
        progress.update(len(chunk))
    progress.close()
    if name == "train":
        info["text_bytes"] = {lang: train_texts[lang].close() for lang in langs}
    else:
        for text in texts.values():
            text.close()
    info["tokens"] = {lang: writers[lang].close() for lang in langs}
    info["pairs"] = pairs - sum(dropped.values())
    if name == "train":
        info["dropped"] = dropped
        if not info["pairs"]:
            raise DsmtError(f"no training pair is left after filtering ({dropped}); check the files "
                            f"{info['files']} or loosen --max-len/--max-ratio")
    elif longest[0] > options.max_len:  # evaluation splits are kept whole: say what training must hold
        print(f"note: {info['files'][0]}:{longest[1]} has {longest[0]} tokens with EOS (more than --max-len "
              f"{options.max_len}); training on split {name!r} needs data.max_tokens >= {longest[0]}")
    return info


def _build(splits: dict[str, str], counts: dict[str, int], sample, folder: Path, options: PrepareOptions,
           fingerprint: str) -> dict:
    processors, spm_files = _sentencepiece_models(sample, folder, options)
    sample.clear()  # the encoding pass needs its memory
    vocab = {lang: processors[lang].vocab_size() for lang in (options.src, options.tgt)}
    dtype = np.uint16 if max(vocab.values()) <= np.iinfo(np.uint16).max else np.int32
    info = {name: _binarize(name, prefix, counts[name], folder, processors, dtype, options)
            for name, prefix in splits.items()}
    meta = {"format": FORMAT_VERSION, "src": options.src, "tgt": options.tgt, "joint": options.joint,
            "model_type": options.model_type, "vocab_size": vocab, "specials": SPECIALS, "spm": spm_files,
            "options": asdict(options), "splits": info, "fingerprint": fingerprint}
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

    counts, sample = _scan(splits, options)
    with staged_dir(out_dir, DATA_DIR) as staging:
        meta = _build(splits, counts, sample, staging, options, fingerprint)
    train = meta["splits"]["train"]
    print(f"{out_dir}: {train['pairs']} training pairs kept of {train['raw_pairs']} (dropped {train['dropped']}), "
          f"vocabulary {meta['vocab_size']}, splits {list(meta['splits'])}")
    return meta
