"""Subword sampling (data.subword_sampling): the training text kept by prepare, sampled segmentations that
depend only on (seed, epoch, side, sentence), exact token batches planned from the sampled lengths, and
bitwise resume of a sampled run after kill -9."""

import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from dsmt import DsmtError
from dsmt.data import batching
from dsmt.data.batching import BatchStream, ParallelData, Prefetcher
from dsmt.data.prepare import PrepareOptions, prepare
from dsmt.data.sampling import SampledEpoch, SampledPart, SubwordSampler, copy_sentences, sentence_uniforms
from tests.test_data import SMALL_DE, SMALL_EN, write_pairs
from tests.test_reliability import QUIET, assert_same_parameters, run_with_faults
from tests.training import records, train

SAMPLING = ("data.subword_sampling.enabled=true",)


@pytest.fixture(scope="module")
def small_data(tmp_path_factory, toy_data):
    """600 training pairs of the toy corpus: an epoch is a few steps, so a short run crosses several."""
    folder = tmp_path_factory.mktemp("small")
    raw = toy_data.parent / "raw"
    splits = {}
    for split, count in (("train", 600), ("valid", 20)):
        lines = {lang: Path(f"{raw}/{split}.{lang}").read_text().splitlines()[:count] for lang in ("en", "de")}
        splits[split] = write_pairs(folder, split, lines["en"], lines["de"])
    prepare(splits, str(folder / "data"), PrepareOptions("en", "de", vocab_size=200))
    return folder / "data"


def sampler_of(data_dir, sides="both", alpha=0.1, nbest=16, seed=1, max_len=1000, threads=1):
    return SubwordSampler(ParallelData(str(data_dir), "train"), str(data_dir), sides, alpha, nbest, seed, max_len,
                          threads)


def drawn(sampler: SubwordSampler, epoch: int, side: str, indices) -> list[np.ndarray]:
    """The sampler's draw of each of ``indices`` in ``epoch``, made for just these sentences."""
    ids, offsets = sampler.segment(epoch, side, indices)
    return np.split(ids, offsets[1:-1])


def all_rows(stream: BatchStream, epoch: int) -> dict[int, tuple]:
    """sentence index → (source row, target-output row) of every batch of ``epoch``, as collate builds them."""
    stream.load_state_dict({"epoch": epoch, "position": 0, "world_size": stream.world_size})
    rows = {}
    for _ in range(len(stream.batches(epoch))):
        batch = next(stream)
        assert batch["src"].numel() <= stream.max_tokens and batch["tgt_out"].numel() <= stream.max_tokens
        for k, index in enumerate(batch["indices"]):
            src, tgt = batch["src"][k], batch["tgt_out"][k]
            rows[int(index)] = (tuple(src[: batch["src_lengths"][k]].tolist()),
                                tuple(tgt[: batch["tgt_lengths"][k]].tolist()))
    return rows


def test_prepare_keeps_the_text_of_exactly_the_kept_training_pairs(tmp_path):
    src = SMALL_EN + ["", "the", " ".join(["the red number is here"] * 20)]
    tgt = SMALL_DE + ["die Nummer", "die rote Nummer ist hier die blaue Nummer ist hier", "die"]
    splits = {"train": write_pairs(tmp_path, "train", src, tgt), "valid": write_pairs(tmp_path, "v", src[:3], tgt[:3])}
    prepare(splits, str(tmp_path / "out"), PrepareOptions("en", "de", vocab_size=50, max_len=60))
    data = ParallelData(str(tmp_path / "out"), "train")
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "out" / "spm.model"))
    for side, lang, lines in (("src", "en", src), ("tgt", "de", tgt)):
        text = np.load(tmp_path / "out" / f"train.{lang}.utf8.npy")
        offsets = np.load(tmp_path / "out" / f"train.{lang}.utf8_offsets.npy")
        kept = [text[offsets[i]:offsets[i + 1]].tobytes().decode() for i in range(len(offsets) - 1)]
        assert kept == lines[:100]  # the three filtered pairs come last
        assert all(sp.encode(line) == data.tokens(side, i).tolist() for i, line in enumerate(kept))


def test_sampling_off_collates_the_prepared_ids(small_data):
    data = ParallelData(str(small_data), "train")
    stream = BatchStream(data, 512, seed=1)
    for _ in range(len(stream.batches(0)) + 2):  # into the next epoch
        batch = next(stream)
        for k, index in enumerate(batch["indices"]):
            src = data.src_ids[data.src_offsets[index]:data.src_offsets[index + 1]].tolist() + [data.eos]
            tgt = data.tgt_ids[data.tgt_offsets[index]:data.tgt_offsets[index + 1]].tolist()
            assert batch["src"][k].tolist() == src + [data.pad] * (batch["src"].size(1) - len(src))
            assert batch["tgt_in"][k, : len(tgt) + 1].tolist() == [data.bos] + tgt
            assert batch["tgt_out"][k, : len(tgt) + 1].tolist() == tgt + [data.eos]
            assert (batch["src_lengths"][k], batch["tgt_lengths"][k]) == (data.src_lens[index], data.tgt_lens[index])


def test_sampled_segmentations_spell_the_same_text_differ_by_epoch_and_repeat_on_a_rerun(small_data):
    sampler, again = sampler_of(small_data), sampler_of(small_data)
    data = sampler.data
    sp = spm.SentencePieceProcessor(model_file=str(small_data / "spm.model"))
    differ = {side: 0 for side in ("src", "tgt")}
    every = range(len(data))
    for side in differ:
        by_epoch = [drawn(sampler, epoch, side, every) for epoch in (0, 1)]
        rerun = drawn(again, 0, side, every)
        for i in every:
            epochs = [by_epoch[0][i].tolist(), by_epoch[1][i].tolist()]
            assert sp.decode(epochs[0]) == sp.decode(epochs[1]) == sp.decode(data.tokens(side, i).tolist())
            assert rerun[i].tolist() == epochs[0]
            differ[side] += epochs[0] != epochs[1]
    assert min(differ.values()) > len(data) // 4, differ
    lengths = SampledEpoch.whole(data, sampler, 0).src_lens
    sources = drawn(sampler, 0, "src", every)
    assert lengths.tolist() == [len(ids) + 1 for ids in sources]
    assert all(np.array_equal(drawn(sampler, 0, "src", [i])[0], sources[i])  # one at a time: the same draw
               for i in range(0, len(data), 37))
    assert (lengths != data.src_lens).any()


def test_only_the_chosen_side_is_sampled(small_data):
    sampler = sampler_of(small_data, sides="tgt")
    data = sampler.data
    every = range(len(data))
    sources = SampledEpoch.whole(data, sampler, 3).sentences("src", every)
    assert all(np.array_equal(ids, data.tokens("src", i)) for i, ids in zip(every, sources))
    assert np.array_equal(SampledEpoch.whole(data, sampler, 3).src_lens, data.src_lens)
    assert any(not np.array_equal(ids, data.tokens("tgt", i)) for i, ids in zip(every, drawn(sampler, 3, "tgt", every)))


@pytest.mark.parametrize("epoch", [0, 1])
def test_every_rank_count_sees_the_same_segmentation_of_a_sentence_in_exact_batches(small_data, epoch):
    sampler, max_tokens = sampler_of(small_data), 256
    view, batches = BatchStream(sampler.data, max_tokens, seed=1, sampler=sampler).plan(epoch)
    for batch in batches:  # planned from the sampled lengths, not the prepared ones
        for lengths in (view.src_lens[batch], view.tgt_lens[batch]):
            assert len(batch) * lengths.max() <= max_tokens
    by_world = {}
    for world in (1, 2, 3):
        by_world[world] = {}
        for rank in range(world):
            stream = BatchStream(sampler.data, max_tokens, seed=1, rank=rank, world_size=world, sampler=sampler)
            by_world[world].update(all_rows(stream, epoch))
    assert set(by_world[1]) == set(range(len(sampler.data)))
    assert by_world[1] == by_world[2] == by_world[3]


class ThreadGroup:
    """An all-gather among ``world`` threads, standing in for the ranks' process group."""

    def __init__(self, world: int):
        self.barrier, self.arrays = threading.Barrier(world, timeout=60), [None] * world

    def all_gather(self, rank: int):
        def gather(array):
            self.arrays[rank] = array
            self.barrier.wait()
            gathered = list(self.arrays)
            self.barrier.wait()
            return gathered
        return gather


def counting(sampler: SubwordSampler) -> dict:
    """Count the sentences ``sampler`` segments, by epoch and side (the calls may come from several threads)."""
    counts, lock, segment = {}, threading.Lock(), sampler.segment

    def counted(epoch, side, indices):
        with lock:
            counts[epoch, side] = counts.get((epoch, side), 0) + len(indices)
        return segment(epoch, side, indices)
    sampler.segment = counted
    return counts


@pytest.mark.parametrize("start", [(0, 0), (1, 3), (1, "end")])
def test_ranks_sharing_the_sampled_pass_get_the_batches_of_a_rank_that_makes_it_alone(small_data, start):
    """3 ranks (threads) each segment a third of every epoch and exchange the lengths while they take batches,
    from the start or resumed mid-epoch or at an epoch's end: each gets, through three epochs, exactly the
    batches and states of a rank that makes the whole pass itself, segmenting ~5/9 of what the ranks alone would."""
    world, max_tokens = 3, 256
    data, group = ParallelData(str(small_data), "train"), ThreadGroup(world)
    epoch, position = start
    if position == "end":
        position = len(BatchStream(data, max_tokens, 1, 0, world, sampler_of(small_data)).batches(epoch))
    state = {"epoch": epoch, "position": position, "world_size": world}
    takes = 3 * -(-len(BatchStream(data, max_tokens, 1, sampler=sampler_of(small_data)).batches(0)) // world)

    def shared(rank):
        stream = BatchStream(data, max_tokens, 1, rank, world, sampler, exchange=group.all_gather(rank))
        stream.load_state_dict(state)
        ahead = Prefetcher(stream, lambda batch: batch, depth=2)
        taken = [next(ahead) for _ in range(takes)]
        ahead.close()
        return taken

    sampler = sampler_of(small_data)
    counts = counting(sampler)
    with ThreadPoolExecutor(world) as pool:
        by_rank = list(pool.map(shared, range(world)))
    for rank, taken in enumerate(by_rank):
        alone = BatchStream(data, max_tokens, 1, rank, world, sampler_of(small_data))
        alone.load_state_dict(state)
        for batch, after in taken:
            expected = next(alone)
            assert after == alone.state_dict()
            assert batch.keys() == expected.keys() and all(np.array_equal(batch[k], expected[k]) for k in batch)
    epochs = {epoch for epoch, _ in counts}
    assert len(epochs) >= 3
    for epoch in epochs:
        assert counts[epoch, "src"] < 0.6 * world * len(data)  # alone, each rank would segment every sentence


def test_a_stream_whose_ranks_exchange_refuses_to_load_a_state_after_its_first_batch(small_data):
    """Its planning threads wait for the old position's exchanges and could take the new one's: refused."""
    stream = BatchStream(ParallelData(str(small_data), "train"), 256, 1, 0, 1, sampler_of(small_data),
                         ThreadGroup(1).all_gather(0))
    stream.load_state_dict({"epoch": 1, "position": 2, "world_size": 1})  # before the first batch: resumes
    ahead = Prefetcher(stream, lambda batch: batch, depth=2)
    assert next(ahead)[1] == {"epoch": 1, "position": 3, "world_size": 1}
    with pytest.raises(RuntimeError, match="load before the first batch"):
        stream.load_state_dict({"epoch": 0, "position": 0, "world_size": 1})
    ahead.close()


@pytest.mark.parametrize("world", [1, 3])
def test_a_rank_makes_its_part_of_an_epochs_pass_once_it_gives_the_batches_of_the_epoch_before(small_data, world,
                                                                                                 monkeypatch):
    """Not beside the plan of the epoch before (the first plan has the core to itself), nor while two planned
    epochs are held: when each part after the first is made, the stream already gives the epoch before it."""
    data, group, made, lock = ParallelData(str(small_data), "train"), ThreadGroup(world), [], threading.Lock()
    streams = [BatchStream(data, 256, 1, rank, world, sampler_of(small_data), group.all_gather(rank))
               for rank in range(world)]

    def recorded(data, sampler, epoch, rank, world):
        stream = streams[rank]
        with lock:
            made.append((rank, epoch, stream.epoch if stream._batches is not None else -1))
        return SampledPart(data, sampler, epoch, rank, world)
    monkeypatch.setattr(batching, "SampledPart", recorded)
    takes = 3 * len(BatchStream(data, 256, 1, 0, world, sampler_of(small_data)).batches(0))

    def take(stream):
        ahead = Prefetcher(stream, lambda batch: batch, depth=2)
        [next(ahead) for _ in range(takes)]
        ahead.close()
    with ThreadPoolExecutor(world) as pool:
        list(pool.map(take, streams))
    for rank in range(world):
        parts = [(epoch, giving) for r, epoch, giving in made if r == rank]
        assert [epoch for epoch, _ in parts[:3]] == [0, 1, 2]
        assert all(giving >= epoch - 1 for epoch, giving in parts[1:]), parts


def test_closing_a_stream_wakes_the_threads_waiting_for_an_exchange(small_data):
    """A prefetcher whose first plan waits for an exchange that never comes (no batch was ever taken) closes."""
    never = ThreadGroup(2).all_gather(0)
    stream = BatchStream(ParallelData(str(small_data), "train"), 256, 1, 0, 2, sampler_of(small_data), never)
    ahead = Prefetcher(stream, lambda batch: batch, depth=2)
    closing = threading.Thread(target=ahead.close)
    closing.start()
    closing.join(timeout=10)
    assert not closing.is_alive() and not ahead.thread.is_alive()


def test_a_planned_epoch_keeps_its_ranks_sampled_ids_only_and_builds_batches_from_the_same_draws(small_data):
    """Each sentence is segmented once an epoch: the planning pass's ids, kept for this rank's sentences, are the
    ones its batches hold (the sampler's own draw for that sentence), and the others' ids are dropped."""
    sampler = sampler_of(small_data)
    data, seen = sampler.data, set()
    for rank in range(3):
        stream = BatchStream(data, 256, seed=1, rank=rank, world_size=3, sampler=sampler)
        view, batches = stream.plan(1)
        mine = np.unique(np.concatenate(batches))
        assert np.array_equal(view.kept, mine) and len(mine) < len(data)
        for side in ("src", "tgt"):
            ids, offsets = view.segments[side]
            draws = drawn(sampler, 1, side, mine)
            assert len(ids) == offsets[-1] == sum(map(len, draws))
            assert all(np.array_equal(ids[offsets[k]:offsets[k + 1]], d) for k, d in enumerate(draws))
        rows = all_rows(stream, 1)
        for index, (src, tgt) in rows.items():
            assert src == (*drawn(sampler, 1, "src", [index])[0].tolist(), data.eos)
            assert tgt == (*drawn(sampler, 1, "tgt", [index])[0].tolist(), data.eos)
        seen |= set(rows)
    assert seen == set(range(len(data)))


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_copy_sentences_puts_each_sentence_in_its_place_whatever_its_chunk(chunk):
    """Sentences from two sources interleaved into one target, as ``SampledEpoch.keep`` merges held and new ids;
    the places the copies leave alone keep what they held."""
    rng = np.random.default_rng(0)
    sentences = [rng.integers(0, 60000, rng.integers(0, 9), dtype=np.uint16) for _ in range(50)]
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in sentences])]).astype(np.int64)
    source = np.concatenate(sentences), offsets
    positions = rng.permutation(50)[:30]
    places = rng.permutation(40)[:30]  # 10 of the target's 40 sentences are left out
    target = {int(place): sentences[position] for place, position in zip(places, positions)}
    untouched = [rng.integers(0, 60000, 3, dtype=np.uint16) for _ in range(40)]
    expected = [target.get(k, untouched[k]) for k in range(40)]
    into_offsets = np.concatenate([[0], np.cumsum([len(s) for s in expected])]).astype(np.int64)
    into = np.concatenate(expected)
    into[np.concatenate([np.arange(into_offsets[k], into_offsets[k + 1]) for k in target])] = 0
    copy_sentences(source, positions, (into, into_offsets), places, chunk)
    assert into.dtype == np.uint16
    assert [into[a:b].tolist() for a, b in zip(into_offsets[:-1], into_offsets[1:])] == [s.tolist() for s in expected]


def test_a_sampled_segmentation_too_long_for_a_batch_keeps_the_prepared_ids(small_data):
    free = sampler_of(small_data, alpha=0.01)  # near-uniform over the 16 best: mostly longer than the best
    max_len = int(free.data.src_lens.max()) - 1  # the longest prepared source, without EOS
    bounded = sampler_of(small_data, alpha=0.01, max_len=max_len)
    data, fallbacks, every = free.data, 0, range(len(free.data))
    for i, sampled, kept in zip(every, drawn(free, 0, "src", every), drawn(bounded, 0, "src", every)):
        expected = sampled if len(sampled) <= max_len else data.tokens("src", i)
        assert np.array_equal(kept, expected)
        fallbacks += len(sampled) > max_len
    assert fallbacks > 0 and SampledEpoch.whole(data, bounded, 0).src_lens.max() == max_len + 1


def test_a_draw_is_one_of_the_nbest_with_probability_as_p_to_the_alpha_whatever_the_thread_count(small_data):
    """The sampler's block-wise, threaded draws against the definition written out one sentence at a time: the
    sentence's uniform picks, among its n best segmentations in order, the first whose cumulative share of
    the weights P(x)^alpha exceeds it."""
    sp = spm.SentencePieceProcessor(model_file=str(small_data / "spm.model"))
    log_prob = np.array([sp.get_score(i) for i in range(sp.vocab_size())])
    sampler = sampler_of(small_data, alpha=0.3, nbest=8)
    text, offsets = sampler.text["src"]
    every = np.arange(len(sampler.data))
    uniforms = sentence_uniforms(1, 5, "src", every)
    expected = []
    for i in every:
        candidates = sp.nbest_encode_as_ids(text[offsets[i]:offsets[i + 1]].tobytes().decode(), 8)
        log_p = np.array([log_prob[c].sum() for c in candidates])
        weights = np.cumsum(np.exp(0.3 * (log_p - log_p.max())))
        expected.append(candidates[int(np.searchsorted(weights, uniforms[i] * weights[-1], side="right"))])
    for threads in (1, 3):
        got = drawn(sampler_of(small_data, alpha=0.3, nbest=8, threads=threads), 5, "src", every)
        assert [ids.tolist() for ids in got] == expected
    assert sum(ids != sampler.data.tokens("src", i).tolist() for i, ids in enumerate(expected)) > len(every) // 4


def test_a_sentence_that_normalizes_to_nothing_is_sampled_as_its_prepared_empty_ids(tmp_path):
    """A control or zero-width character alone passes prepare's empty-line filter but has no pieces: its n-best
    list is one empty segmentation, wherever it falls in a block."""
    nothing = ["\x07", "\u200b"]
    src, tgt = SMALL_EN[:40] + nothing + SMALL_EN[40:60] + nothing, SMALL_DE[:40] + ["a", "b"] + SMALL_DE[40:60] + ["c", "d"]
    splits = {"train": write_pairs(tmp_path, "train", src, tgt), "valid": write_pairs(tmp_path, "v", src[:3], tgt[:3])}
    prepare(splits, str(tmp_path / "out"), PrepareOptions("en", "de", vocab_size=50))
    sampler = sampler_of(tmp_path / "out")
    every = range(len(sampler.data))
    empty = [i for i in every if len(sampler.data.tokens("src", i)) == 0]
    assert len(empty) == 4
    draws = drawn(sampler, 0, "src", every)
    assert [i for i in every if len(draws[i]) == 0] == empty


def test_draws_are_uniform_and_depend_on_every_key():
    indices = np.arange(100_000)
    draws = sentence_uniforms(1, 0, "src", indices)
    assert draws.min() >= 0 and draws.max() < 1 and len(np.unique(draws)) == len(indices)
    assert np.histogram(draws, bins=10, range=(0, 1))[0].min() > 9_500
    for other in (sentence_uniforms(2, 0, "src", indices), sentence_uniforms(1, 1, "src", indices),
                  sentence_uniforms(1, 0, "tgt", indices)):
        assert abs(np.corrcoef(draws, other)[0, 1]) < 0.02 and (other != draws).all()


def test_a_bpe_model_is_refused_with_what_to_do(tmp_path):
    splits = {"train": write_pairs(tmp_path, "train", SMALL_EN, SMALL_DE),
              "valid": write_pairs(tmp_path, "v", SMALL_EN[:3], SMALL_DE[:3])}
    prepare(splits, str(tmp_path / "out"), PrepareOptions("en", "de", vocab_size=50, model_type="bpe"))
    with pytest.raises(DsmtError, match="has a bpe model; prepare with --model-type unigram"):
        sampler_of(tmp_path / "out")


def test_a_data_dir_without_the_training_text_is_refused_with_what_to_do(small_data, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(small_data, old)
    meta = json.loads((old / "meta.json").read_text())
    (old / "meta.json").write_text(json.dumps(dict(meta, format=1)))
    for file in old.glob("train.*.utf8*"):
        file.unlink()
    with pytest.raises(DsmtError, match="prepared by an older dsmt .* run `dsmt prepare` again"):
        sampler_of(old)


@pytest.mark.slow
def test_a_sampled_run_killed_mid_epoch_resumes_to_the_uninterrupted_parameters(small_data, tmp_path):
    """Two ranks, epochs of ~17 steps: kill -9 of one rank in the second epoch, then resume=auto from the
    save in that epoch; the final parameters are bitwise those of the run never interrupted, and differ from
    a run without sampling."""
    common = ("train.max_steps=30", "train.save_interval=10", "data.max_tokens=512", *QUIET)
    reference, interrupted, plain = tmp_path / "reference", tmp_path / "interrupted", tmp_path / "plain"
    train(small_data, reference, *common, *SAMPLING, ranks=2)
    result = run_with_faults(small_data, interrupted, "kill@24@1", *common, *SAMPLING)
    assert result.returncode != 0 and max(records(interrupted)) == 23
    train(small_data, interrupted, *common, *SAMPLING, ranks=2)
    assert max(records(interrupted)) == 30
    assert_same_parameters(reference, interrupted)
    train(small_data, plain, *common, ranks=2)
    with pytest.raises(AssertionError, match="tensors differ"):
        assert_same_parameters(reference, plain)


@pytest.mark.slow
def test_three_ranks_train_sampled_epochs_whose_batches_do_not_divide_evenly(small_data, tmp_path):
    """3 ranks through two epoch boundaries of sampled batches, each epoch's batch count its own (sampled
    lengths) and padded to a multiple of 3: no rank waits on a collective another never joins."""
    out = tmp_path / "three"
    counts = [len(BatchStream(ParallelData(str(small_data), "train"), 512, seed=1, sampler=sampler_of(small_data))
                  .batches(epoch)) for epoch in (0, 1)]
    steps = sum(-(-count // 3) for count in counts) + 2  # into the third epoch
    train(small_data, out, f"train.max_steps={steps}", "data.max_tokens=512", *QUIET, *SAMPLING, ranks=3)
    assert max(records(out)) == steps
