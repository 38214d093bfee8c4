"""The bucket grid of `adaptiveload encode`: which pixel shapes (frames, height, width) a clip or an
image is resized, cropped and cut to, and how a clip's frames become windows.

A grid is a list of `Bucket`s. Images (one frame) go to the buckets with frames == 1, videos to
those with frames > 1; each must follow the VAE's rules: frames F = stride_t * k + 1 (Wan 2.1:
F = 4k + 1, latent T = 1 + (F - 1) / 4), height and width multiples of stride_s * patch (Wan 2.1
with patch (1, 2, 2): 16), so the latent is a whole number of DiT patches.
No torch here: the planning is plain arithmetic, testable and cheap.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

from lightning_adaptiveload._jsonl import iter_objects
from lightning_adaptiveload._validation import require_int
from lightning_adaptiveload.scheduling.shapes import TokenSpec

LONG_CLIPS = ("windows", "trim")  # a clip longer than the largest frame bucket: cut into windows, or keep its start
ASPECT_TOLERANCE = 0.05  # |log aspect| differences within this of the nearest count as equally near (about 5 %)
MAX_CROP = 0.3     # default: a source whose nearest bucket would crop away more of its frame is a bad input
MAX_UPSCALE = 2.0  # default: a source that would be enlarged more than this (per axis) is a bad input

# (height, width) of the default grid, three tiers of about equal area each: Wan 2.1's own sizes
# 480x832 / 832x480 and 720x1280 / 1280x720 (landscape and portrait), squares of the same area
# (624x624, 960x960), and the reference mix's 256x448 tier with its portrait and square.
DEFAULT_RESOLUTIONS = ((256, 448), (448, 256), (336, 336), (480, 832), (832, 480), (624, 624),
                       (720, 1280), (1280, 720), (960, 960))
DEFAULT_FRAMES = (1, 17, 33, 49, 65, 81)  # images, and clips of 1 to 5 s at 16 fps (Wan 2.1: 81 frames)


class Bucket(NamedTuple):
    """One pixel shape of the grid: frames, height, width (pixels)."""

    frames: int
    height: int
    width: int


def read_bucket_grid(path: str | Path, spec: TokenSpec = TokenSpec()) -> list[Bucket]:
    """The distinct buckets of a shapes file (the format of `read_shapes_jsonl`; counts are
    ignored): pixel rows {"frames", "height", "width"}, or latent rows {"latent_t", "latent_h",
    "latent_w"}, converted to pixels with the strides of `spec`. Token-only rows name no shape and
    are an error naming `path:line`. The grid is checked with `check_grid`."""
    buckets = set()
    for line_no, row in iter_objects(path):
        where = f"{path}:{line_no}"
        if {"frames", "height", "width"} <= row.keys():
            bucket = Bucket(*(require_int(f"{where}: field '{k}'", row[k]) for k in ("frames", "height", "width")))
        elif {"latent_t", "latent_h", "latent_w"} <= row.keys():
            t, h, w = (require_int(f"{where}: field '{k}'", row[k]) for k in ("latent_t", "latent_h", "latent_w"))
            bucket = Bucket((t - 1) * spec.vae_stride_t + 1, h * spec.vae_stride_s, w * spec.vae_stride_s)
        else:
            raise ValueError(f"{where}: a bucket grid row needs 'frames'+'height'+'width' (pixels) or "
                             f"'latent_t'+'latent_h'+'latent_w'; got fields {sorted(row)}")
        buckets.add(bucket)
    if not buckets:
        raise ValueError(f"{path}: no buckets in file")
    return check_grid(sorted(buckets), spec, str(path))


def check_grid(buckets, spec: TokenSpec = TokenSpec(), where: str = "bucket grid") -> list[Bucket]:
    """`buckets` ((frames, height, width) triples or Buckets) as a sorted list of distinct Buckets,
    or a ValueError naming the first one that breaks the VAE's frame rule or is not a whole number
    of latent patches."""
    grid = sorted({Bucket(*(int(v) for v in b)) for b in buckets})
    if not grid:
        raise ValueError(f"{where}: no buckets")
    multiple = (spec.vae_stride_s * spec.patch[1], spec.vae_stride_s * spec.patch[2])
    for b in grid:
        if b.frames < 1 or (b.frames - 1) % spec.vae_stride_t:
            raise ValueError(f"{where}: bucket {b.frames}x{b.height}x{b.width}: frames must be {spec.vae_stride_t}k + 1 "
                             f"(the VAE's temporal stride {spec.vae_stride_t}), got {b.frames}")
        if b.height < multiple[0] or b.height % multiple[0] or b.width < multiple[1] or b.width % multiple[1]:
            raise ValueError(f"{where}: bucket {b.frames}x{b.height}x{b.width}: height and width must be multiples of "
                             f"{multiple[0]} and {multiple[1]} (VAE stride {spec.vae_stride_s} x patch "
                             f"{spec.patch[1:]})")
    return grid


DEFAULT_GRID = sorted(Bucket(f, h, w) for f in DEFAULT_FRAMES for h, w in DEFAULT_RESOLUTIONS)


class Fit(NamedTuple):
    """How a source of (height, width) pixels goes into `resolution`: scaled by `scale` (one factor
    for both axes, the smallest that covers the bucket: max(bucket h / h, bucket w / w); > 1 is an
    upscale), then center-cropped along one axis, cutting away the fraction `crop` of the scaled
    frame (0: same aspect ratio)."""

    resolution: tuple[int, int]
    scale: float
    crop: float


def fit_resolution(height: int, width: int, resolution: tuple[int, int]) -> Fit:
    """The `Fit` of a `height` x `width` source into `resolution` (height, width)."""
    scale = max(resolution[0] / height, resolution[1] / width)
    return Fit(tuple(resolution), scale, 1.0 - resolution[0] * resolution[1] / (scale * scale * height * width))


def choose_resolution(height: int, width: int, resolutions, tolerance: float = ASPECT_TOLERANCE) -> Fit:
    """The `Fit` of the (height, width) of `resolutions` a source of `height` x `width` pixels is
    resized and center-cropped to: of those whose aspect ratio is nearest the source's (|log(w/h)|
    distance, within `tolerance` of the nearest), the largest (by area) that needs no upscaling on
    either axis (bucket height <= height and bucket width <= width), or, if every one would
    upscale, the one that upscales least. Nearest aspect first keeps the crop small (a portrait
    clip goes to a portrait bucket when the grid has one); the per-axis size rule keeps a 480p clip
    at 480p instead of blowing it up to a 720p bucket of about the same aspect. Whether the crop or
    the upscale is acceptable is the caller's call (`MAX_CROP`, `MAX_UPSCALE`)."""
    if height < 1 or width < 1:
        raise ValueError(f"source size must be positive, got {height}x{width}")
    resolutions = sorted(set(resolutions))
    if not resolutions:
        raise ValueError("no resolutions to choose from")
    target = math.log(width / height)
    distance = {r: abs(math.log(r[1] / r[0]) - target) for r in resolutions}
    best = min(distance.values())
    near = [fit_resolution(height, width, r) for r in resolutions if distance[r] <= best + tolerance]
    fits = [f for f in near if f.scale <= 1.0]
    if fits:
        return max(fits, key=lambda f: (f.resolution[0] * f.resolution[1], -distance[f.resolution]))
    return min(near, key=lambda f: (f.scale, distance[f.resolution]))


def frame_buckets(grid: list[Bucket], resolution: tuple[int, int], video: bool) -> list[int]:
    """Sorted frame counts of the grid's buckets at `resolution`: those > 1 for a video, [1] for an image."""
    frames = {b.frames for b in grid if (b.height, b.width) == tuple(resolution)}
    return sorted(f for f in frames if (f > 1) == video)


def resolutions(grid: list[Bucket], video: bool) -> list[tuple[int, int]]:
    """(height, width) of the grid's video buckets (frames > 1) or image buckets (frames == 1)."""
    return sorted({(b.height, b.width) for b in grid if (b.frames > 1) == video})


def fill_bucket(available: int, frames: list[int]) -> int | None:
    """The largest frame count of `frames` (sorted) that `available` frames fill, or None if even the
    smallest needs more."""
    filled = [f for f in frames if f <= available]
    return filled[-1] if filled else None
