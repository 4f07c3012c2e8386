"""Raw text in, detokenized translations out: sentencepiece, token-bounded batches, beam search."""

import sys

import numpy as np
import sacrebleu
import sentencepiece as spm
import torch
from tqdm import tqdm

from dsmt import DsmtError
from dsmt.checkpoint import load_model
from dsmt.ct2 import CTranslate2Search, is_ct2_dir
from dsmt.data.batching import token_batches
from dsmt.data.corpora import decode_lines
from dsmt.decode import beam_search, max_output_length


def resolve_device(name: str) -> torch.device:
    """``--device``: "auto" is the GPU when there is one, else the CPU; anything else must exist here."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DsmtError(f"--device {name}: not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise DsmtError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                        "use --device cpu (or auto)")
    if device.type not in ("cpu", "cuda"):
        raise DsmtError(f"--device {name}: dsmt decodes on cpu or cuda")
    return device


class DsmtSearch:
    """dsmt's own beam search (``dsmt.decode.beam_search``) on a checkpoint or exported model dir."""

    def __init__(self, checkpoint: str, device: torch.device, use_cache: bool):
        self.model, model_cfg, self.spm_paths = load_model(checkpoint)
        self.model.to(device)
        self.device, self.use_cache, self.max_positions = device, use_cache, model_cfg.max_positions
        self.src_sp, self.tgt_sp = (spm.SentencePieceProcessor(model_file=str(self.spm_paths[side])) for side in ("src", "tgt"))
        for sp, size in ((self.src_sp, model_cfg.src_vocab_size or model_cfg.vocab_size), (self.tgt_sp, model_cfg.vocab_size)):
            if sp.vocab_size() != size:
                raise DsmtError(f"{checkpoint}: a sentencepiece model has {sp.vocab_size()} pieces but the model "
                                f"{size}; the checkpoint and its vocabulary do not belong together")

    def translate_batches(self, requests, beam: int, lenpen: float, nbest: int):
        """For each request (sources as ids ending with EOS, max output length), in order, the ``nbest`` best
        (score, ids) per source."""
        pad, bos, eos = self.tgt_sp.pad_id(), self.tgt_sp.bos_id(), self.tgt_sp.eos_id()
        for sources, max_len in requests:
            src = torch.full((len(sources), max(map(len, sources))), pad, dtype=torch.long)
            for row, ids in enumerate(sources):
                src[row, : len(ids)] = torch.tensor(ids)
            yield beam_search(self.model, src.to(self.device), bos, eos, pad, beam, lenpen, max_len, nbest=nbest,
                              use_cache=self.use_cache)


class Translator:
    """Text in, text out, through dsmt's decoder or, for a ``dsmt export --format ctranslate2`` dir, CTranslate2."""

    def __init__(self, checkpoint: str, beam: int = 5, lenpen: float = 0.6, max_len_a: float = 1.2,
                 max_len_b: int = 10, batch_tokens: int = 8000, use_cache: bool = True, nbest: int = 1,
                 device: str = "auto"):
        if beam < 1 or not 1 <= nbest <= beam:
            raise DsmtError(f"--beam {beam} --nbest {nbest}: need beam >= 1 and 1 <= nbest <= beam")
        if max_len_a < 0 or max_len_b < 0 or max_len_a == 0 and max_len_b < 1:
            raise DsmtError(f"--max-len-a {max_len_a} --max-len-b {max_len_b}: translations could hold no token; "
                            "need a >= 0, b >= 0 and one of them > 0 (default: 1.2 and 10)")
        if batch_tokens < 1:
            raise DsmtError(f"--batch-tokens {batch_tokens}: must be at least 1")
        self.device = resolve_device(device)
        if is_ct2_dir(checkpoint):
            self.search = CTranslate2Search(checkpoint, self.device, torch.get_num_threads())
        else:
            self.search = DsmtSearch(checkpoint, self.device, use_cache)
        self.src_sp, self.sp = self.search.src_sp, self.search.tgt_sp
        self.eos = self.sp.eos_id()
        self.beam, self.lenpen, self.max_len_a, self.max_len_b = beam, lenpen, max_len_a, max_len_b
        self.batch_tokens, self.nbest = batch_tokens, nbest
        self.max_positions = self.search.max_positions

    def _source_ids(self, lines: list[str]) -> list[list[int]]:
        """Subword ids + EOS per line (none for an empty line). A line longer than the model's positions is
        cut to fit, with a warning naming it, so that the output still has one line per input line."""
        ids = []
        for number, line in enumerate(lines, 1):
            pieces = self.src_sp.encode(line) if line.strip() else []
            if len(pieces) >= self.max_positions:
                print(f"dsmt: warning: input line {number} has {len(pieces)} subwords, more than the model's "
                      f"{self.max_positions - 1} (max_positions); translating its first {self.max_positions - 1}",
                      file=sys.stderr)
                pieces = pieces[: self.max_positions - 1]
            ids.append(pieces + [self.eos] if pieces else [])
        return ids

    def translate(self, lines: list[str]) -> list[str]:
        """One translation per line, in order; an empty line stays empty."""
        return [hyps[0][1] if hyps else "" for hyps in self.translate_nbest(lines)]

    def translate_nbest(self, lines: list[str]) -> list[list[tuple[float, str]]]:
        """Per line the ``nbest`` best (score, translation), best first; none for an empty line."""
        ids = self._source_ids(lines)
        todo = np.array([i for i, x in enumerate(ids) if x], dtype=np.int64)
        out = [[] for _ in lines]
        if not len(todo):
            return out
        lengths = np.array([len(x) for x in ids])
        # Beam search holds beam × the source rows: bound that, sorted by length to keep padding low.
        order = todo[np.argsort(lengths[todo], kind="stable")]
        batches = token_batches(lengths, lengths, max(self.batch_tokens // self.beam, int(lengths.max())), order)
        requests = (([ids[i] for i in batch],
                     max_output_length(int(lengths[batch].max()), self.max_len_a, self.max_len_b, self.max_positions))
                    for batch in batches)
        found_by_batch = self.search.translate_batches(requests, self.beam, self.lenpen, self.nbest)
        for batch, found in zip(tqdm(batches, desc="translate", unit="batch", disable=None, leave=False), found_by_batch):
            for i, hyps in zip(batch, found):
                out[i] = [(score, self.sp.decode(tokens)) for score, tokens in hyps]
        return out


def open_input(path: str):
    return sys.stdin.buffer if path == "-" else open(path, "rb")


def read_input(path: str) -> list[str]:
    try:
        with open_input(path) as stream:
            return decode_lines(stream, "stdin" if path == "-" else path)
    except FileNotFoundError:
        raise DsmtError(f"input file {path} not found") from None


def format_output(translator: Translator, lines: list[str], first: int = 0) -> list[str]:
    """One line per input line; with n-best, Moses' format ``index ||| translation ||| score`` instead."""
    if translator.nbest == 1:
        return translator.translate(lines)
    return [f"{first + i} ||| {text} ||| {score:.4f}"
            for i, hyps in enumerate(translator.translate_nbest(lines)) for score, text in hyps]


def translate_stream(translator: Translator, source: str, target: str) -> None:
    """Whole files are batched; an interactive terminal on stdin is answered line by line."""
    out = sys.stdout if target == "-" else open(target, "w", encoding="utf-8")
    try:
        if source == "-" and sys.stdin.isatty():
            for number, raw in enumerate(sys.stdin.buffer, 1):
                for line in format_output(translator, decode_lines([raw], f"stdin:{number}"), number - 1):
                    print(line, file=out, flush=True)
        else:
            for line in format_output(translator, read_input(source)):
                print(line, file=out)
    finally:
        if out is not sys.stdout:
            out.close()


def evaluate(translator: Translator, src: str, ref: str, hypotheses_out: str | None = None) -> dict:
    sources, references = read_input(src), read_input(ref)
    if len(sources) != len(references):
        raise DsmtError(f"{src} has {len(sources)} lines but {ref} has {len(references)}")
    hypotheses = translator.translate(sources)
    if hypotheses_out:
        with open(hypotheses_out, "w", encoding="utf-8") as f:
            f.writelines(h + "\n" for h in hypotheses)
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    bleu_score, chrf_score = bleu.corpus_score(hypotheses, [references]), chrf.corpus_score(hypotheses, [references])
    return {"bleu": bleu_score.score, "chrf": chrf_score.score,
            "bleu_line": f"{bleu_score} {bleu.get_signature()}", "chrf_line": f"{chrf_score} {chrf.get_signature()}"}
