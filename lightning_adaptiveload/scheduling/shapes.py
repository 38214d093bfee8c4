"""Sample shapes to token counts.

A sample's shape is given either in pixel space (frames, height, width), which the VAE
compresses by (temporal, spatial) strides, or directly in latent space (T, H, W). The DiT
then patchifies the latent with (pt, ph, pw). All counts here are tokens of the joint
sequence the transformer attends over.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lightning_adaptiveload._jsonl import iter_objects
from lightning_adaptiveload._validation import require_int


@dataclass(frozen=True)
class TokenSpec:
    """How a shape becomes a token count (defaults: Wan 2.1 VAE 4x8x8, patch 1x2x2)."""

    vae_stride_t: int = 4
    vae_stride_s: int = 8
    patch: tuple[int, int, int] = (1, 2, 2)
    extra_tokens: int = 0  # constant tokens joined to every sample (MMDiT text tokens)

    def __post_init__(self) -> None:
        require_int("TokenSpec.vae_stride_t", self.vae_stride_t)
        require_int("TokenSpec.vae_stride_s", self.vae_stride_s)
        if len(self.patch) != 3:
            raise ValueError(f"TokenSpec.patch must be three integers >= 1, got {self.patch}")
        for value in self.patch:
            require_int("TokenSpec.patch entries", value)
        require_int("TokenSpec.extra_tokens", self.extra_tokens, minimum=0)

    def latent_from_pixels(self, frames, height, width) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Latent (T, H, W) of pixel-space (frames, height, width): int64 arrays (0-d for ints)."""
        frames, height, width = (np.asarray(v, dtype=np.int64) for v in (frames, height, width))
        t = 1 + (frames - 1) // self.vae_stride_t
        return t, height // self.vae_stride_s, width // self.vae_stride_s

    def tokens_from_latent(self, t, h, w) -> int | np.ndarray:
        """Tokens of latent (T, H, W): ceil(T/pt) * (H//ph) * (W//pw) + extra_tokens; an int for scalar
        input, an int64 array for arrays."""
        pt, ph, pw = self.patch
        t, h, w = (np.asarray(v, dtype=np.int64) for v in (t, h, w))
        tokens = -(-t // pt) * (h // ph) * (w // pw) + self.extra_tokens
        return int(tokens) if tokens.ndim == 0 else tokens

    def tokens_from_pixels(self, frames, height, width) -> int | np.ndarray:
        """Tokens of pixel-space (frames, height, width)."""
        return self.tokens_from_latent(*self.latent_from_pixels(frames, height, width))


@dataclass(frozen=True)
class ShapeMix:
    """A histogram of sample shapes, one row per distinct line of a shapes file.

    tokens: (n,) int64 tokens per sample; counts: (n,) int64 samples of that shape;
    latent_thw: (n, 3) int64 latent (T, H, W), or -1 where the file gave tokens only.
    """

    tokens: np.ndarray
    counts: np.ndarray
    latent_thw: np.ndarray

    @property
    def num_samples(self) -> int:
        return int(self.counts.sum())

    def per_sample_tokens(self) -> np.ndarray:
        """(num_samples,) int64 tokens, the histogram expanded (rows in file order)."""
        return np.repeat(self.tokens, self.counts)


def read_shapes_jsonl(path: str | Path, spec: TokenSpec = TokenSpec()) -> ShapeMix:
    """Read a shapes file: one JSON object a line, either {"frames", "height", "width"} in
    pixels, {"latent_t", "latent_h", "latent_w"} in latent space, or {"tokens"}; each with an
    optional integer "count" (default 1). Blank lines are skipped. Errors name line and field."""
    path = str(path)
    tokens, counts, thw = [], [], []
    for line_no, row in iter_objects(path):
        where = f"{path}:{line_no}"

        def field(name: str, default=None) -> int:
            return require_int(f"{where}: field '{name}'", row.get(name, default))

        count = field("count", 1)
        if "tokens" in row:
            s = field("tokens")
            latent = (-1, -1, -1)
        elif {"frames", "height", "width"} <= row.keys():
            latent = tuple(int(v) for v in spec.latent_from_pixels(*(field(k) for k in ("frames", "height", "width"))))
            s = spec.tokens_from_latent(*latent)
        elif {"latent_t", "latent_h", "latent_w"} <= row.keys():
            latent = tuple(field(k) for k in ("latent_t", "latent_h", "latent_w"))
            s = spec.tokens_from_latent(*latent)
        else:
            raise ValueError(
                f"{path}:{line_no}: needs 'tokens', or 'frames'+'height'+'width', or "
                f"'latent_t'+'latent_h'+'latent_w'; got fields {sorted(row)}"
            )
        if s - spec.extra_tokens < 1:
            raise ValueError(f"{path}:{line_no}: shape {row} gives {s} tokens (too small for patch {spec.patch})")
        tokens.append(s)
        counts.append(count)
        thw.append(latent)
    if not tokens:
        raise ValueError(f"{path}: no shapes in file")
    return ShapeMix(
        tokens=np.asarray(tokens, dtype=np.int64),
        counts=np.asarray(counts, dtype=np.int64),
        latent_thw=np.asarray(thw, dtype=np.int64).reshape(-1, 3),
    )
