import functools
import gzip
import http.server
import shutil
import subprocess
import threading
import unicodedata
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from dsmt import DsmtError
from dsmt.data import corpora
from dsmt.data.batching import BatchStream, ParallelData, epoch_batches, shard, token_batches
from dsmt.data.corpora import MULTI30K_SPLITS, download, multi30k_prefixes
from dsmt.data.prepare import PrepareOptions, prepare
from tests.conftest import MULTI30K, PYTHON, run_env


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
        download(url + "val.de.gz", dest, corpora.MULTI30K_SHA256["val.de.gz"])
    assert not dest.exists() and not list(tmp_path.glob("*.part"))
    with pytest.raises(DsmtError, match="cannot download"):
        download(url + "missing.gz", dest, corpora.MULTI30K_SHA256["val.de.gz"])
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
