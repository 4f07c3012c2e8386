import json
import os
import pty
import re
import select
import subprocess
import termios
import time

import pytest
import sacrebleu
import torch

from dsmt.checkpoint import load_model
from dsmt.config import ModelConfig
from dsmt.decode import beam_search, forbid_pad_and_bos, greedy, length_penalty, reorder_cache
from dsmt.model import Transformer
from tests.conftest import PYTHON, REPO, run_env
from tests.training import train

BOS, EOS, PAD = 2, 3, 0


def dsmt(*args, stdin=None):
    return subprocess.run([PYTHON, "-m", "dsmt.cli", *args], capture_output=True, text=True, env=run_env(),
                          cwd=REPO, input=stdin)


def random_model(**kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=40, d_model=32, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=64, pad_id=PAD)
    return Transformer(ModelConfig(**{**cfg, **kw})).eval()


def sources():
    src = torch.randint(4, 40, (3, 7))
    src[1, 4:] = PAD
    src[2, 2:] = PAD
    src[[0, 1, 2], [6, 3, 1]] = EOS
    return src


@pytest.mark.parametrize("kw", [{}, {"positions": "learned", "norm_first": False}])
def test_cached_decoding_equals_full_recomputation(kw):
    model, src = random_model(**kw), sources()
    with torch.no_grad():
        memory = model.encode(src)
        cache, prefix = model.empty_cache(), torch.full((3, 1), BOS)
        for _ in range(12):
            step = torch.log_softmax(model.decode(prefix[:, -1:], memory, src, cache)[:, -1], -1)
            full = torch.log_softmax(model.decode(prefix, memory, src)[:, -1], -1)
            assert torch.allclose(step, full, atol=1e-5)
            # Any path, not only greedy's, except padding inside a sentence, which decoding never emits.
            prefix = torch.cat([prefix, torch.multinomial(step.exp().index_fill(1, torch.tensor([PAD]), 0), 1)], 1)


@pytest.fixture(scope="module")
def trained(toy_data, tmp_path_factory):
    """Checkpoints of 2-rank runs with shared embeddings, and their exports: 80 steps at ZeRO-0 (a model that
    translates), and 3 steps at ZeRO-0 and ZeRO-3 whose weights must agree to round-off. Those take a tiny lr:
    the key projections' bias gets gradients that are zero up to round-off, which Adam turns into steps of ±lr
    whose signs differ between stages."""
    root = tmp_path_factory.mktemp("inference")
    for name, stage, steps, lr in (("zero0", 0, 80, 3e-3), ("short0", 0, 3, 1e-8), ("short3", 3, 3, 1e-8)):
        train(toy_data, root / name, f"train.max_steps={steps}", "train.valid_interval=1000", "train.save_interval=40",
              "model.share_embeddings=true", "data.max_tokens=2048", f"train.lr={lr}", ranks=2,
              ds=f"ds_configs/zero{stage}.json")
        result = dsmt("export", "--checkpoint", str(root / name), "--out", str(root / f"export_{name}"))
        assert result.returncode == 0, result.stderr
    return root, toy_data


def encoded_test_lines(root, data, count: int) -> torch.Tensor:
    """The first ``count`` lines of the toy test set, encoded and right-padded as translate does."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(root / "export_zero0" / "spm.src.model"))
    ids = [sp.encode(line) + [EOS] for line in (data / "test.en.txt").read_text().splitlines()[:count]]
    src = torch.full((len(ids), max(map(len, ids))), PAD)
    for row, x in enumerate(ids):
        src[row, : len(x)] = torch.tensor(x)
    return src


def test_beam_one_is_greedy_and_beam_five_scores_higher(trained):
    root, data = trained
    model = load_model(str(root / "export_zero0"))[0]
    src = encoded_test_lines(root, data, 40)
    memory = model.encode(src)
    greedy_ids = greedy(lambda prefix: model.decode(prefix, memory, src), len(src), "cpu", BOS, EOS, PAD, 30)
    beam1 = beam_search(model, src, BOS, EOS, PAD, beam=1, lenpen=0.6, max_len=30)
    assert [h[0][1] for h in beam1] == greedy_ids
    beam5 = beam_search(model, src, BOS, EOS, PAD, beam=5, lenpen=0.6, max_len=30, nbest=5)
    for one, five in zip(beam1, beam5):
        assert five[0][0] >= one[0][0] - 1e-6
        assert [s for s, _ in five] == sorted([s for s, _ in five], reverse=True)


def reference_beam_search(model, src, bos, eos, pad, beam, lenpen, max_len, nbest=1):
    """The plain loop dsmt's beam search was before it became tensor operations (one host round trip per
    sentence and candidate per step): the specification the device version must match exactly."""
    use_cache = True
    batch, vocab, device = src.size(0), model.output.out_features, src.device
    memory = model.encode(src).repeat_interleave(beam, dim=0)
    src = src.repeat_interleave(beam, dim=0)
    cache = model.empty_cache() if use_cache else None
    tokens = torch.full((batch * beam, 1), bos, dtype=torch.long, device=device)
    scores = torch.full((batch, beam), float("-inf"), device=device)
    scores[:, 0] = 0.0  # every beam starts as the same BOS: expand only the first
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(batch)]
    for step in range(max_len):
        logits = model.decode(tokens[:, -1:], memory, src, cache) if use_cache else model.decode(tokens, memory, src)
        logits = logits[:, -1].float()
        forbid_pad_and_bos(logits, pad, bos)
        lprobs = torch.log_softmax(logits, dim=-1)
        candidates = (scores[:, :, None] + lprobs.view(batch, beam, vocab)).view(batch, -1)
        top_scores, top_ids = (t.tolist() for t in candidates.topk(2 * beam, dim=1))  # ≥ beam are not EOS
        survivors = []
        for b in range(batch):
            kept = []
            if len(finished[b]) < beam:
                for rank, (score, flat) in enumerate(zip(top_scores[b], top_ids[b])):
                    row, token = b * beam + flat // vocab, flat % vocab
                    if score == float("-inf") or len(kept) == beam:
                        break
                    if token != eos:
                        kept.append((row, token, score))
                    elif rank < beam:  # an ending counts only if it is among the best `beam` candidates
                        ids = tokens[row, 1:].tolist()
                        finished[b].append((score / length_penalty(len(ids) + 1, lenpen), ids))
                        if len(finished[b]) == beam:
                            kept = []
                            break
                if step == max_len - 1:  # out of length: the open beams end here, without EOS
                    finished[b] += [(score / length_penalty(step + 1, lenpen), tokens[row, 1:].tolist() + [token])
                                    for row, token, score in kept]
            # A finished sentence keeps `beam` dead rows so that the batch keeps its shape.
            kept = kept or [(b * beam, pad, float("-inf"))]
            survivors += kept + [kept[0][:2] + (float("-inf"),)] * (beam - len(kept))
        if step == max_len - 1 or all(len(f) >= beam for f in finished):
            break
        rows, next_tokens, next_scores = zip(*survivors)
        order = torch.tensor(rows, device=device)
        if use_cache:
            reorder_cache(cache, order)
        tokens = torch.cat([tokens.index_select(0, order), torch.tensor(next_tokens, device=device)[:, None]], dim=1)
        scores = torch.tensor(next_scores, device=device).view(batch, beam)
    return [sorted(hyps, key=lambda h: -h[0])[:nbest] for hyps in finished]


@pytest.mark.parametrize("beam, lenpen, max_len, nbest", [(5, 0.6, 30, 5), (4, 1.4, 6, 4), (1, 0.6, 30, 1),
                                                          (3, 0.0, 3, 2)])
def test_beam_search_on_the_device_equals_the_reference_loop(trained, beam, lenpen, max_len, nbest):
    """Same hypotheses, same scores (bitwise), same order: ended by EOS, cut at max_len (short max_len), with
    fewer open candidates than beams, and sentences that finish at different steps."""
    root, data = trained
    model = load_model(str(root / "export_zero0"))[0]
    src = encoded_test_lines(root, data, 40)
    with torch.no_grad():
        expected = reference_beam_search(model, src, BOS, EOS, PAD, beam, lenpen, max_len, nbest)
    assert beam_search(model, src, BOS, EOS, PAD, beam, lenpen, max_len, nbest) == expected


def test_lenpen_sweep_scores_each_penalty_and_pairs_it_with_an_earlier_sweep(trained, tmp_path):
    root, data = trained
    sweep = [PYTHON, "benchmarks/lenpen_sweep.py", "--checkpoint", str(root / "export_zero0"), "--threads", "1",
             "--src", str(data / "valid.en.txt"), "--ref", str(data / "valid.de.txt"), "--lenpens", "0.6,2.2"]
    first = subprocess.run([*sweep, "--out", str(tmp_path / "a.json")], cwd=REPO, env=run_env(), capture_output=True,
                           text=True)
    assert first.returncode == 0, first.stderr
    assert re.findall(r"^lenpen (\S+): BLEU [\d.]+, length ratio [\d.]+, [\d.]+ s$", first.stdout, re.M) == ["0.6", "2.2"]
    second = subprocess.run([*sweep, "--out", str(tmp_path / "b.json"), "--against", str(tmp_path / "a.json")],
                            cwd=REPO, env=run_env(), capture_output=True, text=True)
    assert second.returncode == 0, second.stderr
    paired = re.findall(r"^lenpen (\S+): BLEU ([\d.]+), .*; earlier BLEU ([\d.]+), length ratio [\d.]+, [\d.]+ s; "
                        r"difference p = [\d.]+$", second.stdout, re.M)
    bleu_first = dict(re.findall(r"^lenpen (\S+): BLEU ([\d.]+)", first.stdout, re.M))
    assert paired == [(lp, bleu, bleu) for lp, bleu in bleu_first.items()]
    (tmp_path / "first.hyp").write_text("ein Hund\n")
    (tmp_path / "short.json").write_text(json.dumps({"0.6": {"seconds": 1.0, "hypotheses": ["ein"]}}))
    for bad, message in ((["--against", str(tmp_path / "none.json")], f"--against {tmp_path / 'none.json'} not found"),
                         (["--against", str(tmp_path / "short.json")], "lenpen 0.6 has 1 hypotheses but"),
                         (["--against", str(tmp_path / "first.hyp")], "is not a sweep's JSON"),
                         (["--lenpens", "0.6,long"], "'0.6,long': give comma-separated numbers")):
        refused = subprocess.run([*sweep, "--out", str(tmp_path / "c.json"), *bad], cwd=REPO, env=run_env(),
                                 capture_output=True, text=True)
        assert refused.returncode == 2 and message in refused.stderr.splitlines()[-1], refused.stderr
        assert not (tmp_path / "c.json").exists()
    a, b = (json.loads((tmp_path / f"{name}.json").read_text()) for name in "ab")
    assert [a[lp]["hypotheses"] for lp in a] == [b[lp]["hypotheses"] for lp in b]  # decoding is deterministic
    assert len(a["0.6"]["hypotheses"]) == len((data / "valid.en.txt").read_text().splitlines())


def test_beam_search_without_cache_finds_the_same(trained):
    root, _ = trained
    model = load_model(str(root / "export_zero0"))[0]
    src = sources().clamp(max=model.output.out_features - 1)
    cached = beam_search(model, src, BOS, EOS, PAD, beam=4, lenpen=0.6, max_len=15, nbest=4)
    recomputed = beam_search(model, src, BOS, EOS, PAD, beam=4, lenpen=0.6, max_len=15, nbest=4, use_cache=False)
    assert [[ids for _, ids in hyps] for hyps in cached] == [[ids for _, ids in hyps] for hyps in recomputed]
    for a, b in zip(cached, recomputed):
        assert [s for s, _ in a] == pytest.approx([s for s, _ in b], abs=1e-4)


def test_scores_are_length_normalized_log_probabilities(trained):
    root, _ = trained
    model = load_model(str(root / "export_zero0"))[0]
    src = sources().clamp(max=model.output.out_features - 1)
    (score, ids), = beam_search(model, src[:1], BOS, EOS, PAD, beam=3, lenpen=1.0, max_len=20)[0]
    target = torch.tensor([[BOS] + ids + ([EOS] if len(ids) < 20 else [])])
    logits = model(src[:1], target[:, :-1])
    logits[..., [PAD, BOS]] = float("-inf")  # scores are over the tokens that can be emitted
    lprobs = torch.log_softmax(logits, -1)
    total = lprobs[0, torch.arange(target.size(1) - 1), target[0, 1:]].sum().item()
    assert score == pytest.approx(total / length_penalty(target.size(1) - 1, 1.0), abs=1e-4)


def test_export_keeps_tied_weights_and_translations(trained):
    root, data = trained
    exported = torch.load(root / "export_short3" / "model.pt")
    assert "output.weight" in exported and torch.equal(exported["output.weight"], exported["src_embed.weight"])
    text = "\n".join((data / "test.en.txt").read_text().splitlines()[:30]) + "\n"
    from_checkpoint = dsmt("translate", "--checkpoint", str(root / "short3"), stdin=text)
    from_export = dsmt("translate", "--checkpoint", str(root / "export_short3"), stdin=text)
    assert from_checkpoint.returncode == 0, from_checkpoint.stderr
    assert from_checkpoint.stdout == from_export.stdout and len(from_export.stdout.splitlines()) == 30


def test_zero3_and_zero0_exports_agree(trained):
    root, _ = trained
    zero0, zero3 = (torch.load(root / f"export_short{stage}" / "model.pt") for stage in (0, 3))
    assert zero0.keys() == zero3.keys()
    for name in zero0:
        assert torch.allclose(zero0[name], zero3[name], atol=1e-6), name


@pytest.fixture(scope="module")
def ct2_model(trained):
    """The 80-step model exported for CTranslate2 (float32)."""
    root, _ = trained
    result = dsmt("export", "--checkpoint", str(root / "zero0"), "--out", str(root / "ct2_zero0"), "--format",
                  "ctranslate2")
    assert result.returncode == 0, result.stderr
    return root / "ct2_zero0"


@pytest.mark.parametrize("engine", ["dsmt", "ctranslate2"])
def test_translate_keeps_lines_order_and_empty_lines(trained, ct2_model, tmp_path, engine):
    root, data = trained
    model_dir = str(root / "export_zero0") if engine == "dsmt" else str(ct2_model)
    lines = data.joinpath("test.en.txt").read_text().splitlines()[:12]
    lines[3] = lines[7] = ""
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.txt"
    from_file = dsmt("translate", "--checkpoint", model_dir, "--input", str(source),
                     "--output", str(out), "--batch-tokens", "100")
    assert from_file.returncode == 0, from_file.stderr
    translated = out.read_text().splitlines()
    assert len(translated) == 12 and translated[3] == translated[7] == "" and all(translated[i] for i in (0, 5, 11))
    from_stdin = dsmt("translate", "--checkpoint", model_dir, stdin=source.read_text())
    assert from_stdin.stdout.splitlines() == translated
    # Order: each line translated alone gives the same output as in the batch.
    alone = dsmt("translate", "--checkpoint", model_dir, stdin=lines[5] + "\n")
    assert alone.stdout.strip() == translated[5]


def test_a_line_longer_than_the_model_is_cut_with_a_warning_and_keeps_its_place(trained, tmp_path):
    """A line of 3000 words cannot pass the model's 1024 positions: its start is translated, a warning names it,
    and the output keeps one line per input line; a byte-order mark on the first line is not text."""
    root, data = trained
    lines = data.joinpath("test.en.txt").read_text().splitlines()[:2]
    source = tmp_path / "in.txt"
    source.write_bytes(b"\xef\xbb\xbf" + "\n".join([lines[0], " ".join(["red apples"] * 1500), lines[1]]).encode() + b"\n")
    result = dsmt("translate", "--checkpoint", str(root / "export_zero0"), "--input", str(source), "--beam", "1",
                  "--max-len-a", "0", "--max-len-b", "20")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "warning: input line 2 has" in result.stderr
    assert "translating its first 1023" in result.stderr
    out = result.stdout.splitlines()
    alone = dsmt("translate", "--checkpoint", str(root / "export_zero0"), "--beam", "1", "--max-len-a", "0",
                 "--max-len-b", "20", stdin=f"{lines[0]}\n{lines[1]}\n").stdout.splitlines()
    assert len(out) == 3 and out[1] and [out[0], out[2]] == alone


def read_until(fd: int, text: str, timeout: float = 120.0) -> str:
    """What a terminal shows until ``text`` appears (or the time runs out, failing with what was shown)."""
    shown, deadline = "", time.monotonic() + timeout
    while text not in shown:
        remaining = deadline - time.monotonic()
        assert remaining > 0 and select.select([fd], [], [], remaining)[0], f"no {text!r} in {shown!r}"
        shown += os.read(fd, 4096).decode()
    return shown


def test_translate_answers_a_terminal_line_by_line(trained):
    """On an interactive terminal each line is answered as soon as it is entered, before the next one or EOF."""
    root, data = trained
    lines = data.joinpath("test.en.txt").read_text().splitlines()[:2]
    command = ["translate", "--checkpoint", str(root / "export_zero0")]
    expected = dsmt(*command, stdin="\n".join(lines) + "\n").stdout.splitlines()
    terminal, shell_side = pty.openpty()
    settings = termios.tcgetattr(shell_side)
    settings[3] &= ~termios.ECHO  # the terminal shows only what dsmt writes
    termios.tcsetattr(shell_side, termios.TCSANOW, settings)
    process = subprocess.Popen([PYTHON, "-m", "dsmt.cli", *command], stdin=shell_side, stdout=shell_side,
                               stderr=subprocess.PIPE, env=run_env(), cwd=REPO)
    os.close(shell_side)
    try:
        for line, translation in zip(lines, expected, strict=True):
            os.write(terminal, (line + "\n").encode())
            read_until(terminal, translation + "\r\n")
        os.write(terminal, b"\x04")  # Ctrl-D on an empty line: end of input
        assert process.wait(timeout=60) == 0, process.stderr.read().decode()[-2000:]
    finally:
        process.kill()
        os.close(terminal)


def test_nbest_output(trained):
    root, data = trained
    lines = data.joinpath("test.en.txt").read_text().splitlines()[:3]
    result = dsmt("translate", "--checkpoint", str(root / "export_zero0"), "--beam", "4", "--nbest", "3",
                  stdin="\n".join(lines) + "\n")
    assert result.returncode == 0, result.stderr
    rows = [line.split(" ||| ") for line in result.stdout.splitlines()]
    assert [int(r[0]) for r in rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    best = dsmt("translate", "--checkpoint", str(root / "export_zero0"), "--beam", "4", stdin="\n".join(lines) + "\n")
    assert [r[1] for r in rows[::3]] == best.stdout.splitlines()
    for i in range(3):
        scores = [float(r[2]) for r in rows[3 * i: 3 * i + 3]]
        assert scores == sorted(scores, reverse=True)


def test_evaluate_prints_signature_and_sacrebleu_score(trained, tmp_path):
    root, data = trained
    hyps = tmp_path / "hyps.txt"
    result = dsmt("evaluate", "--checkpoint", str(root / "export_zero0"), "--src", str(data / "test.en.txt"),
                  "--ref", str(data / "test.de.txt"), "--hypotheses", str(hyps))
    assert result.returncode == 0, result.stderr
    bleu_line, chrf_line = result.stdout.strip().splitlines()
    assert "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:" in bleu_line and chrf_line.startswith("chrF2")
    expected = sacrebleu.corpus_bleu(hyps.read_text().splitlines(), [(data / "test.de.txt").read_text().splitlines()])
    assert bleu_line.startswith(f"BLEU = {expected.score:.2f}")


def test_average_of_checkpoints(trained, tmp_path):
    root, _ = trained
    steps = [root / "zero0" / "checkpoints" / f"step{s}" for s in (40, 80)]
    result = dsmt("average", "--checkpoints", *map(str, steps), "--out", str(tmp_path / "avg"))
    assert result.returncode == 0, result.stderr
    averaged = torch.load(tmp_path / "avg" / "model.pt")
    first, second = (load_model(str(s))[0].state_dict() for s in steps)
    for name in averaged:
        assert torch.allclose(averaged[name], (first[name] + second[name]) / 2, atol=1e-6)


@pytest.mark.parametrize("case, words", [
    ("missing", ["does not exist"]),
    ("partial", ["not a complete checkpoint"]),
    ("vocab", ["sentencepiece model has", "do not belong together"]),
    ("shape", ["does not fit its model config", "size mismatch"]),
    ("bad_utf8", ["stdin:2", "UTF-8"]),
    ("nbest", ["--nbest 3", "nbest <= beam"]),
])
def test_inference_errors_are_one_line(trained, tmp_path, case, words):
    import shutil

    root, data = trained
    checkpoint, stdin = root / "export_zero0", b"A dog.\n"
    if case == "missing":
        checkpoint = tmp_path / "nothing"
    elif case == "partial":
        checkpoint = tmp_path / "step10"
        checkpoint.mkdir()
    elif case == "vocab":
        checkpoint = tmp_path / "mismatch"
        shutil.copytree(root / "export_zero0", checkpoint)
        import sentencepiece as spm

        spm.SentencePieceTrainer.train(sentence_iterator=iter((data / "valid.de.txt").read_text().splitlines()),
                                       model_prefix=str(tmp_path / "other"), vocab_size=100, minloglevel=2)
        shutil.copy(tmp_path / "other.model", checkpoint / "spm.tgt.model")
    elif case == "shape":
        checkpoint = tmp_path / "resized"
        shutil.copytree(root / "export_zero0", checkpoint)
        (checkpoint / "config.yaml").write_text((checkpoint / "config.yaml").read_text().replace("d_ff: 128", "d_ff: 256"))
    elif case == "bad_utf8":
        stdin = b"A dog.\n\xff\xfe broken\n"
    extra = ["--beam", "2", "--nbest", "3"] if case == "nbest" else []
    result = subprocess.run([PYTHON, "-m", "dsmt.cli", "translate", "--checkpoint", str(checkpoint), *extra],
                            capture_output=True, env=run_env(), cwd=REPO, input=stdin)
    stderr = result.stderr.decode()
    assert result.returncode == 2 and "Traceback" not in stderr, stderr
    for word in words:
        assert word in stderr


@pytest.mark.slow
def test_separate_vocabularies_train_and_translate(tmp_path):
    from dsmt.data.corpora import write_toy_corpus
    from dsmt.data.prepare import PrepareOptions, prepare

    raw = tmp_path / "raw"
    raw.mkdir()
    prepare(write_toy_corpus(raw), str(tmp_path / "data"), PrepareOptions("en", "de", vocab_size=100, joint=False))
    train(tmp_path / "data", tmp_path / "run", "train.max_steps=3", "model.share_embeddings=false",
          "train.valid_interval=1000")
    result = dsmt("translate", "--checkpoint", str(tmp_path / "run"), "--beam", "2", stdin="A dog.\n\nTwo cats.\n")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 3
    exported = dsmt("export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "model"))
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "model" / "spm.src.model").read_bytes() == (tmp_path / "data" / "spm.en.model").read_bytes()


# ---- CTranslate2 ----------------------------------------------------------------------------------------

def test_ctranslate2_dir_is_standard_and_plain_pieces_translate_as_dsmt_greedy(trained, ct2_model):
    """A user of CTranslate2 alone passes sentencepiece pieces (no EOS, no BOS) and gets dsmt's greedy output."""
    import ctranslate2
    import sentencepiece as spm

    root, data = trained
    assert {p.name for p in ct2_model.iterdir()} == {"model.bin", "config.json", "shared_vocabulary.json", "spm.model"}
    sp = spm.SentencePieceProcessor(model_file=str(ct2_model / "spm.model"))
    lines = data.joinpath("test.en.txt").read_text().splitlines()[:60]
    results = ctranslate2.Translator(str(ct2_model)).translate_batch([sp.encode(line, out_type=str) for line in lines],
                                                                      beam_size=1)
    model = load_model(str(root / "export_zero0"))[0]
    src = encoded_test_lines(root, data, 60)
    memory = model.encode(src)
    with torch.no_grad():
        expected = greedy(lambda prefix: model.decode(prefix, memory, src), len(src), "cpu", BOS, EOS, PAD, 256)
    assert [sp.decode(r.hypotheses[0]) for r in results] == [sp.decode(ids) for ids in expected]


def test_ctranslate2_behind_dsmt_translate_chooses_as_dsmt(trained, ct2_model):
    """Through `Translator`: greedy identical. Beam 5: every hypothesis both engines end has the same score within
    1e-3, with no length penalty (both then score summed log-probabilities) and with dsmt's GNMT penalty (mapped:
    CTranslate2 searches without one, and its ended hypotheses are ranked with dsmt's); wherever both searches end
    the same hypotheses, the same translation is chosen. (Their stopping rules differ: CTranslate2 goes on until
    its best open beam ends, dsmt stops once `beam` hypotheses have ended, so CTranslate2 sometimes ends others.)"""
    from dsmt.translate import Translator

    root, data = trained
    lines = data.joinpath("test.en.txt").read_text().splitlines()[:100]
    for beam, lenpen in ((1, 0.6), (5, 0.6), (5, 0.0)):
        ours, theirs = (Translator(path, beam=beam, lenpen=lenpen, nbest=beam, device="cpu").translate_nbest(lines)
                        for path in (str(root / "export_zero0"), str(ct2_model)))
        same_sets = 0
        for a, b in zip(ours, theirs):
            a_scores, b_scores = {text: score for score, text in a}, {text: score for score, text in b}
            assert all(abs(a_scores[text] - b_scores[text]) < 1e-3 for text in a_scores.keys() & b_scores.keys())
            if a_scores.keys() == b_scores.keys():
                same_sets += 1
                assert a[0][1] == b[0][1], (beam, lenpen)
        assert same_sets == len(lines) if beam == 1 else same_sets >= len(lines) // 2


def test_ctranslate2_leaves_torchs_threads_and_each_translator_gets_them_all(ct2_model):
    """CTranslate2 sets the process's OpenMP threads to its intra-op count on loading a model: dsmt puts torch's
    back, so that dsmt's own decoding after it, and the next CTranslate2 model, still use every thread."""
    from dsmt.translate import Translator

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(2):
            assert Translator(str(ct2_model), device="cpu").search.workers == 2
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("variant", [dict(norm_first=True), dict(norm_first=False),
                                     dict(positions="learned", share_embeddings=False),
                                     dict(share_embeddings=False, src_vocab_size=300)],
                         ids=["prenorm-shared-sinusoidal", "postnorm", "learned-positions-separate-embeddings",
                              "separate-vocabularies"])
def test_every_model_variant_converts(trained, tmp_path, variant):
    """Untrained models of each variant: CTranslate2's greedy output equals dsmt's on the toy test lines."""
    import ctranslate2
    import sentencepiece as spm

    from dsmt.checkpoint import write_model_dir
    from dsmt.ct2 import export_ctranslate2

    root, data = trained
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=300, d_model=32, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=64,
                      pad_id=PAD, **variant)
    model = Transformer(cfg).eval()
    for p in model.parameters():  # well-separated logits, so that round-off breaks no tie
        p.data.mul_(3.0)
    spm_file = data / "spm.model"
    write_model_dir(str(tmp_path / "dsmt"), model.state_dict(), cfg, {"src": spm_file, "tgt": spm_file})
    export_ctranslate2(str(tmp_path / "dsmt"), str(tmp_path / "ct2"), None)
    joint = "src_vocab_size" not in variant
    names = {p.name for p in (tmp_path / "ct2").iterdir()}
    assert ("spm.model" in names) == joint and ("spm.src.model" in names) == (not joint)
    sp = spm.SentencePieceProcessor(model_file=str(spm_file))
    lines = data.joinpath("test.en.txt").read_text().splitlines()[:30]
    results = ctranslate2.Translator(str(tmp_path / "ct2")).translate_batch(
        [sp.encode(line, out_type=str) for line in lines], beam_size=1, max_decoding_length=20,
        min_decoding_length=0)  # CTranslate2's default, 1, forbids the empty translation dsmt allows
    src = encoded_test_lines(root, data, 30)
    memory = model.encode(src)
    with torch.no_grad():
        expected = greedy(lambda prefix: model.decode(prefix, memory, src), len(src), "cpu", BOS, EOS, PAD, 20)
    assert [[sp.piece_to_id(t) for t in r.hypotheses[0]] for r in results] == expected


@pytest.mark.parametrize("quantization", ["int8", "float16"])
def test_quantized_export_translates(trained, tmp_path, quantization):
    root, data = trained
    out = tmp_path / quantization
    result = dsmt("export", "--checkpoint", str(root / "zero0"), "--out", str(out), "--format", "ctranslate2",
                  "--quantization", quantization)
    assert result.returncode == 0, result.stderr
    lines = data.joinpath("test.en.txt").read_text().splitlines()[:20]
    translated = dsmt("translate", "--checkpoint", str(out), "--beam", "5", stdin="\n".join(lines) + "\n")
    assert translated.returncode == 0 and len(translated.stdout.splitlines()) == 20
    assert sum(bool(t) for t in translated.stdout.splitlines()) == 20


def test_decode_benchmark_prints_dsmt_and_ctranslate2_rows(trained, tmp_path):
    """benchmarks/decode.py runs (untimed) and prints a row per engine and search, BLEU included."""
    root, data = trained
    for side, lang in (("src", "en"), ("ref", "de")):
        lines = data.joinpath(f"test.{lang}.txt").read_text().splitlines()[:8]
        (tmp_path / side).write_text("\n".join(lines) + "\n")
    done = subprocess.run([PYTHON, "benchmarks/decode.py", "--checkpoint", str(root / "export_zero0"), "--src",
                           str(tmp_path / "src"), "--ref", str(tmp_path / "ref"), "--threads", "1", "--device", "cpu"],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| ") and "×" in line]
    engines = [(row[0].strip("| "), row[1]) for row in rows]
    assert engines == [(engine, search) for search in ("beam 5", "greedy")
                       for engine in ("dsmt", "dsmt", "CTranslate2 float32", "CTranslate2 int8")]
    assert all(float(row[-1].strip(" |")) > 0 for row in rows)
