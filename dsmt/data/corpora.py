"""Reading parallel text, and the built-in corpora: Multi30k (local folder or verified download) and a toy set."""

import gzip
import hashlib
import itertools
import os
import random
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

from dsmt import DsmtError


def text_file(prefix: str, lang: str) -> Path:
    """``PREFIX.LANG``, or ``PREFIX.LANG.gz`` when only that exists."""
    for candidate in (Path(f"{prefix}.{lang}"), Path(f"{prefix}.{lang}.gz")):
        if candidate.is_file():
            return candidate
    raise DsmtError(f"{prefix}.{lang} not found (nor {prefix}.{lang}.gz); check the prefix and --src/--tgt")


def decode_line(raw: bytes, name, number: int) -> str:
    """One line as text, or an error naming it if it is not UTF-8. A UTF-8 byte-order mark (some Windows
    editors write one) is not text: it is dropped from a file's first line."""
    try:
        return raw.decode("utf-8-sig" if number == 1 else "utf-8").rstrip("\r\n")
    except UnicodeDecodeError as e:
        raise DsmtError(f"{name}:{number}: not valid UTF-8 ({e.reason} at byte {e.start}); "
                        "re-encode the file as UTF-8") from None


def decode_lines(stream, name) -> list[str]:
    """The lines of a binary stream as text (see ``decode_line``)."""
    return [decode_line(raw, name, number) for number, raw in enumerate(stream, 1)]


def open_binary(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def read_pairs(prefix: str, src: str, tgt: str) -> Iterator[tuple[str, str]]:
    """Source and target lines of ``PREFIX.SRC``/``PREFIX.TGT`` (plain or .gz), one pair at a time; memory holds
    one line. Unequal line counts are an error once the shorter file ends."""
    paths = [text_file(prefix, src), text_file(prefix, tgt)]
    with open_binary(paths[0]) as source, open_binary(paths[1]) as target:
        for number, (raw_src, raw_tgt) in enumerate(itertools.zip_longest(source, target), 1):
            if raw_src is None or raw_tgt is None:
                rest = 1 + sum(1 for _ in (target if raw_src is None else source))
                counts = [number - 1 + rest * (raw is not None) for raw in (raw_src, raw_tgt)]
                raise DsmtError(f"{paths[0]} has {counts[0]} lines but {paths[1]} has {counts[1]}; "
                                "a parallel corpus needs exactly one target line per source line")
            yield decode_line(raw_src, paths[0], number), decode_line(raw_tgt, paths[1], number)


# ---- Multi30k Task 1 ------------------------------------------------------------------------------

MULTI30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/"
MULTI30K_SPLITS = {"train": "train", "valid": "val", "test2016": "test_2016_flickr"}
MULTI30K_SHA256 = {
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
}
DEFAULT_MULTI30K_DIR = Path("../shared/data/multi30k")


def default_cache_dir() -> Path:
    return Path(os.environ.get("DSMT_CACHE", Path.home() / ".cache" / "dsmt"))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def download(url: str, dest: Path, sha256: str, instead: str) -> None:
    """Fetch ``url`` into ``dest`` only if its SHA-256 matches; a partial or corrupt file never lands at ``dest``.
    ``instead`` says what to do when there is no network."""
    part = dest.with_name(dest.name + ".part")
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(part, "wb") as out:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except (urllib.error.URLError, OSError) as e:
        part.unlink(missing_ok=True)
        raise DsmtError(f"cannot download {url}: {getattr(e, 'reason', e)}; {instead}") from None
    if digest.hexdigest() != sha256:
        part.unlink()
        raise DsmtError(f"{url}: checksum mismatch (sha256 {digest.hexdigest()[:16]}..., expected "
                        f"{sha256[:16]}...); the file is corrupt or changed upstream, and was not kept")
    os.replace(part, dest)


def multi30k_prefixes(src: str, tgt: str, raw_dir: str | None, url: str | None) -> dict[str, str]:
    """Split name → file prefix of Multi30k, from ``raw_dir`` (default: the shared copy, when present), else
    downloaded with checksum verification into the cache folder."""
    for lang in (src, tgt):
        if f"train.{lang}.gz" not in MULTI30K_SHA256:
            raise DsmtError(f"Multi30k Task 1 has no language {lang!r} here; use --src/--tgt from en, de")
    if raw_dir:
        folder = Path(raw_dir)
        if not folder.is_dir():
            raise DsmtError(f"--raw-dir {folder} is not a folder")
    elif url is None and (DEFAULT_MULTI30K_DIR / "train.en.gz").is_file():
        folder = DEFAULT_MULTI30K_DIR
    else:
        folder = default_cache_dir() / "multi30k"
        folder.mkdir(parents=True, exist_ok=True)
        for name in (f"{stem}.{lang}.gz" for stem in MULTI30K_SPLITS.values() for lang in (src, tgt)):
            if not (folder / name).is_file():
                download((url or MULTI30K_URL) + name, folder / name, MULTI30K_SHA256[name],
                         "pass --raw-dir with local copies of the Multi30k raw files")
    return {split: str(folder / stem) for split, stem in MULTI30K_SPLITS.items()}


# ---- The toy corpus --------------------------------------------------------------------------------
# Generated sentences "We buy three hundred twenty-one red apples in the park." → German, with verb
# agreement, compound number words whose parts are reordered (einundzwanzig = one-and-twenty) and
# plural forms: enough structure to need attention, small enough to learn in a few CPU minutes.

EN_ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen " \
          "sixteen seventeen eighteen nineteen".split()
EN_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
DE_ONES = "null eins zwei drei vier fünf sechs sieben acht neun zehn elf zwölf dreizehn vierzehn fünfzehn " \
          "sechzehn siebzehn achtzehn neunzehn".split()
DE_TENS = "_ _ zwanzig dreißig vierzig fünfzig sechzig siebzig achtzig neunzig".split()
SUBJECTS = [("I", "ich", 0), ("you", "du", 1), ("he", "er", 2), ("she", "sie", 2), ("we", "wir", 3),
            ("they", "sie", 3)]
VERBS = [("have", "has", "habe hast hat haben"), ("see", "sees", "sehe siehst sieht sehen"),
         ("buy", "buys", "kaufe kaufst kauft kaufen"), ("need", "needs", "brauche brauchst braucht brauchen"),
         ("count", "counts", "zähle zählst zählt zählen"), ("paint", "paints", "male malst malt malen")]
ADJECTIVES = [("red", "rote"), ("blue", "blaue"), ("green", "grüne"), ("small", "kleine"), ("big", "große"),
              ("old", "alte"), ("new", "neue"), ("yellow", "gelbe"), ("black", "schwarze"), ("white", "weiße")]
NOUNS = [("apples", "Äpfel"), ("books", "Bücher"), ("cars", "Autos"), ("dogs", "Hunde"), ("cats", "Katzen"),
         ("houses", "Häuser"), ("birds", "Vögel"), ("chairs", "Stühle"), ("flowers", "Blumen"),
         ("trees", "Bäume"), ("boats", "Boote"), ("cups", "Tassen")]
PLACES = [("", ""), (" in the garden", " im Garten"), (" in the kitchen", " in der Küche"),
          (" in the park", " im Park"), (" in the city", " in der Stadt"), (" at school", " in der Schule")]


def english_number(n: int) -> str:
    if n < 20:
        return EN_ONES[n]
    if n < 100:
        return EN_TENS[n // 10] + (f"-{EN_ONES[n % 10]}" if n % 10 else "")
    return f"{EN_ONES[n // 100]} hundred" + (f" {english_number(n % 100)}" if n % 100 else "")


def german_number(n: int) -> str:
    if n < 20:
        return DE_ONES[n]
    if n < 100:
        unit = "ein" if n % 10 == 1 else DE_ONES[n % 10]
        return (f"{unit}und" if n % 10 else "") + DE_TENS[n // 10]
    hundreds = "ein" if n // 100 == 1 else DE_ONES[n // 100]
    return f"{hundreds}hundert" + (german_number(n % 100) if n % 100 else "")


def toy_pair(rng: random.Random) -> tuple[str, str]:
    subject_en, subject_de, person = rng.choice(SUBJECTS)
    base, third, forms = rng.choice(VERBS)
    verb_en = third if subject_en in ("he", "she") else base
    verb_de = forms.split()[person]
    number = rng.randint(2, 999)
    adjective, noun, place = rng.choice(ADJECTIVES), rng.choice(NOUNS), rng.choice(PLACES)
    en = f"{subject_en} {verb_en} {english_number(number)} {adjective[0]} {noun[0]}{place[0]}."
    de = f"{subject_de} {verb_de} {german_number(number)} {adjective[1]} {noun[1]}{place[1]}."
    return en[0].upper() + en[1:], de[0].upper() + de[1:]


TOY_SPLITS = {"train": 20000, "valid": 500, "test": 500}


def write_toy_corpus(folder: Path, seed: int = 1) -> dict[str, str]:
    """Write disjoint train/valid/test splits of the toy En→De corpus; returns split → file prefix."""
    rng, seen, prefixes = random.Random(seed), set(), {}
    for split, size in TOY_SPLITS.items():
        pairs = []
        while len(pairs) < size:
            pair = toy_pair(rng)
            if pair not in seen:
                seen.add(pair)
                pairs.append(pair)
        prefixes[split] = str(folder / split)
        for lang, column in (("en", 0), ("de", 1)):
            Path(f"{prefixes[split]}.{lang}").write_text("".join(p[column] + "\n" for p in pairs))
    return prefixes
