import math
from concurrent.futures import ThreadPoolExecutor
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from dsmt.config import ModelConfig, load_config
from dsmt.model import Attention, Dropout, Padding, Transformer, key_padding_mask
from dsmt.engine import free_port

PAD = 0


def tiny_config(**kw) -> ModelConfig:
    base = dict(vocab_size=50, d_model=32, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=64,
                dropout=0.1, pad_id=PAD)
    base.update(kw)
    return ModelConfig(**base)


def padded_batch(lengths, max_len=None, seed=0):
    """Right-padded random token rows of the given lengths (ids 1..vocab-1, never PAD)."""
    g = torch.Generator().manual_seed(seed)
    width = max_len or max(lengths)
    rows = torch.full((len(lengths), width), PAD, dtype=torch.long)
    for i, n in enumerate(lengths):
        rows[i, :n] = torch.randint(1, 50, (n,), generator=g)
    return rows


@pytest.fixture(params=[dict(norm_first=True), dict(norm_first=False, share_embeddings=False, positions="learned")],
                ids=["prenorm-shared", "postnorm-separate-learned"])
def model(request):
    torch.manual_seed(0)
    return Transformer(tiny_config(**request.param)).eval()


SRC_LENS = [7, 3, 5, 9, 1, 4, 6, 2]
TGT_LENS = [5, 6, 2, 8, 3, 1, 7, 4]


def real_positions_close(a, b, tgt, atol=1e-5):
    real = tgt != PAD
    return torch.allclose(a[real], b[real], atol=atol)


@pytest.mark.parametrize("sizes", [[3, 5], [1] * 8, [4, 4], [2, 3, 3]])
def test_batch_split_invariance(model, sizes):
    src, tgt = padded_batch(SRC_LENS, seed=1), padded_batch(TGT_LENS, seed=2)
    with torch.no_grad():
        full = model(src, tgt)
        parts = [model(s, t) for s, t in zip(src.split(sizes), tgt.split(sizes))]
    # Each split is re-padded only as wide as the whole batch, so shapes agree for the concatenation.
    assert full.shape == (8, tgt.size(1), 50)
    assert torch.allclose(full, torch.cat(parts), atol=1e-5)


def test_split_with_own_padding_width(model):
    """A split trimmed to its own longest row (as a per-GPU collate would) still matches."""
    src, tgt = padded_batch(SRC_LENS, seed=1), padded_batch(TGT_LENS, seed=2)
    with torch.no_grad():
        full = model(src, tgt)
        for rows in (slice(0, 3), slice(3, 8), slice(4, 5)):
            s, t = src[rows], tgt[rows]
            s, t = s[:, : int((s != PAD).sum(1).max())], t[:, : int((t != PAD).sum(1).max())]
            part = model(s, t)
            assert torch.allclose(full[rows, : t.size(1)][t != PAD], part[t != PAD], atol=1e-5)


def test_padding_invariance(model):
    src, tgt = padded_batch(SRC_LENS, seed=3), padded_batch(TGT_LENS, seed=4)
    wide_src = nn.functional.pad(src, (0, 5), value=PAD)
    wide_tgt = nn.functional.pad(tgt, (0, 4), value=PAD)
    with torch.no_grad():
        reference = model(src, tgt)
        assert real_positions_close(model(wide_src, tgt), reference, tgt)
        assert real_positions_close(model(src, wide_tgt)[:, : tgt.size(1)], reference, tgt)
        assert real_positions_close(model(wide_src, wide_tgt)[:, : tgt.size(1)], reference, tgt)


def test_causality(model):
    src, tgt = padded_batch([6, 6], seed=5), padded_batch([8, 8], seed=6)
    with torch.no_grad():
        reference = model(src, tgt)
        for t in range(8):
            changed = tgt.clone()
            changed[:, t] = tgt[:, t] % 49 + 1  # another id in 1..49
            out = model(src, changed)
            assert torch.allclose(out[:, :t], reference[:, :t], atol=1e-6)
            assert not torch.allclose(out[:, t:], reference[:, t:], atol=1e-6)


def reference_attention(attn: Attention, x, memory, keep=None, causal=False):
    """softmax(QK^T / sqrt(d)) V with explicit masks, from the module's own projection weights."""
    d = x.size(-1)
    if memory is None:
        q, k, v = attn.qkv(x).chunk(3, dim=-1)
    else:
        q, (k, v) = attn.q(x), attn.kv(memory).chunk(2, dim=-1)
    heads = lambda t: t.view(t.size(0), t.size(1), attn.n_heads, -1).transpose(1, 2)
    q, k, v = heads(q), heads(k), heads(v)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d // attn.n_heads)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    if causal:
        lq, lk = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(1), float("-inf"))
    out = scores.softmax(-1) @ v
    return attn.out(out.transpose(1, 2).flatten(2))


def test_fused_attention_equals_reference():
    torch.manual_seed(0)
    x, memory = torch.randn(4, 6, 32), torch.randn(4, 9, 32)
    src = padded_batch([9, 4, 1, 7])
    keep = key_padding_mask(src, PAD)
    self_attn = Attention(32, 4, 0.0, self_attention=True).eval()
    cross_attn = Attention(32, 4, 0.0, self_attention=False).eval()
    with torch.no_grad():
        assert torch.allclose(self_attn(x, causal=True), reference_attention(self_attn, x, None, causal=True),
                              atol=1e-5)
        assert torch.allclose(self_attn(memory, mask=keep), reference_attention(self_attn, memory, None, keep),
                              atol=1e-5)
        assert torch.allclose(cross_attn(x, memory, mask=keep), reference_attention(cross_attn, x, memory, keep),
                              atol=1e-5)


def test_key_projections_have_no_bias(model):
    """Softmax cancels a key bias, so its gradient is only round-off: it is kept at zero, and ignored if set."""
    src, tgt = padded_batch(SRC_LENS, seed=3), padded_batch(TGT_LENS, seed=4)
    model.train()
    model(src, tgt).square().sum().backward()
    projections = [m for m in model.modules() if hasattr(m, "key_bias")]
    assert len(projections) == 6  # the self-attention qkv of every layer, the cross-attention kv of the decoder's
    for projection in projections:
        assert projection.key_bias.sum() == 32
        assert projection.bias.grad[projection.key_bias].eq(0).all()
        assert projection.bias.grad[~projection.key_bias].ne(0).all()
    model.eval()
    with torch.no_grad():
        before = model(src, tgt)
        for projection in projections:
            projection.bias[projection.key_bias] = 1.0
        assert torch.equal(model(src, tgt), before)


def test_all_padding_rows_are_finite(model):
    eos = 3
    src = torch.tensor([[eos, PAD, PAD, PAD], [PAD, PAD, PAD, PAD], [5, 6, 7, eos]])
    tgt = torch.tensor([[2, 9, PAD], [PAD, PAD, PAD], [2, 4, 5]])
    model.train()  # dropout paths too
    logits = model(src, tgt)
    assert torch.isfinite(logits).all()
    logits.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_no_mask_argument_in_forward():
    import inspect

    arguments = list(inspect.signature(Transformer.forward).parameters)
    assert arguments[:3] == ["self", "src_tokens", "tgt_tokens"] and not any("mask" in a for a in arguments)


def test_forward_with_targets_is_the_loss_of_its_logits(model):
    """The training path (loss without all logits at once) gives the loss, and the parameter gradients,
    of label-smoothed cross-entropy on the logits the plain forward returns."""
    src, tgt = padded_batch(SRC_LENS, seed=3), padded_batch(TGT_LENS, seed=4)
    tgt_in, targets = tgt[:, :-1], tgt[:, 1:]
    loss, nll = model(src, tgt_in, targets, label_smoothing=0.1)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = model(src, tgt_in).flatten(0, 1)
    expected = F.cross_entropy(logits, targets.flatten(), ignore_index=PAD, label_smoothing=0.1, reduction="sum")
    expected.backward()
    assert torch.allclose(loss, expected, rtol=1e-5)
    assert torch.allclose(nll, F.cross_entropy(logits, targets.flatten(), ignore_index=PAD, reduction="sum"), rtol=1e-5)
    assert all(torch.allclose(g, p.grad, atol=1e-5) for g, p in zip(grads, model.parameters()))


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_dropout_rate_scale_gradient_and_seed(p):
    x = torch.rand(500, 400) + 1.0  # never 0, so a zero output is a dropped element
    x.requires_grad_()
    dropout = Dropout(p)
    torch.manual_seed(0)
    y = dropout(x)
    dropped = y == 0
    assert abs(dropped.float().mean().item() - p) < 0.005
    kept_scale = (y[~dropped] / x[~dropped]).detach()
    assert torch.allclose(kept_scale, torch.full_like(kept_scale, 1 / (1 - p)), rtol=1e-4)
    y.sum().backward()
    assert torch.allclose(x.grad, torch.where(dropped, 0.0, 1 / (1 - p)), rtol=1e-4)
    torch.manual_seed(0)
    assert torch.equal(dropout(x), y)  # the mask comes from torch's generator: a reseeded run redraws it
    assert not torch.equal(dropout(x), y)
    assert torch.equal(dropout.eval()(x), x) and torch.equal(Dropout(0.0)(x), x)


def test_data_parallel_wrapper_and_its_scatter(model):
    """nn.DataParallel on CPU runs the module directly; on GPUs it chunks the batch along dim 0 and runs a
    replica per chunk in threads, emulated here (parallel_apply itself needs an accelerator)."""
    src, tgt = padded_batch(SRC_LENS, seed=7), padded_batch(TGT_LENS, seed=8)
    with torch.no_grad():
        reference = model(src, tgt)
        assert torch.allclose(nn.DataParallel(model)(src, tgt), reference, atol=1e-6)
        chunks = list(zip(src.chunk(3), tgt.chunk(3)))
        with ThreadPoolExecutor(len(chunks)) as pool:
            outputs = list(pool.map(lambda args: model(*args), chunks))
    assert torch.allclose(torch.cat(outputs), reference, atol=1e-5)


class HostSyncWatch(TorchFunctionMode):
    """Records every call that makes the host wait for a device's data (a nonzero, a boolean index, a value
    read back) and the attention mask each SDPA call gets."""

    READS = {"nonzero", "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "masked_select", "cpu",
             "numpy", "unique", "argwhere", "nonzero_static"}

    def __init__(self):
        super().__init__()
        self.syncs, self.masks, self.kernels = [], [], set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func is F.scaled_dot_product_attention:
            self.masks.append(kwargs.get("attn_mask", args[3] if len(args) > 3 else None))
            backends = torch.backends.cuda
            self.kernels.add((backends.flash_sdp_enabled(), backends.mem_efficient_sdp_enabled(),
                              backends.math_sdp_enabled(), backends.cudnn_sdp_enabled()))
        if name in self.READS:
            self.syncs.append(name)
        if name in ("__getitem__", "__setitem__", "index_put_", "index_put") and any(
                isinstance(a, torch.Tensor) and a.dtype == torch.bool
                for a in (args[1] if isinstance(args[1], tuple) else (args[1],))):
            self.syncs.append(f"{name} with a boolean index")
        return func(*args, **kwargs)


def training_pass(model, src, tgt_in, tgt_out, padding=None):
    """Loss sums and parameter gradients of one training forward and backward."""
    model.zero_grad()
    torch.manual_seed(0)
    loss, nll = model(src, tgt_in, tgt_out, label_smoothing=0.1, padding=padding)
    loss.backward()
    return loss.detach(), nll, [p.grad.clone() for p in model.parameters()]


def padding_of(src, tgt):
    return Padding.of_lengths((src != PAD).sum(1).numpy(), (tgt != PAD).sum(1).numpy(), src.size(1), tgt.size(1))


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_training_pass_with_host_padding_has_no_host_sync_and_equals_the_token_derived_one(model, padded):
    """With the ``Padding`` built on the host, a training forward and backward reads nothing back from the device,
    a batch without source padding reaches SDPA without a mask (FlashAttention's condition) and never cuDNN's
    kernel, and the loss and gradients equal those of the path that derives everything from the tokens."""
    model.train()
    lengths = (SRC_LENS, TGT_LENS) if padded else ([6] * 8, [5] * 8)
    src, tgt = padded_batch(lengths[0], seed=11), padded_batch([n + 1 for n in lengths[1]], seed=12)
    tgt_in, tgt_out = tgt[:, :-1].clone(), tgt[:, 1:].clone()
    tgt_in[tgt_out == PAD] = PAD  # the targets' padding where the inputs' is, as collate makes them
    padding = padding_of(src, tgt_in)
    assert padding.src_padded == padded
    with HostSyncWatch() as watch:
        loss, nll, grads = training_pass(model, src, tgt_in, tgt_out, padding)
    assert watch.syncs == []
    # cuDNN's attention plans every new shape on the host (~10 ms a call): SDPA may use Flash, memory-efficient, math
    assert watch.kernels == {(True, True, True, False)}
    masks, decoder_layers = watch.masks, len(model.decoder_layers)
    assert len(masks) == len(model.encoder_layers) + 2 * decoder_layers
    if padded:  # encoder self-attention and cross-attention mask the source padding; decoder self-attention is causal
        assert sum(m is None for m in masks) == decoder_layers
    else:
        assert all(m is None for m in masks)
    with HostSyncWatch() as watch:
        expected_loss, expected_nll, expected_grads = training_pass(model, src, tgt_in, tgt_out)
    assert "nonzero" in watch.syncs  # the token-derived path has to ask the device
    assert torch.allclose(loss, expected_loss, rtol=1e-5) and torch.allclose(nll, expected_nll, rtol=1e-5)
    assert all(torch.allclose(g, e, atol=1e-5) for g, e in zip(grads, expected_grads))


def test_padding_of_another_shape_is_ignored(model):
    """A wrapper that splits the batch hands each part the whole batch's ``Padding``: its shapes no longer match,
    and each part then reads its own tokens, so the outputs equal the unhinted ones."""
    src, tgt = padded_batch(SRC_LENS, seed=13), padded_batch(TGT_LENS, seed=14)
    whole = padding_of(src, tgt)
    with torch.no_grad():
        reference = model(src, tgt)
        assert torch.allclose(model(src, tgt, padding=whole), reference, atol=1e-6)
        parts = [model(s, t, padding=whole) for s, t in zip(src.split([3, 5]), tgt.split([3, 5]))]
    assert torch.allclose(torch.cat(parts), reference, atol=1e-5)


def _ddp_worker(rank, world, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Transformer(tiny_config(dropout=0.0)))
    # Each rank holds a different number of rows and a different padded width.
    lens = [SRC_LENS[:3], SRC_LENS[3:]][rank]
    src, tgt = padded_batch(lens, seed=10 + rank), padded_batch(TGT_LENS[: len(lens)], seed=20 + rank)
    model(src, tgt).sum().backward()
    results[rank] = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.destroy_process_group()


@pytest.mark.slow
def test_distributed_data_parallel_two_processes():
    results = mp.Manager().dict()
    mp.spawn(_ddp_worker, args=(2, free_port(), results), nprocs=2)
    # DDP averaged the gradients, so both ranks hold the same finite gradient.
    assert torch.isfinite(results[0]).all() and results[0].abs().sum() > 0
    assert torch.allclose(results[0], results[1])

    # The average equals the mean of the two ranks' single-process gradients.
    torch.manual_seed(0)
    single = Transformer(tiny_config(dropout=0.0))
    grads = []
    for rank, lens in enumerate([SRC_LENS[:3], SRC_LENS[3:]]):
        single.zero_grad()
        src, tgt = padded_batch(lens, seed=10 + rank), padded_batch(TGT_LENS[: len(lens)], seed=20 + rank)
        single(src, tgt).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in single.parameters()]))
    assert torch.allclose(results[0], (grads[0] + grads[1]) / 2, atol=1e-5)


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())


def test_transformer_base_parameter_count():
    cfg = load_config(overrides=["model.preset=transformer_base", "model.vocab_size=37000"]).model
    n = count_parameters(Transformer(cfg))
    assert 60e6 <= n <= 66e6, n


def test_presets_have_the_documented_shapes():
    big = load_config(overrides=["model.preset=transformer_big"]).model
    assert (big.d_model, big.n_heads, big.n_encoder_layers, big.n_decoder_layers, big.d_ff) == (1024, 16, 6, 6, 4096)
    small = load_config(overrides=["model.preset=small", "model.d_ff=512"]).model
    assert (small.d_model, small.n_heads, small.n_encoder_layers, small.d_ff) == (256, 4, 3, 512)


def test_shared_embeddings_tie_all_three():
    m = Transformer(tiny_config(share_embeddings=True))
    assert m.src_embed.weight is m.tgt_embed.weight is m.output.weight
    m = Transformer(tiny_config(share_embeddings=False))
    assert m.src_embed.weight is not m.tgt_embed.weight and m.output.weight is not m.tgt_embed.weight
