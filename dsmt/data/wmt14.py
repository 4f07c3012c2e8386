"""WMT14, the data of "Attention Is All You Need": En-De (Europarl v7, Common Crawl, News Commentary v9: 4.5M
pairs) and En-Fr (those, the UN corpus and the 10^9 French-English corpus: about 40M pairs before filtering),
newstest2013 as the valid set and the full newstest2014 (3003 sentences) as the test set.

The archives are the zip mirrors of statmt.org's files that Hugging Face's ``wmt14`` dataset uses, each
checked against the SHA-256 that dataset lists, whether downloaded or found in ``--raw-dir``. The wanted
files are found in them by name, streamed out (the SGML test set converted to plain lines) and written
as ``train``/``newstest2013``/``newstest2014`` text files in one cache folder, which ``dsmt prepare`` reads.
"""

import gzip
import html
import re
import zipfile
from pathlib import Path

from dsmt import DsmtError
from dsmt.data.corpora import default_cache_dir, download, file_sha256
from dsmt.files import Product, staged_dir

MIRROR = "https://huggingface.co/datasets/wmt/"
ARCHIVES = {  # name: (URL, SHA-256)
    "europarl": (MIRROR + "wmt13/resolve/main-zip/training-parallel-europarl-v7.zip",
                 "5b2d8b32c2396da739b4e731871c597fcc6e75729becd74619d0712eecf7770e"),
    "commoncrawl": (MIRROR + "wmt13/resolve/main-zip/training-parallel-commoncrawl.zip",
                    "5ffe980072ea29adfd84568d099bea366d9f72772b988e670794ae851b4e5627"),
    "news-commentary": (MIRROR + "wmt14/resolve/main-zip/training-parallel-nc-v9.zip",
                        "ce199f93ec56ff480137ba29f0819f9a22e70d88be6d7458f112303d67d623d5"),
    "un": (MIRROR + "wmt13/resolve/main-zip/training-parallel-un.zip",
           "74f07002e053c81bc7f73b4fdab58e7987e831338748f264cbda82a8b062d2e2"),
    "giga-fren": (MIRROR + "wmt10/resolve/main-zip/training-giga-fren.zip",
                  "9439f86523e5dff3f923526dbf6c6929da1786c18dbf64436d2b7564b83aaba3"),
    "dev": (MIRROR + "wmt19/resolve/main-zip/translation-task/dev.zip",
            "d796e363740fdc4261aa6f5a3d2f8223e3adaee7d737b7724863325b8956dfd1"),
}
# The file of each corpus in its archive, for the non-English language X and the file's language L.
TRAINING = {
    "europarl": "europarl-v7.{X}-en.{L}",
    "commoncrawl": "commoncrawl.{X}-en.{L}",
    "news-commentary": "news-commentary-v9.{X}-en.{L}",
    "un": "undoc.2000.{X}-en.{L}",
    "giga-fren": "giga-fren.release2.fixed.{L}.gz",
}
CORPORA = {"de": ["europarl", "commoncrawl", "news-commentary"],
           "fr": ["europarl", "commoncrawl", "news-commentary", "un", "giga-fren"]}
EVALUATION = {"newstest2013": "newstest2013.{L}",  # plain text
              "newstest2014": "newstest2014-{X}en-{side}.{L}.sgm"}  # src in X, ref in English
SPLITS = {"train": "train", "valid": "newstest2013", "newstest2014": "newstest2014"}  # split: file stem
SEGMENT = re.compile(r"<seg[^>]*>(.*)</seg>", re.IGNORECASE)


def _archive(name: str, raw_dir: str | None) -> Path:
    """The archive, from ``raw_dir`` or downloaded into the cache, after its SHA-256 is checked."""
    url, sha256 = ARCHIVES[name]
    filename = url.rsplit("/", 1)[1]
    if raw_dir:
        path = Path(raw_dir) / filename
        if not path.is_file():
            raise DsmtError(f"--raw-dir {raw_dir} has no {filename}; put the WMT14 archives there ({url})")
        found = file_sha256(path)
        if found != sha256:
            raise DsmtError(f"{path}: checksum mismatch (sha256 {found[:16]}..., expected {sha256[:16]}...); "
                            "the file is damaged or another version: download it again")
        return path
    path = default_cache_dir() / "wmt14" / filename
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        download(url, path, sha256, "put the WMT14 archives in a folder and pass it as --raw-dir")
    return path


def _member_lines(archive: Path, filename: str):
    """The lines (bytes) of the zip archive's file named ``filename``, in any folder (a .gz one decompressed)."""
    with zipfile.ZipFile(archive) as bundle:
        names = [n for n in bundle.namelist() if n.rsplit("/", 1)[-1] == filename]
        if not names:
            raise DsmtError(f"{archive} has no file {filename}; it is not the WMT14 archive dsmt expects")
        with bundle.open(names[0]) as member:
            yield from gzip.open(member) if filename.endswith(".gz") else member


def _segments(lines):
    """The text of each ``<seg>`` of a WMT SGML file, one line each."""
    for line in lines:
        if match := SEGMENT.search(line.decode("utf-8")):
            yield (html.unescape(match.group(1)).strip() + "\n").encode("utf-8")


def _write_pair(out: Path, stem: str, sides: dict, append: bool) -> None:
    """Write (or append) ``stem.LANG`` for both languages; the two must have the same number of lines."""
    counts = {}
    for lang, (lines, source) in sides.items():
        with open(out / f"{stem}.{lang}", "ab" if append else "wb") as f:
            counts[lang] = 0
            for line in lines:
                f.write(line if line.endswith(b"\n") else line + b"\n")
                counts[lang] += 1
    if len(set(counts.values())) > 1:
        raise DsmtError(f"{', '.join(source for _, source in sides.values())} have {list(counts.values())} lines; "
                        "a parallel corpus needs one line per line")


def wmt14_prefixes(src: str, tgt: str, raw_dir: str | None) -> dict[str, str]:
    """Split name → file prefix of WMT14 for the pair (English and German or French, either direction)."""
    other = ({src, tgt} - {"en"}).pop() if "en" in (src, tgt) and src != tgt else None
    if other not in CORPORA:
        raise DsmtError(f"WMT14 here is en-de and en-fr (either direction), not {src}-{tgt}")
    folder = default_cache_dir() / f"wmt14_{other}_en"
    texts = Product("WMT14 text written by dsmt prepare wmt14",
                    lambda f: {f"{stem}.{lang}" for stem in SPLITS.values() for lang in ("en", other)})
    if not all((folder / f"{stem}.{lang}").is_file() for stem in SPLITS.values() for lang in ("en", other)):
        with staged_dir(folder, texts, "the WMT14 cache folder") as staging:
            _extract(other, raw_dir, staging)
    return {split: str(folder / stem) for split, stem in SPLITS.items()}


def _extract(other: str, raw_dir: str | None, out: Path) -> None:
    langs = ("en", other)
    for number, corpus in enumerate(CORPORA[other]):
        archive = _archive(corpus, raw_dir)
        files = {lang: TRAINING[corpus].format(X=other, L=lang) for lang in langs}
        _write_pair(out, "train", {lang: (_member_lines(archive, f), f"{archive.name}:{f}") for lang, f in files.items()},
                    append=number > 0)
    dev = _archive("dev", raw_dir)
    _write_pair(out, "newstest2013", {lang: (_member_lines(dev, EVALUATION["newstest2013"].format(L=lang)),
                                             f"{dev.name}:newstest2013.{lang}") for lang in langs}, append=False)
    sgml = {lang: EVALUATION["newstest2014"].format(X=other, side="ref" if lang == "en" else "src", L=lang)
            for lang in langs}
    _write_pair(out, "newstest2014", {lang: (_segments(_member_lines(dev, f)), f"{dev.name}:{f}")
                                      for lang, f in sgml.items()}, append=False)
