"""Collation: decoded samples of one bucket -> the batch dict (docs/data.md).

latents (B, C, T, H, W) float32, text (B, L, D_text) float32, seq_len int (tokens per sample),
latent_shape (T, H, W), keys list[str], and "skipped" (reason -> count) for the DataModule.
"""
from __future__ import annotations

from collections import Counter

import torch

from lightning_adaptiveload.data.shards import SKIPPED_KEY, failed_batch, write_text


def collate_samples(samples: list[dict], text_len: int, text_dim: int) -> dict:
    """Batch dict of decoded samples, written straight into float32 batch tensors; skip markers
    ({"key", "skip": reason, "detail"}) become batch["skipped"] (reason -> count). Samples whose
    shape differs from the batch's most common one (two unplanned shapes with equal tokens in one
    streaming bucket) are skipped as "shape_collision". If no sample of the batch survived: a
    `failed_batch` marker, on which `on_before_batch_transfer` stops every rank together."""
    good = [s for s in samples if "skip" not in s]
    skipped = Counter(s["skip"] for s in samples if "skip" in s)
    if not good:
        return failed_batch(samples)
    shape = Counter(s["latent_shape"] for s in good).most_common(1)[0][0]  # ties: the first sample's
    skipped["shape_collision"] += sum(s["latent_shape"] != shape for s in good)
    good = [s for s in good if s["latent_shape"] == shape]
    latents = torch.empty(len(good), *good[0]["latent"].shape)
    text = torch.empty(len(good), text_len, text_dim)
    for i, sample in enumerate(good):
        latents[i].copy_(sample["latent"])
        write_text(text[i], sample)
    return {
        "latents": latents,
        "text": text,
        "seq_len": int(good[0]["seq_len"]),
        "latent_shape": tuple(shape),
        "keys": [s["key"] for s in good],
        SKIPPED_KEY: {k: v for k, v in skipped.items() if v},
    }


def as_is(batch):
    """Collate function of loaders whose dataset yields finished batches: the default one would
    turn latent_shape tuples into lists."""
    return batch
