import functools
import gzip
import http.server
import json
import shutil
import subprocess
import threading
import unicodedata
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from dsmt import DsmtError
from dsmt.data import corpora
from dsmt.data.batching import (Ahead, BatchStream, ParallelData, Prefetcher, StreamClosed, epoch_batches, shard,
                                 token_batches)
from dsmt.data.corpora import MULTI30K_SPLITS, download, multi30k_prefixes
from dsmt.data.prepare import PrepareOptions, prepare
from tests.conftest import MULTI30K, PYTHON, REPO, run_env


@pytest.fixture(scope="module")
def multi30k_data(tmp_path_factory):
    if not (MULTI30K / "train.en.gz").exists():
        pytest.skip(f"Multi30k raw files not found in {MULTI30K}")
    out = tmp_path_factory.mktemp("data") / "multi30k"
    prepare(multi30k_prefixes("en", "de", str(MULTI30K), None), str(out), PrepareOptions("en", "de"))
    return out


def dsmt(*args, cwd=None):
    return subprocess.run([PYTHON, "-m", "dsmt.cli", *args], capture_output=True, text=True, env=run_env(), cwd=cwd)


def padding_fraction(data, batches):
    real = sum(int(data.src_lens[b].sum() + data.tgt_lens[b].sum()) for b in batches)
    padded = sum(len(b) * int(data.src_lens[b].max() + data.tgt_lens[b].max()) for b in batches)
    return 1 - real / padded


# ---- batching --------------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_ranks_cover_every_pair_once_with_equal_counts(multi30k_data, world_size):
    data = ParallelData(str(multi30k_data), "train")
    streams = [BatchStream(data, 2000, seed=3, rank=r, world_size=world_size) for r in range(world_size)]
    per_rank = [s.batches(epoch=0) for s in streams]
    assert len({len(b) for b in per_rank}) == 1  # no rank waits on a collective another never joins
    seen = Counter(int(i) for batches in per_rank for b in batches for i in b)
    assert set(seen) == set(range(len(data)))
    # Only the batches repeated to even out the count are seen twice: the first (-N % world) of the epoch.
    all_batches = epoch_batches(data.src_lens, data.tgt_lens, 2000, seed=3, epoch=0)
    repeated = Counter(int(i) for b in all_batches[: -len(all_batches) % world_size] for i in b)
    assert {i: n - 1 for i, n in seen.items() if n > 1} == dict(repeated)


def test_batches_respect_max_tokens_and_bucketing_saves_padding(multi30k_data):
    data = ParallelData(str(multi30k_data), "train")
    batches = epoch_batches(data.src_lens, data.tgt_lens, 4096, seed=1, epoch=0)
    for b in batches:
        assert len(b) * data.src_lens[b].max() <= 4096 and len(b) * data.tgt_lens[b].max() <= 4096
    random_order = np.random.default_rng(0).permutation(len(data))
    random_batches = token_batches(data.src_lens, data.tgt_lens, 4096, random_order)
    bucketed, unsorted = padding_fraction(data, batches), padding_fraction(data, random_batches)
    print(f"padding on Multi30k train at 4096 tokens: bucketed {bucketed:.1%}, random {unsorted:.1%}")
    assert bucketed < 0.10 < unsorted


def test_prefetcher_yields_the_streams_batches_and_states_and_passes_errors_on(multi30k_data):
    data = ParallelData(str(multi30k_data), "train")
    plain = BatchStream(data, 4096, seed=2, rank=1, world_size=3)
    expected = []
    for _ in range(150):  # crosses into the second epoch
        expected.append((next(plain)["indices"], plain.state_dict()))
    ahead = Prefetcher(BatchStream(data, 4096, seed=2, rank=1, world_size=3), lambda b: b["indices"], depth=4)
    got = [next(ahead) for _ in range(150)]
    ahead.close()
    assert not ahead.thread.is_alive()
    assert all(np.array_equal(a, b) and sa == sb for (a, sa), (b, sb) in zip(got, expected))

    def broken(batch):
        raise ValueError("bad batch")
    failing = Prefetcher(BatchStream(data, 4096, seed=2), broken, depth=2)
    with pytest.raises(ValueError, match="bad batch"):
        next(failing)
    failing.close()


def test_ahead_makes_at_most_depth_items_before_they_are_taken_and_ends_with_its_items():
    made, each_made = [], threading.Semaphore(0)

    def items():
        for item in range(5):
            made.append(item)
            each_made.release()
            yield item
    ahead = Ahead(items(), depth=2, name="test-ahead")
    for _ in range(2):
        assert each_made.acquire(timeout=10)
    assert not each_made.acquire(timeout=0.5) and made == [0, 1]  # the bound holds while nothing is taken
    assert next(ahead) == 0
    assert each_made.acquire(timeout=10) and made == [0, 1, 2]  # taking one frees room for one more
    assert [next(ahead) for _ in range(4)] == [1, 2, 3, 4]
    for _ in range(2):  # the end of the items ends the iteration, on every later take too
        with pytest.raises(StopIteration):
            next(ahead)
    ahead.close()
    assert not ahead.thread.is_alive()

    closed = Ahead(iter(range(100)), depth=1, name="test-ahead-closed")
    assert next(closed) == 0
    closed.close()
    assert not closed.thread.is_alive()
    taken = []  # at most the one item made before the close, then an error, not a hang
    with pytest.raises(StreamClosed):
        while True:
            taken.append(next(closed))
    assert taken in ([], [1])


def test_collate_shapes_and_specials(multi30k_data):
    data = ParallelData(str(multi30k_data), "valid")
    batch = data.collate([0, 5, 9])
    src, tgt_in, tgt_out = batch["src"], batch["tgt_in"], batch["tgt_out"]
    assert src.shape[0] == tgt_in.shape[0] == 3 and tgt_in.shape == tgt_out.shape
    assert (tgt_in[:, 0] == data.bos).all()
    assert ((src == data.eos).sum(1) == 1).all() and ((tgt_out == data.eos).sum(1) == 1).all()
    # Teacher forcing: the decoder input is the output shifted right by one.
    assert (tgt_in[:, 1:][tgt_out[:, :-1] != data.eos] == tgt_out[:, :-1][tgt_out[:, :-1] != data.eos]).all()
    assert int((src != data.pad).sum()) == int(data.src_lens[[0, 5, 9]].sum())


def test_same_seed_same_batches_new_epoch_new_order(multi30k_data):
    data = ParallelData(str(multi30k_data), "train")
    first = BatchStream(data, 3000, seed=7, rank=1, world_size=2).batches(0)
    again = BatchStream(data, 3000, seed=7, rank=1, world_size=2).batches(0)
    assert all(np.array_equal(a, b) for a, b in zip(first, again)) and len(first) == len(again)
    next_epoch = BatchStream(data, 3000, seed=7, rank=1, world_size=2).batches(1)
    assert not all(np.array_equal(a, b) for a, b in zip(first, next_epoch))
    other_seed = BatchStream(data, 3000, seed=8, rank=1, world_size=2).batches(0)
    assert not all(np.array_equal(a, b) for a, b in zip(first, other_seed))


def test_resume_mid_epoch_yields_exactly_the_rest(multi30k_data):
    data = ParallelData(str(multi30k_data), "train")
    straight = BatchStream(data, 4096, seed=2, rank=0, world_size=2)
    expected = [next(straight)["indices"] for _ in range(120)]  # crosses into the second epoch
    interrupted = BatchStream(data, 4096, seed=2, rank=0, world_size=2)
    for _ in range(50):
        next(interrupted)
    resumed = BatchStream(data, 4096, seed=2, rank=0, world_size=2)
    resumed.load_state_dict(interrupted.state_dict())
    rest = [next(resumed)["indices"] for _ in range(70)]
    assert all(np.array_equal(a, b) for a, b in zip(expected[50:], rest))
    assert resumed.state_dict()["epoch"] == 1


def test_building_an_epoch_is_fast(multi30k_data):
    import time

    data = ParallelData(str(multi30k_data), "train")
    start = time.perf_counter()
    epoch_batches(data.src_lens, data.tgt_lens, 4096, seed=1, epoch=0)
    assert time.perf_counter() - start < 1.0
    assert isinstance(data.src_ids, np.memmap)


def test_shard_pads_to_equal_counts():
    batches = [np.array([i]) for i in range(7)]
    shards = [shard(batches, r, 3) for r in range(3)]
    assert [len(s) for s in shards] == [3, 3, 3]
    assert sorted(int(b[0]) for s in shards for b in s) == [0, 0, 1, 1, 2, 3, 4, 5, 6]


# ---- prepare ---------------------------------------------------------------------------------------

def test_round_trip_of_the_test_split(multi30k_data):
    data = ParallelData(str(multi30k_data), "test2016")
    sp = spm.SentencePieceProcessor(model_file=str(multi30k_data / "spm.model"))
    raw = (multi30k_data / "test2016.de.txt").read_text().splitlines()
    assert len(raw) == len(data) == 1000
    exact = 0
    for i, line in enumerate(raw):
        decoded = sp.decode(data.tgt_ids[data.tgt_offsets[i]:data.tgt_offsets[i + 1]].tolist())
        exact += decoded == line
        # sentencepiece applies NFKC and folds runs of white space
        assert decoded == " ".join(unicodedata.normalize("NFKC", line).split())
    assert exact >= 990


def test_meta_records_counts_and_specials(multi30k_data):
    import json

    meta = json.loads((multi30k_data / "meta.json").read_text())
    assert meta["specials"] == {"pad": 0, "unk": 1, "bos": 2, "eos": 3}
    assert meta["splits"]["valid"]["pairs"] == 1014 and meta["splits"]["test2016"]["pairs"] == 1000
    train = meta["splits"]["train"]
    assert train["pairs"] + sum(train["dropped"].values()) == 29000
    assert train["tokens"]["en"] == int(np.load(multi30k_data / "train.en.ids.npy").size)
    assert meta["vocab_size"] == {"en": 8000, "de": 8000} and len(meta["fingerprint"]) == 64


def write_pairs(folder: Path, name: str, src_lines, tgt_lines, gz=False):
    for lang, lines in (("en", src_lines), ("de", tgt_lines)):
        data = "".join(line + "\n" for line in lines).encode()
        if gz:
            (folder / f"{name}.{lang}.gz").write_bytes(gzip.compress(data))
        else:
            (folder / f"{name}.{lang}").write_bytes(data)
    return str(folder / name)


SMALL_EN = [f"the {w} number {i} is here" for i, w in enumerate(["red", "blue", "green", "old", "new"] * 20)]
SMALL_DE = [f"die {w} Nummer {i} ist hier" for i, w in enumerate(["rote", "blaue", "grüne", "alte", "neue"] * 20)]


def small_corpus(folder: Path):
    return {"train": write_pairs(folder, "train", SMALL_EN, SMALL_DE, gz=True),
            "valid": write_pairs(folder, "valid", SMALL_EN[:5], SMALL_DE[:5])}


def test_reuse_and_rebuild_on_changed_input(tmp_path):
    splits, out = small_corpus(tmp_path), tmp_path / "out"
    options = PrepareOptions("en", "de", vocab_size=50)
    first = prepare(splits, str(out), options)
    stamp = (out / "meta.json").stat().st_mtime_ns
    assert prepare(splits, str(out), options) == first and (out / "meta.json").stat().st_mtime_ns == stamp
    write_pairs(tmp_path, "valid", SMALL_EN[:6], SMALL_DE[:6])
    assert prepare(splits, str(out), options)["splits"]["valid"]["pairs"] == 6
    assert prepare(splits, str(out), PrepareOptions("en", "de", vocab_size=45))["vocab_size"]["en"] == 45


def test_filters_count_what_they_drop(tmp_path):
    src = SMALL_EN + ["", "the", " ".join(["the red number is here"] * 20)]
    tgt = SMALL_DE + ["die Nummer", "die rote Nummer ist hier die blaue Nummer ist hier", "die"]
    splits = {"train": write_pairs(tmp_path, "train", src, tgt), "valid": write_pairs(tmp_path, "v", src[:3], tgt[:3])}
    meta = prepare(splits, str(tmp_path / "out"), PrepareOptions("en", "de", vocab_size=50, max_len=60))
    assert meta["splits"]["train"]["dropped"] == {"empty": 1, "too_long": 1, "length_ratio": 1}
    assert meta["splits"]["train"]["pairs"] == 100


def cli_prepare(tmp_path, splits, *extra):
    return dsmt("prepare", "--train", splits["train"], "--valid", splits["valid"], "--out", str(tmp_path / "out"),
                *extra)


@pytest.mark.parametrize("damage, words", [
    ("count", ["train.en", "100 lines", "99"]),
    ("bytes", ["train.de:7", "UTF-8"]),
    ("missing", ["valid.de", "not found"]),
    ("vocab", ["--vocab-size 5000", "or less"]),
    ("all_filtered", ["no training pair is left"]),
])
def test_bad_inputs_fail_clearly_and_leave_nothing(tmp_path, damage, words):
    splits = {"train": write_pairs(tmp_path, "train", SMALL_EN, SMALL_DE),
              "valid": write_pairs(tmp_path, "valid", SMALL_EN[:5], SMALL_DE[:5])}
    extra = ["--vocab-size", "50"]
    if damage == "count":
        write_pairs(tmp_path, "train", SMALL_EN, SMALL_DE[:-1])
    elif damage == "bytes":
        lines = [line.encode() for line in SMALL_DE]
        lines[6] = b"die \xff\xfe kaputt"
        (tmp_path / "train.de").write_bytes(b"\n".join(lines) + b"\n")
    elif damage == "missing":
        (tmp_path / "valid.de").unlink()
    elif damage == "vocab":
        extra = ["--vocab-size", "5000"]
    elif damage == "all_filtered":
        extra += ["--max-len", "2"]
    result = cli_prepare(tmp_path, splits, *extra)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    for word in words:
        assert word in result.stderr
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.*"))  # no staging folder left behind


def test_failed_rebuild_keeps_the_previous_dataset(tmp_path):
    splits = small_corpus(tmp_path)
    assert cli_prepare(tmp_path, splits, "--vocab-size", "50").returncode == 0
    before = (tmp_path / "out" / "meta.json").read_text()
    assert cli_prepare(tmp_path, splits, "--vocab-size", "5000").returncode == 2
    assert (tmp_path / "out" / "meta.json").read_text() == before


def test_refuses_to_overwrite_a_foreign_folder(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    result = cli_prepare(tmp_path, small_corpus(tmp_path), "--vocab-size", "50")
    assert result.returncode == 2 and "is not a data directory written by dsmt prepare" in result.stderr
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_separate_vocabularies_and_bpe(tmp_path):
    meta = prepare(small_corpus(tmp_path), str(tmp_path / "out"),
                   PrepareOptions("en", "de", vocab_size=40, joint=False, model_type="bpe"))
    assert meta["spm"] == {"en": "spm.en.model", "de": "spm.de.model"}
    assert (tmp_path / "out" / "spm.en.model").is_file() and (tmp_path / "out" / "spm.de.model").is_file()


def test_toy_corpus_recipe(tmp_path):
    result = dsmt("prepare", "toy", "--out", str(tmp_path / "toy"))
    assert result.returncode == 0, result.stderr
    data = ParallelData(str(tmp_path / "toy"), "train")
    assert len(data) == 20000 and ParallelData(str(tmp_path / "toy"), "test").meta["splits"]["test"]["pairs"] == 500
    train = set((tmp_path / "toy" / "valid.en.txt").read_text().splitlines())
    assert not train & set((tmp_path / "toy" / "test.en.txt").read_text().splitlines())


# ---- Multi30k download ------------------------------------------------------------------------------

@pytest.fixture
def file_server(tmp_path):
    """An HTTP server on 127.0.0.1 serving ``tmp_path/served``."""
    served = tmp_path / "served"
    served.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield served, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


def test_multi30k_download_verifies_checksums(tmp_path, file_server, monkeypatch):
    if not (MULTI30K / "train.en.gz").exists():
        pytest.skip("Multi30k raw files not found")
    served, url = file_server
    for stem in MULTI30K_SPLITS.values():
        for lang in ("en", "de"):
            shutil.copy(MULTI30K / f"{stem}.{lang}.gz", served)
    monkeypatch.setenv("DSMT_CACHE", str(tmp_path / "cache"))
    prefixes = multi30k_prefixes("en", "de", None, url)
    cached = tmp_path / "cache" / "multi30k"
    assert prefixes["train"] == str(cached / "train")
    assert (cached / "val.de.gz").read_bytes() == (MULTI30K / "val.de.gz").read_bytes()
    assert not list(cached.glob("*.part"))


def test_corrupt_download_is_refused_and_not_kept(tmp_path, file_server):
    served, url = file_server
    (served / "val.de.gz").write_bytes(b"not the real file")
    dest = tmp_path / "val.de.gz"
    with pytest.raises(DsmtError, match="checksum mismatch"):
        download(url + "val.de.gz", dest, corpora.MULTI30K_SHA256["val.de.gz"], "use --raw-dir")
    assert not dest.exists() and not list(tmp_path.glob("*.part"))
    with pytest.raises(DsmtError, match="cannot download"):
        download(url + "missing.gz", dest, corpora.MULTI30K_SHA256["val.de.gz"], "use --raw-dir")
    assert not dest.exists()


def test_multi30k_from_local_folder_cli(tmp_path):
    if not (MULTI30K / "train.en.gz").exists():
        pytest.skip("Multi30k raw files not found")
    result = dsmt("prepare", "multi30k", "--src", "de", "--tgt", "en", "--raw-dir", str(MULTI30K),
                  "--vocab-size", "4000", "--out", str(tmp_path / "de_en"))
    assert result.returncode == 0, result.stderr
    assert ParallelData(str(tmp_path / "de_en"), "test2016").meta["src"] == "de"


def test_byte_order_mark_is_not_text():
    from dsmt.data.corpora import decode_lines

    assert decode_lines([b"\xef\xbb\xbfEin Hund.\n", b"\xef\xbb\xbfzwei\n"], "x") == ["Ein Hund.", "\ufeffzwei"]


def test_staging_folders_of_dead_processes_are_removed_and_others_kept(tmp_path):
    import socket
    import subprocess

    from dsmt.files import Product, staged_dir

    host = socket.gethostname()
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead, running, elsewhere = (tmp_path / f".out.tmp-{host}-{finished.pid}", tmp_path / f".out.old-{host}-1",
                                tmp_path / ".out.tmp-otherhost-12")
    for folder in (dead, running, elsewhere):
        folder.mkdir()
        (folder / "part").write_text("x")
    with staged_dir(tmp_path / "out", Product("a test output", lambda folder: None)) as staging:
        (staging / "done").write_text("y")
    assert (tmp_path / "out" / "done").is_file()
    assert not dead.exists() and running.exists() and elsewhere.exists()  # pid 1 lives; another host's is not ours


# ---- streaming at scale ---------------------------------------------------------------------------------

def test_token_batches_equal_a_per_sentence_greedy_loop():
    """The numpy cut gives exactly the batches of the loop it replaced (one step per sentence)."""
    def per_sentence(src_lens, tgt_lens, max_tokens, order):
        batches, start, widest = [], 0, 0
        for end, i in enumerate(order):
            width = max(widest, src_lens[i], tgt_lens[i])
            if width * (end - start + 1) > max_tokens:
                batches.append(order[start:end])
                start, width = end, max(src_lens[i], tgt_lens[i])
            widest = width
        return batches + [order[start:]]

    rng = np.random.default_rng(0)
    for size, max_tokens in ((1, 64), (1000, 64), (20000, 300), (50000, 4096)):
        src, tgt = rng.integers(2, 60, size), rng.integers(2, 60, size)
        order = np.lexsort((rng.random(size), tgt, src))
        expected, found = per_sentence(src, tgt, max_tokens, order), token_batches(src, tgt, max_tokens, order)
        assert len(found) == len(expected) and all(np.array_equal(a, b) for a, b in zip(found, expected))


def reference_binarize(prefix: str, sp, options: PrepareOptions, train: bool) -> dict:
    """What the in-memory prepare did: whole files read, encoded at once, training pairs filtered."""
    sides = [Path(f"{prefix}.{lang}.gz").read_bytes() if Path(f"{prefix}.{lang}.gz").exists()
             else Path(f"{prefix}.{lang}").read_bytes() for lang in (options.src, options.tgt)]
    sides = [(gzip.decompress(b) if b[:2] == b"\x1f\x8b" else b).decode("utf-8-sig").splitlines() for b in sides]
    ids = [sp.encode(lines) for lines in sides]
    keep = [True] * len(sides[0])
    if train:
        for i, (s, t, a, b) in enumerate(zip(*sides, *ids)):
            long, short = max(len(a), len(b)), max(min(len(a), len(b)), 1)
            keep[i] = bool(s.strip() and t.strip()) and long <= options.max_len and long / short <= options.max_ratio
    arrays = {}
    for lang, lang_ids in zip((options.src, options.tgt), ids):
        kept = [x for x, k in zip(lang_ids, keep) if k]
        arrays[lang] = (np.array([t for x in kept for t in x], dtype=np.uint16),
                        np.concatenate([[0], np.cumsum([len(x) for x in kept])]).astype(np.int64))
    return {"arrays": arrays, "pairs": sum(keep), "raw_pairs": len(keep)}


def test_streaming_prepare_equals_the_in_memory_reference(multi30k_dir, tmp_path, monkeypatch):
    """Multi30k, streamed in chunks smaller than a split: every ids and offsets array, every count, and the
    sentencepiece input (all training sentences, source then target, when they fit the sample) are those of
    reading everything at once. Sentencepiece's own training is not bitwise repeatable, so both sides encode
    with the model this run trained."""
    import dsmt.data.prepare as prepare_module

    monkeypatch.setattr(prepare_module, "CHUNK_PAIRS", 7000)
    seen = []
    train_spm = prepare_module._train_sentencepiece
    monkeypatch.setattr(prepare_module, "_train_sentencepiece", lambda lines, *a: seen.append(lines) or train_spm(lines, *a))
    splits = multi30k_prefixes("en", "de", str(multi30k_dir), None)
    options = PrepareOptions("en", "de")
    meta = prepare(splits, str(tmp_path / "out"), options)
    sides = [gzip.open(f"{splits['train']}.{lang}.gz", "rt", encoding="utf-8").read().splitlines() for lang in ("en", "de")]
    assert seen == [sides[0] + sides[1]] and len(sides[0]) == 29000
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "out" / "spm.model"))
    for name, prefix in splits.items():
        expected = reference_binarize(prefix, sp, options, train=name == "train")
        assert meta["splits"][name]["pairs"] == expected["pairs"]
        assert meta["splits"][name]["raw_pairs"] == expected["raw_pairs"]
        for lang, (ids, offsets) in expected["arrays"].items():
            assert np.array_equal(np.load(tmp_path / "out" / f"{name}.{lang}.ids.npy"), ids), (name, lang)
            assert np.array_equal(np.load(tmp_path / "out" / f"{name}.{lang}.offsets.npy"), offsets), (name, lang)
            assert meta["splits"][name]["tokens"][lang] == len(ids)


def test_sentencepiece_learns_from_a_sample_of_the_requested_size(tmp_path, monkeypatch):
    import dsmt.data.prepare as prepare_module

    seen = []
    train_spm = prepare_module._train_sentencepiece
    monkeypatch.setattr(prepare_module, "_train_sentencepiece", lambda lines, *a: seen.append(lines) or train_spm(lines, *a))
    meta = prepare(small_corpus(tmp_path), str(tmp_path / "out"), PrepareOptions("en", "de", vocab_size=50, spm_sample=30))
    assert len(seen[0]) == 60 and set(seen[0][:30]) <= set(SMALL_EN) and set(seen[0][30:]) <= set(SMALL_DE)
    assert len(set(seen[0][:30])) == 30 and meta["splits"]["train"]["pairs"] == 100  # a sample; all encoded
    assert "--spm-sample 0: must be at least 1" in cli_prepare(tmp_path, small_corpus(tmp_path), "--spm-sample", "0").stderr


@pytest.fixture(scope="module")
def scale_table(tmp_path_factory):
    """benchmarks/prepare_scale.py on 100k and 400k generated pairs (prepare only)."""
    if not (MULTI30K / "train.en.gz").exists():
        pytest.skip(f"Multi30k raw files not found in {MULTI30K}")
    work = tmp_path_factory.mktemp("scale")
    result = subprocess.run([PYTHON, "benchmarks/prepare_scale.py", "--pairs", "100000,400000", "--vocab-size", "2000",
                             "--spm-sample", "20000", "--train-steps", "0", "--work", str(work)], cwd=REPO,
                            env=run_env(), capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.strip("|").split("|") for line in result.stdout.splitlines() if line.startswith("| 1") or line.startswith("| 4")]
    return work, {int(r[0].replace(",", "")): (float(r[1]), float(r[3].replace(",", ""))) for r in rows}


@pytest.mark.slow
def test_prepare_memory_does_not_grow_with_the_corpus(scale_table):
    work, table = scale_table
    (_, small), (_, large) = table[100_000], table[400_000]
    assert large < 1.2 * small, table  # 4x the pairs, not 4x the memory
    meta = json.loads((work / "data_400000" / "meta.json").read_text())
    assert meta["splits"]["train"]["raw_pairs"] == 400_000


@pytest.mark.slow
def test_prepare_killed_mid_encoding_leaves_nothing_that_looks_complete_and_reruns(scale_table, tmp_path):
    import signal
    import time

    work, _ = scale_table
    corpus, out = work / "corpus_400000", tmp_path / "out"
    command = [PYTHON, "-m", "dsmt.cli", "prepare", "--train", str(corpus / "train"), "--valid", str(corpus / "valid"),
               "--vocab-size", "2000", "--spm-sample", "20000", "--out", str(out)]
    job = subprocess.Popen(command, cwd=REPO, env=run_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while not any(p.stat().st_size > 1 << 20 for p in tmp_path.glob(".out.tmp-*/train.en.ids.raw")):
        assert job.poll() is None and time.time() < deadline, "prepare ended before it was killed"
        time.sleep(0.1)
    job.send_signal(signal.SIGKILL)
    job.wait()
    assert not out.exists() and list(tmp_path.glob(".out.tmp-*"))  # the staging folder, never the target
    rerun = subprocess.run(command, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert json.loads((out / "meta.json").read_text())["splits"]["train"]["raw_pairs"] == 400_000
    assert not list(tmp_path.glob(".out.tmp-*"))  # the dead run's staging folder is gone


# ---- WMT14 -------------------------------------------------------------------------------------------------

def wmt14_archives(folder: Path, pairs: dict, damage: str = "") -> dict:
    """Small zip archives with the layout of the WMT14 mirrors (en-de); returns name → (URL, SHA-256) for them.
    ``pairs``: corpus name → list of (en, de) lines."""
    from dsmt.data import wmt14

    folder.mkdir(parents=True, exist_ok=True)
    members = {
        "europarl": {f"training/europarl-v7.de-en.{lang}": side for lang, side in (("en", 0), ("de", 1))},
        "commoncrawl": {f"commoncrawl.de-en.{lang}": side for lang, side in (("en", 0), ("de", 1))},
        "news-commentary": {f"training/news-commentary-v9.de-en.{lang}": side for lang, side in (("en", 0), ("de", 1))},
    }
    archives = {}
    for name, files in members.items():
        with zipfile.ZipFile(folder / wmt14.ARCHIVES[name][0].rsplit("/", 1)[1], "w") as bundle:
            for member, side in files.items():
                lines = [pair[side] for pair in pairs[name]]
                if damage == "uneven" and name == "commoncrawl" and side == 1:
                    lines = lines[:-1]
                if not (damage == "missing" and name == "commoncrawl" and side == 1):
                    bundle.writestr(member, "".join(line + "\n" for line in lines))
    with zipfile.ZipFile(folder / "dev.zip", "w") as bundle:
        for lang, side in (("en", 0), ("de", 1)):
            bundle.writestr(f"dev/newstest2013.{lang}", "".join(p[side] + "\n" for p in pairs["valid"]))
            segments = "".join(f'<seg id="{i}">{p[side].replace("&", "&amp;")}</seg>\n' for i, p in enumerate(pairs["test"], 1))
            kind = "ref" if lang == "en" else "src"
            bundle.writestr(f"dev/newstest2014-deen-{kind}.{lang}.sgm", f'<srcset>\n<doc docid="x">\n{segments}</doc>\n</srcset>\n')
    for name, (url, _) in wmt14.ARCHIVES.items():
        path = folder / url.rsplit("/", 1)[1]
        if path.exists():
            archives[name] = (url, corpora.file_sha256(path))
    return archives


def toy_pairs(count: int, seed: int) -> list[tuple[str, str]]:
    import random

    rng = random.Random(seed)
    return [corpora.toy_pair(rng) for _ in range(count)]


WMT14_PAIRS = {"europarl": toy_pairs(300, 1), "commoncrawl": toy_pairs(200, 2), "news-commentary": toy_pairs(100, 3),
               "valid": toy_pairs(30, 4), "test": [("Fish & chips.", "Fisch & Pommes.")] + toy_pairs(29, 5)}


def test_wmt14_from_local_archives_pairs_the_right_files(tmp_path, monkeypatch):
    from dsmt.data import wmt14

    monkeypatch.setattr(wmt14, "ARCHIVES", wmt14_archives(tmp_path / "raw", WMT14_PAIRS))
    monkeypatch.setenv("DSMT_CACHE", str(tmp_path / "cache"))
    prefixes = wmt14.wmt14_prefixes("de", "en", str(tmp_path / "raw"))
    meta = prepare(prefixes, str(tmp_path / "out"), PrepareOptions("de", "en", vocab_size=200))
    assert meta["splits"]["train"]["raw_pairs"] == 600 and meta["splits"]["newstest2014"]["pairs"] == 30
    train_en = Path(prefixes["train"] + ".en").read_text().splitlines()
    expected = [p[0] for name in ("europarl", "commoncrawl", "news-commentary") for p in WMT14_PAIRS[name]]
    assert train_en == expected
    assert (tmp_path / "out" / "newstest2014.de.txt").read_text().splitlines()[0] == "Fisch & Pommes."
    assert (tmp_path / "out" / "valid.en.txt").read_text().splitlines() == [p[0] for p in WMT14_PAIRS["valid"]]


@pytest.mark.parametrize("damage, words", [
    ("checksum", ["training-parallel-europarl-v7.zip: checksum mismatch"]),
    ("missing", ["training-parallel-commoncrawl.zip has no file commoncrawl.de-en.de"]),
    ("uneven", ["commoncrawl.de-en.en", "commoncrawl.de-en.de", "[200, 199] lines"]),
])
def test_wmt14_bad_archives_are_one_line_and_leave_nothing(tmp_path, monkeypatch, damage, words):
    from dsmt.data import wmt14

    archives = wmt14_archives(tmp_path / "raw", WMT14_PAIRS, damage)
    if damage == "checksum":
        archives["europarl"] = (archives["europarl"][0], "0" * 64)
    monkeypatch.setattr(wmt14, "ARCHIVES", archives)
    monkeypatch.setenv("DSMT_CACHE", str(tmp_path / "cache"))
    with pytest.raises(DsmtError) as error:
        wmt14.wmt14_prefixes("en", "de", str(tmp_path / "raw"))
    for word in words:
        assert word in str(error.value)
    assert not (tmp_path / "cache" / "wmt14_de_en").exists() and not list((tmp_path / "cache").glob(".wmt14*"))


def test_wmt14_cli_names_a_missing_archive(tmp_path):
    (tmp_path / "raw").mkdir()
    result = dsmt("prepare", "wmt14", "--src", "en", "--tgt", "de", "--raw-dir", str(tmp_path / "raw"), "--out",
                  str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "has no training-parallel-europarl-v7.zip; put the WMT14 archives there" in result.stderr
    unsupported = dsmt("prepare", "wmt14", "--src", "en", "--tgt", "cs", "--out", str(tmp_path / "out"))
    assert "WMT14 here is en-de and en-fr (either direction), not en-cs" in unsupported.stderr


def test_wmt14_download_refuses_a_corrupt_archive_and_keeps_nothing(tmp_path, file_server, monkeypatch):
    from dsmt.data import wmt14

    served, url = file_server
    archives = wmt14_archives(served, WMT14_PAIRS)
    (served / "dev.zip").write_bytes(b"not the real archive")
    monkeypatch.setattr(wmt14, "ARCHIVES", {name: (url + u.rsplit("/", 1)[1], sha) for name, (u, sha) in archives.items()})
    monkeypatch.setenv("DSMT_CACHE", str(tmp_path / "cache"))
    with pytest.raises(DsmtError, match="dev.zip: checksum mismatch"):
        wmt14.wmt14_prefixes("en", "de", None)
    downloaded = tmp_path / "cache" / "wmt14"
    assert (downloaded / "training-parallel-nc-v9.zip").is_file() and not (downloaded / "dev.zip").exists()
    assert not list(downloaded.glob("*.part"))
