"""dsmt models as CTranslate2 model directories, and decoding through CTranslate2 behind dsmt's CLI.

CTranslate2 is the usual production runtime for MT (int8/float16 on CPU and GPU, batched beam search). The
export builds its ``TransformerSpec`` from a dsmt model, as CTranslate2's own converters do (see its
OpenNMT-py converter): fused query/key/value projections, pre- or post-norm, the position table written out
explicitly (dsmt's sinusoids interleave sine and cosine, CTranslate2's built-in ones do not), and the
tokens handling in the model config, so that callers pass plain subword pieces:
``ctranslate2.Translator(DIR).translate_batch([sp.encode(line, out_type=str)])``.
"""

import collections
import json
import shutil
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch

from dsmt import DsmtError
from dsmt.files import Product, check_replaceable, staged_dir

QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "float16", "bfloat16", "float32")
# dsmt's own decoder never emits padding or BOS: the exported output projection gets this bias on their rows
# (any realistic logit is far above it, in float16 as well), so that CTranslate2 never emits them either.
FORBIDDEN_LOGIT = -1e4
DSMT_CONFIG = "dsmt"  # key in config.json: what dsmt's CLI needs besides the CTranslate2 model


def spm_files(joint: bool) -> dict[str, str]:
    """The sentencepiece model files of a CTranslate2 dir, by side."""
    return {"src": "spm.model", "tgt": "spm.model"} if joint else {"src": "spm.src.model", "tgt": "spm.tgt.model"}


def _entries(folder: Path) -> set[str] | None:
    config = folder / "config.json"
    if not ((folder / "model.bin").is_file() and config.is_file()):
        return None
    try:
        joint = json.loads(config.read_text())[DSMT_CONFIG]["joint_vocabulary"]
    except (ValueError, KeyError, TypeError):
        return None  # a CTranslate2 model that dsmt did not write
    vocabularies = {"shared_vocabulary.json"} if joint else {"source_vocabulary.json", "target_vocabulary.json"}
    return {"model.bin", "config.json", *vocabularies, *spm_files(joint).values()}


CT2_DIR = Product("a CTranslate2 model dir written by dsmt export --format ctranslate2", _entries)


def is_ct2_dir(path: str) -> bool:
    return _entries(Path(path)) is not None


def _linear(spec, weight, bias=None) -> None:
    spec.weight = weight
    if bias is not None:
        spec.bias = bias


def _layer_norm(spec, norm, weights: dict) -> None:
    spec.gamma, spec.beta = weights[f"{norm}.weight"], weights[f"{norm}.bias"]


def _attention(spec, weights: dict, name: str, self_attention: bool) -> None:
    """dsmt's query/key/value projections are already fused in CTranslate2's order (q, k, v; cross: q, then k, v).
    The key part of the bias is zeroed: dsmt masks it in every forward (see ``dsmt.model.InputProjection``)."""
    d_model = weights[f"{name}.out.weight"].shape[0]
    fused = "qkv" if self_attention else "kv"
    bias = weights[f"{name}.{fused}.bias"].copy()
    key = fused.index("k")
    bias[key * d_model:(key + 1) * d_model] = 0.0
    if self_attention:
        _linear(spec.linear[0], weights[f"{name}.qkv.weight"], bias)
    else:
        _linear(spec.linear[0], weights[f"{name}.q.weight"], weights[f"{name}.q.bias"])
        _linear(spec.linear[1], weights[f"{name}.kv.weight"], bias)
    _linear(spec.linear[-1], weights[f"{name}.out.weight"], weights[f"{name}.out.bias"])


def _ffn(spec, weights: dict, name: str) -> None:
    _linear(spec.linear_0, weights[f"{name}.0.weight"], weights[f"{name}.0.bias"])
    _linear(spec.linear_1, weights[f"{name}.3.weight"], weights[f"{name}.3.bias"])


def model_spec(model, model_cfg, src_sp, tgt_sp):
    """A ``ctranslate2.specs.TransformerSpec`` holding ``model``'s weights (fp32 numpy) and vocabularies."""
    from ctranslate2.specs import transformer_spec

    weights = {name: tensor.detach().float().numpy() for name, tensor in model.state_dict().items()}
    if hasattr(model, "sinusoids"):
        positions = model.sinusoids.float().numpy()
    else:
        positions = weights["learned_positions.weight"]
    spec = transformer_spec.TransformerSpec.from_config(
        (model_cfg.n_encoder_layers, model_cfg.n_decoder_layers), model_cfg.n_heads, pre_norm=model_cfg.norm_first)
    for side, stack, layers, embed in (("encoder", spec.encoder, "encoder_layers", "src_embed"),
                                       ("decoder", spec.decoder, "decoder_layers", "tgt_embed")):
        embeddings = stack.embeddings[0] if side == "encoder" else stack.embeddings
        embeddings.weight = weights[f"{embed}.weight"]
        stack.scale_embeddings = True  # dsmt multiplies embeddings by sqrt(d_model) too
        stack.position_encodings.encodings = positions
        if model_cfg.norm_first:
            _layer_norm(stack.layer_norm, f"{side}_norm", weights)
        for i, layer in enumerate(stack.layer):
            prefix = f"{layers}.{i}"
            _attention(layer.self_attention, weights, f"{prefix}.self_attn", self_attention=True)
            _layer_norm(layer.self_attention.layer_norm, f"{prefix}.residuals.0.norm", weights)
            if side == "decoder":
                _attention(layer.attention, weights, f"{prefix}.cross_attn", self_attention=False)
                _layer_norm(layer.attention.layer_norm, f"{prefix}.residuals.1.norm", weights)
            _ffn(layer.ffn, weights, f"{prefix}.ffn")
            _layer_norm(layer.ffn.layer_norm, f"{prefix}.residuals.{2 if side == 'decoder' else 1}.norm", weights)
    bias = np.zeros(model_cfg.vocab_size, dtype=np.float32)
    bias[[tgt_sp.pad_id(), tgt_sp.bos_id()]] = FORBIDDEN_LOGIT
    _linear(spec.decoder.projection, weights["output.weight"], bias)

    spec.config.layer_norm_epsilon = 1e-5  # torch.nn.LayerNorm's
    bos = tgt_sp.id_to_piece(tgt_sp.bos_id())
    spec.config.unk_token, spec.config.bos_token, spec.config.decoder_start_token = tgt_sp.id_to_piece(tgt_sp.unk_id()), bos, bos
    spec.config.eos_token = tgt_sp.id_to_piece(tgt_sp.eos_id())
    spec.config.add_source_eos = True  # dsmt's sources end with EOS; callers pass the plain pieces
    for sp, register in ((src_sp, spec.register_source_vocabulary), (tgt_sp, spec.register_target_vocabulary)):
        register([sp.id_to_piece(i) for i in range(sp.vocab_size())])
    return spec


def export_ctranslate2(checkpoint: str, out: str, quantization: str | None) -> None:
    """``dsmt export --format ctranslate2``: a CTranslate2 model dir with the sentencepiece model(s) beside it."""
    from ctranslate2.converters.converter import Converter

    from dsmt.checkpoint import load_model

    if quantization is not None and quantization not in QUANTIZATIONS:
        raise DsmtError(f"--quantization {quantization}: choose one of {', '.join(QUANTIZATIONS)}")
    check_replaceable(Path(out), CT2_DIR, "--out")
    model, model_cfg, spm_paths = load_model(checkpoint)
    src_sp, tgt_sp = (spm.SentencePieceProcessor(model_file=str(spm_paths[side])) for side in ("src", "tgt"))
    joint = not model_cfg.src_vocab_size  # one vocabulary (dsmt prepare without --separate-vocab)
    spec = model_spec(model, model_cfg, src_sp, tgt_sp)
    spec.config.add_attribute(DSMT_CONFIG, {"joint_vocabulary": joint, "max_positions": model_cfg.max_positions})

    class DsmtConverter(Converter):
        def _load(self):
            return spec

    with staged_dir(Path(out), CT2_DIR) as staging:
        DsmtConverter().convert(str(staging), quantization=quantization, force=True)
        for side, name in spm_files(joint).items():
            shutil.copy(spm_paths[side], staging / name)


class CTranslate2Search:
    """Beam search through CTranslate2 with dsmt's conventions, for ``dsmt.translate.Translator``.

    The two engines define the length penalty differently: dsmt divides a hypothesis's log-probability by
    GNMT's ((5 + length) / 6) ** alpha, CTranslate2 by length ** alpha. So CTranslate2 searches with no
    penalty (both then rank the open beams by the same summed log-probabilities, and both stop a sentence once
    ``beam`` hypotheses have ended: patience 1) and returns every ended hypothesis, which are then ranked with
    dsmt's penalty: the same choice as dsmt's own search whenever both searches end the same hypotheses."""

    def __init__(self, model_dir: str, device, threads: int, workers: int | None = None):
        import ctranslate2

        config = json.loads((Path(model_dir) / "config.json").read_text())[DSMT_CONFIG]
        self.max_positions = config["max_positions"]
        self.spm_paths = {side: Path(model_dir) / name for side, name in spm_files(config["joint_vocabulary"]).items()}
        self.src_sp, self.tgt_sp = (spm.SentencePieceProcessor(model_file=str(self.spm_paths[side])) for side in ("src", "tgt"))
        self.eos = self.tgt_sp.id_to_piece(self.tgt_sp.eos_id())
        # On a CPU, batches decoded side by side on one thread each beat one batch on all threads (a beam step
        # of one batch is too small to keep several cores busy); one GPU runs one batch at a time.
        self.workers = workers or (threads if device.type == "cpu" else 1)
        torch_threads = torch.get_num_threads()
        self.translator = ctranslate2.Translator(model_dir, device=device.type, device_index=device.index or 0,
                                                 inter_threads=self.workers,
                                                 intra_threads=max(1, threads // self.workers))
        # CTranslate2 sets the process's OpenMP thread count to intra_threads, which torch shares: without this,
        # torch (and every later Translator, which sizes itself by torch's count) would run on that many.
        torch.set_num_threads(torch_threads)

    def translate_batches(self, requests, beam: int, lenpen: float, nbest: int):
        """For each request (sources as ids ending with EOS, max output length), in order, the ``nbest`` best
        (score, ids) per source, as ``dsmt.decode.beam_search``. One more batch than workers is in flight."""
        pending = collections.deque()
        for sources, max_len in requests:
            pending.append(self._submit(sources, beam, max_len))
            if len(pending) > self.workers:
                yield self._ranked(pending.popleft(), lenpen, nbest)
        while pending:
            yield self._ranked(pending.popleft(), lenpen, nbest)

    def _submit(self, sources: list[list[int]], beam: int, max_len: int) -> list:
        pieces = [[self.src_sp.id_to_piece(i) for i in ids[:-1]] for ids in sources]  # the model adds the EOS
        return self.translator.translate_batch(
            pieces, asynchronous=True, beam_size=beam, patience=1, num_hypotheses=beam, length_penalty=0,
            max_decoding_length=max_len, min_decoding_length=0, max_input_length=0, return_scores=True,
            return_end_token=True)

    def _ranked(self, submitted: list, lenpen: float, nbest: int) -> list[list[tuple[float, list[int]]]]:
        from dsmt.decode import length_penalty

        found = []
        for result in (async_result.result() for async_result in submitted):
            hyps = []
            for tokens, score in zip(result.hypotheses, result.scores):
                ended = bool(tokens) and tokens[-1] == self.eos
                ids = [self.tgt_sp.piece_to_id(t) for t in tokens[: len(tokens) - ended]]
                hyps.append((score / length_penalty(len(ids) + ended, lenpen), ids))
            found.append(sorted(hyps, key=lambda h: -h[0])[:nbest])
        return found
