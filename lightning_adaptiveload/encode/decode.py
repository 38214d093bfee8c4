"""Pixels of one input, cut to the bucket grid: decode (PyAV for videos, Pillow for images),
resample to a target frame rate by timestamps, resize and center-crop to the chosen bucket's
resolution, and cut into windows of the grid's frame counts.

Frames are resampled by their presentation timestamps, not by their index: the output frame k
is the source frame on screen at t0 + k / fps. A clip's frame count at the target rate is its
duration times fps whatever the source rate (a 24 fps clip of 3 s gives 48 frames at 16 fps), and
variable-frame-rate files keep their timing; counting source frames as if they were at the
target rate makes 24 fps clips play 1.5x slow and buckets them by the wrong length.

Decoding streams: at most one window of frames at the bucket's resolution is held at a time
(81 x 720 x 1280 x 3 bytes = 224 MB), however long the source.
"""
from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from lightning_adaptiveload.encode._optional import require
from lightning_adaptiveload.encode.grid import (LONG_CLIPS, MAX_CROP, MAX_UPSCALE, Bucket, Fit, choose_resolution,
                                                fill_bucket, frame_buckets, resolutions)
from lightning_adaptiveload.encode.inputs import BadInput, InputItem, read_caption, read_media

_EPS = 1e-6  # seconds: timestamps are rationals rounded to floats; this keeps t_k == start on the right side


@dataclass
class Window:
    """One sample's pixels: `frames` (F, height, width, 3) uint8 RGB, window `index` of its input;
    `meta` goes into the sample's JSON (frames, height, width, fps, start_s, source_size, scale, crop,
    kind)."""

    item: InputItem
    index: int
    frames: torch.Tensor
    meta: dict


@dataclass
class Finished:
    """Every window of `item` was produced. What was cut: `tail_frames` frames at its end fit no
    bucket and were left out; `trimmed`: frames after its first window were left out (long="trim");
    `scale`: the resize factor of its frames (> 1: upscaled)."""

    item: InputItem
    caption: str
    windows: int
    tail_frames: int = 0
    trimmed: bool = False
    scale: float = 1.0


@dataclass
class Rejected:
    """`item` is a bad input: `reason` (BAD_INPUT_REASONS), `detail` names it and what is wrong."""

    item: InputItem
    reason: str
    detail: str


@dataclass(frozen=True)
class DecodePlan:
    """How inputs become windows: the bucket grid, the target frame rate (None: keep the source's
    frames, no resampling), what to do with clips longer than the largest frame bucket, and the
    most a source may be cropped (fraction of its frame cut away) or upscaled (factor per axis)
    to fit its bucket: beyond either it is a bad input ("bad_aspect", "too_small")."""

    grid: list[Bucket]
    fps: float | None = 16.0
    long: str = "windows"
    max_crop: float = MAX_CROP
    max_upscale: float = MAX_UPSCALE
    video_resolutions: list[tuple[int, int]] = field(init=False)
    image_resolutions: list[tuple[int, int]] = field(init=False)

    def __post_init__(self) -> None:
        if self.long not in LONG_CLIPS:
            raise ValueError(f"long must be one of {LONG_CLIPS}, got {self.long!r}")
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"fps must be > 0 or None, got {self.fps!r}")
        if not 0 <= self.max_crop <= 1:
            raise ValueError(f"max_crop must be in [0, 1] (a fraction of the frame), got {self.max_crop!r}")
        if not self.max_upscale >= 1:
            raise ValueError(f"max_upscale must be >= 1 (a scale factor), got {self.max_upscale!r}")
        object.__setattr__(self, "video_resolutions", resolutions(self.grid, video=True))
        object.__setattr__(self, "image_resolutions", resolutions(self.grid, video=False))


def resize_center_crop(frame: np.ndarray | torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(H, W, 3) uint8 -> (height, width, 3) uint8: scaled by one factor (aspect kept) so the frame
    covers the target, bilinear with antialiasing (Pillow's filter, so downscaling does not alias),
    then center-cropped. The only resampling between the decoder and the VAE."""
    x = torch.as_tensor(frame)
    src_h, src_w = x.shape[:2]
    scale = max(height / src_h, width / src_w)
    size = (max(height, round(src_h * scale)), max(width, round(src_w * scale)))
    x = x.permute(2, 0, 1)[None]
    if size != (src_h, src_w):
        x = F.interpolate(x.float(), size=size, mode="bilinear", antialias=True, align_corners=False)
        x = x.round_().clamp_(0, 255).to(torch.uint8)
    top, left = (size[0] - height) // 2, (size[1] - width) // 2
    return x[0, :, top: top + height, left: left + width].permute(1, 2, 0).contiguous()


def resample_by_time(timed: Iterable[tuple[float, float | None, object]], fps: float, default_duration: float
                     ) -> Iterator[tuple[float, object]]:
    """(t_k, frame) for t_k = t0 + k / fps, each the frame on screen at t_k: the last one whose
    presentation time is <= t_k. `timed`: (presentation time s, duration s or None, frame) in
    presentation order; a frame not later than the one before is dropped (broken timestamps).
    Only the last frame's duration is used (how long it stays on screen; `default_duration` where
    it is None); t0 is the first frame's time."""
    t0 = previous = None
    k = 0
    for start, duration, frame in timed:
        if previous is None:
            t0 = start
        elif start <= previous[0]:
            continue
        else:
            while t0 + k / fps < start - _EPS:
                yield t0 + k / fps, previous[2]
                k += 1
        previous = (start, duration, frame)
    if previous is not None:
        end = previous[0] + (previous[1] if previous[1] else default_duration)
        while t0 + k / fps < end - _EPS:
            yield t0 + k / fps, previous[2]
            k += 1


def fit_source(item: InputItem, plan: DecodePlan, height: int, width: int, video: bool) -> Fit:
    """The bucket resolution of a `height` x `width` source (`choose_resolution`), or BadInput
    "bad_aspect" when it would crop away more than plan.max_crop of the frame (no bucket of about
    its aspect ratio) or "too_small" when it would be upscaled more than plan.max_upscale."""
    fit = choose_resolution(height, width, plan.video_resolutions if video else plan.image_resolutions)
    bucket = f"{fit.resolution[0]}x{fit.resolution[1]}"
    if fit.crop > plan.max_crop + 1e-9:
        raise BadInput("bad_aspect", f"{item.where}: {height}x{width} (aspect {width / height:.2f}) is far from every "
                       f"bucket: the nearest, {bucket}, would crop away {fit.crop:.0%} of the frame, more than the "
                       f"allowed {plan.max_crop:.0%} (max_crop; add a bucket of its aspect to the grid)")
    if fit.scale > plan.max_upscale + 1e-9:
        raise BadInput("too_small", f"{item.where}: {height}x{width} would be upscaled {fit.scale:.2f}x to the "
                       f"smallest bucket of its aspect, {bucket}, more than the allowed {plan.max_upscale:g}x "
                       f"(max_upscale; add a smaller bucket to the grid)")
    return fit


class _WindowCutter:
    """Frames at the target rate in, windows out: resolution chosen from the first frame's size,
    frames resized as they arrive, a window of the largest frame bucket emitted whenever one is
    full (long="windows"), or decoding stopped after the first (long="trim"); the frames left at
    the end go to the largest bucket they fill (`finish`)."""

    def __init__(self, item: InputItem, plan: DecodePlan, height: int, width: int, fps: float | None):
        self.item, self.plan, self.fps = item, plan, fps
        self.source_size = [int(height), int(width)]
        self.fit = fit_source(item, plan, height, width, video=True)
        self.resolution = self.fit.resolution
        self.frames = frame_buckets(plan.grid, self.resolution, video=True)
        self.buffer: list[torch.Tensor] = []
        self.start_s: float | None = None
        self.windows = 0

    @property
    def done(self) -> bool:
        """No more frames wanted: long="trim" and the largest bucket is full."""
        return self.plan.long == "trim" and self.windows > 0

    def add(self, t: float, frame: torch.Tensor) -> Iterator[Window]:
        """Add one frame (height, width, 3) uint8 at the bucket's resolution, shown at `t` s."""
        if not self.buffer:
            self.start_s = t
        self.buffer.append(frame)
        if len(self.buffer) == self.frames[-1]:
            yield self._window(len(self.buffer))

    def _window(self, n: int) -> Window:
        height, width = self.resolution
        meta = {"kind": "video", "frames": n, "height": height, "width": width, "fps": self.fps,
                "start_s": round(self.start_s, 6), "source_size": self.source_size,
                "scale": round(self.fit.scale, 4), "crop": round(self.fit.crop, 4)}
        window = Window(self.item, self.windows, torch.stack(self.buffer[:n]), meta)
        self.buffer, self.windows = [], self.windows + 1
        return window

    def finish(self, caption: str, trimmed: bool) -> Iterator[Window | Finished]:
        """The last window (the frames left, in the largest bucket they fill), then Finished
        (`trimmed`: frames were left after the window long="trim" keeps). BadInput "too_short"
        when the clip fills no bucket at all."""
        left = len(self.buffer)
        n = fill_bucket(left, self.frames) if left else None
        if n is not None:
            yield self._window(n)
            left -= n
        if self.windows == 0:
            raise BadInput("too_short", f"{self.item.where}: {left} frames at "
                           f"{'the source rate' if self.plan.fps is None else f'{self.plan.fps:g} fps'}, the "
                           f"smallest frame bucket at {self.resolution[0]}x{self.resolution[1]} is {self.frames[0]}")
        yield Finished(self.item, caption, self.windows, left, trimmed, self.fit.scale)


def _video_windows(item: InputItem, plan: DecodePlan) -> Iterator[Window | Finished]:
    av = require("av")
    caption = read_caption(item)  # before decoding: a missing caption costs no decode
    if not plan.video_resolutions:
        raise BadInput("no_bucket", f"{item.where}: the bucket grid has no video bucket (frames > 1)")
    media = read_media(item)
    try:
        container = av.open(io.BytesIO(media) if isinstance(media, bytes) else media)
    except (av.FFmpegError, OSError, ValueError) as e:
        raise BadInput("undecodable", f"{item.where}: cannot open as a video: {e}") from None
    with container:
        if not container.streams.video:
            raise BadInput("undecodable", f"{item.where}: no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        rate = float(stream.average_rate) if stream.average_rate else None
        cutter, last, resized, trimmed = None, None, None, False
        try:
            timed = _timed_frames(container, stream, rate)
            frames = ((t, f) for t, _, f in timed) if plan.fps is None else \
                resample_by_time(timed, plan.fps, 1.0 / rate if rate else 0.0)
            for t, frame in frames:
                if cutter is None:
                    cutter = _WindowCutter(item, plan, frame.height, frame.width, plan.fps or rate)
                if frame is not last:  # a frame repeated by upsampling is converted once
                    last = frame
                    resized = resize_center_crop(frame.to_ndarray(format="rgb24"), *cutter.resolution)
                yield from cutter.add(t, resized)
                if cutter.done:
                    try:  # one more frame decoded: was anything cut?
                        trimmed = next(frames, None) is not None
                    except (av.FFmpegError, OSError, ValueError):
                        trimmed = True  # something follows, broken or not; the window kept is whole
                    break
        except BadInput:  # a ValueError too: not an undecodable file
            raise
        except (av.FFmpegError, OSError, ValueError) as e:
            raise BadInput("undecodable", f"{item.where}: decoding failed: {e}") from None
    if cutter is None:
        raise BadInput("undecodable", f"{item.where}: no frames decoded")
    yield from cutter.finish(caption, trimmed)


def _timed_frames(container, stream, rate: float | None) -> Iterator[tuple[float, float | None, object]]:
    """(presentation time s, duration s or None, av.VideoFrame) of the stream's frames."""
    for index, frame in enumerate(container.decode(stream)):
        if frame.time is not None:
            time = float(frame.time)
        elif rate:
            time = index / rate  # a stream without timestamps: its nominal rate is all there is
        else:
            raise ValueError("a frame has no timestamp and the stream no frame rate")
        duration = float(frame.duration * frame.time_base) if frame.duration and frame.time_base else None
        yield time, duration, frame


def _image_window(item: InputItem, plan: DecodePlan) -> Iterator[Window | Finished]:
    image_module = require("PIL.Image")
    ops = require("PIL.ImageOps")
    caption = read_caption(item)
    if not plan.image_resolutions:
        raise BadInput("no_bucket", f"{item.where}: the bucket grid has no image bucket (frames == 1)")
    media = read_media(item)
    try:
        with image_module.open(io.BytesIO(media) if isinstance(media, bytes) else media) as image:
            image = ops.exif_transpose(image).convert("RGB")  # as a viewer shows it: camera rotation applied
            pixels = np.array(image)  # a copy: Pillow's buffer is read-only
    except (OSError, ValueError, image_module.DecompressionBombError) as e:  # UnidentifiedImageError is an OSError
        raise BadInput("unreadable_image", f"{item.where}: {type(e).__name__}: {e}") from None
    fit = fit_source(item, plan, pixels.shape[0], pixels.shape[1], video=False)
    height, width = fit.resolution
    meta = {"kind": "image", "frames": 1, "height": height, "width": width, "fps": None, "start_s": 0.0,
            "source_size": [int(pixels.shape[0]), int(pixels.shape[1])], "scale": round(fit.scale, 4),
            "crop": round(fit.crop, 4)}
    yield Window(item, 0, resize_center_crop(pixels, height, width)[None], meta)
    yield Finished(item, caption, 1, scale=fit.scale)


def decode_item(item: InputItem, plan: DecodePlan) -> Iterator[Window | Finished | Rejected]:
    """The windows of one input, then Finished; or, for a bad input, Rejected (after any windows
    it yielded: the consumer drops them). Errors that are not the input's fault (out of memory,
    a bug) propagate with the input named."""
    try:
        yield from (_video_windows if item.kind == "video" else _image_window)(item, plan)
    except BadInput as e:
        yield Rejected(item, e.reason, e.detail)
    except (ImportError, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with the input named
        raise RuntimeError(f"{item.where}: decoding stopped: {type(e).__name__}: {e}") from e
