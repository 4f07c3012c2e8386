"""Data: raw parallel text → sentencepiece ids in memory-mapped arrays → token-bucketed, rank-sharded batches."""
