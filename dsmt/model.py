"""The Transformer of "Attention Is All You Need", building every mask from the tokens it receives.

Nothing here knows about DeepSpeed, ranks or devices: the key-padding masks come from ``pad_id``
and causality from the target length, on the inputs' own device, so any split of a batch by any
parallel wrapper (DataParallel, DDP, ZeRO) sees exactly the masks its own rows need.

Sequences are right-padded. In the decoder, causality alone then hides target padding from every
real position, so decoder self-attention needs no padding mask and takes SDPA's ``is_causal`` path,
and the decoder's position-wise layers skip the padding altogether (``TokenRows``).

Whoever builds a batch may also hand ``forward`` a ``Padding``: what it knew on the host about that batch's
padding. A batch without source padding then reaches SDPA with ``attn_mask=None`` (the only form FlashAttention
takes), and nothing in the step waits for the GPU to answer a data-dependent question.
"""

import math
from dataclasses import dataclass

import numpy as np

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from dsmt.loss import label_smoothed_nll

# The SDPA kernels attention may use. Left to choose, PyTorch prefers cuDNN's attention on Hopper GPUs, which
# builds an execution plan for every new shape: ~10 ms of host time per call, 65% of a transformer_big training
# step on an H200 (docs/results.md). Token batching gives nearly every batch new shapes, and decoding every step;
# Flash (no mask) and memory-efficient (with a mask) kernels take any shape with no set-up. Math is the fallback.
ATTENTION_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def key_padding_mask(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """``[B, 1, 1, S]`` bool mask, True where a key may be attended to.

    A row made only of padding keeps all its keys visible: a fully masked row makes SDPA return
    NaN (pytorch#103749), and such a row's output is never used anyway.
    """
    keep = tokens != pad_id
    keep = keep | ~keep.any(dim=1, keepdim=True)
    return keep[:, None, None, :]


@dataclass(frozen=True)
class Padding:
    """The padding of one right-padded batch, known on the host where the batch was built from its lengths.

    Without it, ``forward`` finds the same from the tokens: on a GPU each ``nonzero`` there makes the host wait
    for the device. It describes exactly one batch: a part of it (a parallel wrapper's split) has another shape,
    and ``forward`` then ignores it and reads the part's own tokens, so every split stays correct.
    """

    src_shape: tuple[int, int]
    tgt_shape: tuple[int, int]
    src_padded: bool  # any source position is padding: the encoder and cross-attention need a mask
    tgt_real: torch.Tensor  # flat indices of the target's real positions
    tgt_padding: torch.Tensor  # and of its padding

    @classmethod
    def of_lengths(cls, src_lengths, tgt_lengths, src_width: int, tgt_width: int) -> "Padding":
        """From each row's real token count and the padded widths."""
        src_lengths, tgt_lengths = np.asarray(src_lengths), np.asarray(tgt_lengths)
        real = (np.arange(tgt_width)[None, :] < tgt_lengths[:, None]).ravel()
        return cls((len(src_lengths), src_width), (len(tgt_lengths), tgt_width), bool((src_lengths < src_width).any()),
                   torch.from_numpy(np.flatnonzero(real)), torch.from_numpy(np.flatnonzero(~real)))

    def to(self, device, non_blocking: bool = False) -> "Padding":
        return Padding(self.src_shape, self.tgt_shape, self.src_padded,
                       self.tgt_real.to(device, non_blocking=non_blocking),
                       self.tgt_padding.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "Padding":
        return Padding(self.src_shape, self.tgt_shape, self.src_padded, self.tgt_real.pin_memory(),
                       self.tgt_padding.pin_memory())


def describes(padding: Padding | None, shape: tuple, side: str) -> bool:
    return padding is not None and getattr(padding, f"{side}_shape") == tuple(shape)


class TokenRows:
    """The real tokens of a right-padded ``[B, T]`` batch as rows ``[N, ...]``, and back.

    Position-wise layers (projections, feed-forward, norms, the loss) work on rows, so padding costs them
    nothing; attention unpacks its projections to ``[B, T]`` for SDPA, with zeros at padding.
    """

    def __init__(self, tokens: torch.Tensor, pad_id: int, padding: Padding | None = None):
        self.shape = tokens.shape
        if describes(padding, tokens.shape, "tgt"):
            self.real, self.padding = padding.tgt_real, padding.tgt_padding
        else:
            keep = tokens.flatten() != pad_id
            self.real, self.padding = keep.nonzero().squeeze(1), (~keep).nonzero().squeeze(1)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(0, 1).index_select(0, self.real)

    def unpack(self, rows: torch.Tensor) -> torch.Tensor:
        padded = rows.new_empty(self.shape.numel(), *rows.shape[1:]).index_fill_(0, self.padding, 0)
        return padded.index_copy_(0, self.real, rows).unflatten(0, self.shape)


class InputProjection(nn.Linear):
    """The concatenated query/key/value (or key/value) projections, with no bias on the keys.

    A key bias adds the same amount to all of one query's scores, which softmax cancels: its gradient is
    round-off, which Adam (eps 1e-9) turns into steps of the full learning rate in random directions, so
    runs that differ only in summation order (ZeRO stages) drift apart. That part of the bias is masked
    to zero in every forward, so its gradient is exactly zero and it never moves.
    """

    def __init__(self, d_model: int, parts: str):
        super().__init__(d_model, len(parts) * d_model)
        key = torch.zeros(len(parts), d_model, dtype=torch.bool)
        key[parts.index("k")] = True
        self.register_buffer("key_bias", key.flatten(), persistent=False)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias.masked_fill(self.key_bias, 0.0))


class Attention(nn.Module):
    """Multi-head attention through ``scaled_dot_product_attention`` (fused kernels on GPU)."""

    def __init__(self, d_model: int, n_heads: int, dropout: float, self_attention: bool):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.dropout = dropout
        if self_attention:
            self.qkv = InputProjection(d_model, "qkv")
        else:
            self.q = nn.Linear(d_model, d_model)
            self.kv = InputProjection(d_model, "kv")
        self.out = nn.Linear(d_model, d_model)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.n_heads, -1).transpose(1, 2)

    def forward(self, x, memory=None, mask=None, causal=False, cache=None, rows: TokenRows | None = None):
        """Self-attention when ``memory`` is None, else attention from ``x`` to ``memory``.

        ``cache`` (a dict owned by the decoding code) makes decoding incremental: self-attention appends
        this step's keys/values to it, cross-attention computes the memory's keys/values once.
        With ``rows``, ``x`` and the output are the packed rows of the queries' batch.
        """
        unpack = rows.unpack if rows is not None else lambda t: t
        if memory is None:
            q, k, v = (self._heads(t) for t in unpack(self.qkv(x)).chunk(3, dim=-1))
            if cache is not None:
                if "k" in cache:
                    if x.size(1) != 1:
                        raise ValueError("incremental decoding feeds one token per step")
                    # One new query at the newest position may see every cached key. is_causal would be
                    # wrong here: SDPA aligns it top-left when query and key lengths differ (pytorch#103082).
                    k, v, causal = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2), False
                cache["k"], cache["v"] = k, v
        else:
            q = self._heads(unpack(self.q(x)))
            if cache is not None and "k" in cache:
                k, v = cache["k"], cache["v"]
            else:
                k, v = (self._heads(t) for t in self.kv(memory).chunk(2, dim=-1))
                if cache is not None:
                    cache["k"], cache["v"] = k, v
        with sdpa_kernel(ATTENTION_KERNELS):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                 dropout_p=self.dropout if self.training else 0.0, is_causal=causal)
        out = out.transpose(1, 2).flatten(2)
        return self.out(out if rows is None else rows.pack(out))


class Dropout(nn.Dropout):
    """``nn.Dropout`` with a cheaper mask on CPU.

    PyTorch draws a CPU dropout mask one element at a time from its serial Mersenne Twister: about a tenth of
    a training step on 2 cores. Here each 64-bit draw gives four 16-bit uniforms, so ``p`` is rounded to a
    multiple of 1/65536 and the kept values are scaled by that rounded rate. On GPUs PyTorch's own is cheap.
    """

    def forward(self, x):
        dropped = round(self.p * 2 ** 16)
        if not self.training or x.device.type != "cpu" or not 0 < dropped < 2 ** 16:
            return super().forward(x)
        bits = torch.empty((x.numel() + 3) // 4, dtype=torch.int64).random_(-2 ** 63, 2 ** 63 - 1)
        keep = bits.view(torch.int16)[: x.numel()].view(x.shape) >= dropped - 2 ** 15
        # The mask carries the scale and x's dtype, so forward and backward are one multiply each (a bool
        # mask would be converted to x's dtype in both, and the scale would be a pass of its own).
        mask = torch.where(keep, x.new_tensor(2 ** 16 / (2 ** 16 - dropped)), x.new_tensor(0.0))
        return x * mask


class FeedForward(nn.Sequential):
    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__(nn.Linear(d_model, d_ff), nn.ReLU(), Dropout(dropout), nn.Linear(d_ff, d_model))


class Residual(nn.Module):
    """``x + dropout(f(norm(x)))`` when ``norm_first``, else the paper's ``norm(x + dropout(f(x)))``."""

    def __init__(self, d_model: int, dropout: float, norm_first: bool):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x, sublayer):
        if self.norm_first:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = Attention(cfg.d_model, cfg.n_heads, cfg.attention_dropout, self_attention=True)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout)
        self.residuals = nn.ModuleList(Residual(cfg.d_model, cfg.dropout, cfg.norm_first) for _ in range(2))

    def forward(self, x, src_mask):
        x = self.residuals[0](x, lambda h: self.self_attn(h, mask=src_mask))
        return self.residuals[1](x, self.ffn)


class DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = Attention(cfg.d_model, cfg.n_heads, cfg.attention_dropout, self_attention=True)
        self.cross_attn = Attention(cfg.d_model, cfg.n_heads, cfg.attention_dropout, self_attention=False)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout)
        self.residuals = nn.ModuleList(Residual(cfg.d_model, cfg.dropout, cfg.norm_first) for _ in range(3))

    def forward(self, x, memory, src_mask, cache=None, rows=None):
        self_cache, cross_cache = (None, None) if cache is None else (cache["self"], cache["cross"])
        x = self.residuals[0](x, lambda h: self.self_attn(h, causal=True, cache=self_cache, rows=rows))
        x = self.residuals[1](x, lambda h: self.cross_attn(h, memory, mask=src_mask, cache=cross_cache, rows=rows))
        return self.residuals[2](x, self.ffn)


class OutputLayer(nn.Linear):
    """The projection to vocabulary logits; given targets, the training loss instead (``dsmt.loss``), which never
    holds all of a batch's logits at once. A module of its own, so that ZeRO-3 gathers its weight for either use."""

    def __init__(self, d_model: int, vocab_size: int, pad_id: int):
        super().__init__(d_model, vocab_size, bias=False)
        self.pad_id = pad_id

    def forward(self, x, targets=None, label_smoothing: float = 0.0):
        if targets is None:
            return super().forward(x)
        return label_smoothed_nll(x, self.weight, targets, label_smoothing, self.pad_id)


def sinusoidal_table(length: int, d_model: int) -> torch.Tensor:
    position = torch.arange(length, dtype=torch.float32)[:, None]
    frequency = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(length, d_model)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)
    return table


class Transformer(nn.Module):
    """Encoder-decoder Transformer. ``cfg`` is a model config (see ``dsmt.config.ModelConfig``)."""

    def __init__(self, cfg):
        super().__init__()
        if cfg.share_embeddings and cfg.src_vocab_size not in (0, cfg.vocab_size):
            raise ValueError("share_embeddings needs one joint vocabulary (src_vocab_size 0 or = vocab_size)")
        if cfg.positions not in ("sinusoidal", "learned"):
            raise ValueError(f"positions must be 'sinusoidal' or 'learned', not {cfg.positions!r}")
        self.pad_id = cfg.pad_id
        self.max_positions = cfg.max_positions
        self.embed_scale = math.sqrt(cfg.d_model)
        self.src_embed = nn.Embedding(cfg.src_vocab_size or cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.tgt_embed = self.src_embed if cfg.share_embeddings else nn.Embedding(
            cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        if cfg.positions == "learned":
            self.learned_positions = nn.Embedding(cfg.max_positions, cfg.d_model)
        else:
            self.register_buffer("sinusoids", sinusoidal_table(cfg.max_positions, cfg.d_model), persistent=False)
        self.embed_dropout = Dropout(cfg.dropout)
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers))
        # Pre-norm leaves the residual stream unnormalized, so each stack ends with a LayerNorm.
        self.encoder_norm = nn.LayerNorm(cfg.d_model) if cfg.norm_first else nn.Identity()
        self.decoder_norm = nn.LayerNorm(cfg.d_model) if cfg.norm_first else nn.Identity()
        self.output = OutputLayer(cfg.d_model, cfg.vocab_size, cfg.pad_id)
        self._init_weights()
        if cfg.share_embeddings:
            self.output.weight = self.tgt_embed.weight

    def _init_weights(self):
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                # With the sqrt(d_model) input scale, N(0, d^-1/2) gives unit-variance embeddings.
                nn.init.normal_(module.weight, std=module.embedding_dim ** -0.5)
                if module.padding_idx is not None:
                    nn.init.zeros_(module.weight[module.padding_idx])

    def _embed(self, table: nn.Embedding, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        end = start + tokens.size(1)
        if end > self.max_positions:
            raise ValueError(f"sequence of {end} tokens exceeds model.max_positions={self.max_positions}")
        if hasattr(self, "learned_positions"):  # called, not indexed, so ZeRO-3 gathers it
            positions = self.learned_positions(torch.arange(start, end, device=tokens.device))
        else:
            positions = self.sinusoids[start:end]
        x = table(tokens)
        return self.embed_dropout(x * self.embed_scale + positions.to(x.dtype))

    def _source_mask(self, src_tokens: torch.Tensor, padding: Padding | None):
        """None for a batch known to hold no source padding (FlashAttention-eligible), else the key mask."""
        if describes(padding, src_tokens.shape, "src") and not padding.src_padded:
            return None
        return key_padding_mask(src_tokens, self.pad_id)

    def encode(self, src_tokens: torch.Tensor, padding: Padding | None = None) -> torch.Tensor:
        """``[B, S]`` source ids → encoder memory ``[B, S, d_model]``."""
        src_mask = self._source_mask(src_tokens, padding)
        x = self._embed(self.src_embed, src_tokens)
        for layer in self.encoder_layers:
            x = layer(x, src_mask)
        return self.encoder_norm(x)

    def empty_cache(self) -> list[dict]:
        """A key/value cache for incremental ``decode``, one entry per decoder layer."""
        return [{"self": {}, "cross": {}} for _ in self.decoder_layers]

    def decode(self, tgt_tokens: torch.Tensor, memory: torch.Tensor, src_tokens: torch.Tensor,
               cache: list[dict] | None = None, targets: torch.Tensor | None = None,
               label_smoothing: float = 0.0, padding: Padding | None = None):
        """``[B, T]`` target-side inputs, the memory of ``src_tokens`` → logits ``[B, T, vocab]`` (zeros at
        padding); given ``targets`` ``[B, T]``, (label-smoothed loss, nll) summed over their non-pad positions
        instead.

        With a ``cache`` (from ``empty_cache``), ``tgt_tokens`` holds only the tokens after those already
        cached: the whole prefix on the first call, then one token per step.
        """
        src_mask = self._source_mask(src_tokens, padding)
        start = cache[0]["self"]["k"].size(2) if cache and "k" in cache[0]["self"] else 0
        x = self._embed(self.tgt_embed, tgt_tokens, start)
        # A whole target at once (no cache): its padding, hidden by causality, is skipped. Cached steps keep
        # every row, so that each row's cache grows by one.
        rows = TokenRows(tgt_tokens, self.pad_id, padding) if cache is None else None
        if rows is not None:
            x, targets = rows.pack(x), targets if targets is None else rows.pack(targets)
        for i, layer in enumerate(self.decoder_layers):
            x = layer(x, memory, src_mask, None if cache is None else cache[i], rows)
        out = self.output(self.decoder_norm(x), targets, label_smoothing)
        return out if rows is None or targets is not None else rows.unpack(out)

    def forward(self, src_tokens: torch.Tensor, tgt_tokens: torch.Tensor, targets: torch.Tensor | None = None,
                label_smoothing: float = 0.0, padding: Padding | None = None):
        """Logits, or with ``targets`` the training loss sums (see ``decode``); ``padding`` describes the batch
        (optional, see ``Padding``)."""
        return self.decode(tgt_tokens, self.encode(src_tokens, padding), src_tokens, targets=targets,
                           label_smoothing=label_smoothing, padding=padding)
