"""Model FLOPs of a training step (forward + backward), the convention MFU figures use.

6 × parameters × tokens, each token counted against the stack it passes (encoder for source tokens;
decoder and output projection for target tokens), plus attention's score and value products,
12 · d_model · query length · key length per layer and sentence (causal attention counted in full).
Padded positions count, as MFU conventions count them (dsmt's decoder and loss skip padded targets,
so it executes less: about 8% on Multi30k's bucketed batches).
"""


def numel(parameter) -> int:
    """Elements of the whole parameter, also when ZeRO-3 keeps only a shard of it here."""
    return getattr(parameter, "ds_numel", parameter.numel())


def parameter_counts(model) -> dict[str, int]:
    count = lambda modules: sum(numel(p) for m in modules for p in m.parameters())  # noqa: E731
    return {"encoder": count(model.encoder_layers), "decoder": count(model.decoder_layers),
            "output": numel(model.output.weight)}


def step_flops(cfg, params: dict, batch: int, src_len: int, tgt_len: int) -> float:
    dense = 6 * (params["encoder"] * src_len + (params["decoder"] + params["output"]) * tgt_len) * batch
    attention = 12 * cfg.d_model * batch * (cfg.n_encoder_layers * src_len ** 2
                                            + cfg.n_decoder_layers * (tgt_len ** 2 + src_len * tgt_len))
    return dense + attention

