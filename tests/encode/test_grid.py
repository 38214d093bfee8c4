"""The bucket grid: reading and checking it, the resolution a source gets, the frame bucket it fills."""
import json

import pytest

import math
from pathlib import Path

import numpy as np

from lightning_adaptiveload.encode.grid import (DEFAULT_GRID, MAX_CROP, Bucket, check_grid, choose_resolution,
                                                fill_bucket, fit_resolution, frame_buckets, read_bucket_grid,
                                                resolutions)
from lightning_adaptiveload.scheduling.shapes import TokenSpec

REFERENCE_MIX = Path(__file__).resolve().parents[2] / "lightning_adaptiveload" / "data" / "reference_mix.jsonl"


def test_default_grid_has_wan_sizes_in_every_orientation_and_follows_the_frame_rule():
    grid = check_grid(DEFAULT_GRID)
    assert grid == DEFAULT_GRID
    assert {b.frames for b in grid} == {1, 17, 33, 49, 65, 81}
    assert all((b.frames - 1) % 4 == 0 and b.height % 16 == 0 and b.width % 16 == 0 for b in grid)
    rows = [json.loads(line) for line in REFERENCE_MIX.read_text().splitlines() if line.strip()]
    landscape = {(r["height"], r["width"]) for r in rows if r["frames"] > 1}
    video = set(resolutions(grid, video=True))
    assert video == set(resolutions(grid, video=False))  # images at every clip resolution
    # Wan 2.1's sizes, the reference mix's clip sizes, each transposed, and a square of about the same area
    assert {(480, 832), (832, 480), (720, 1280), (1280, 720)} <= video and landscape <= video
    for h, w in landscape:
        assert (w, h) in video
        side = next(s for s, t in video if s == t and abs(s * s / (h * w) - 1) < 0.03)
        assert side % 16 == 0
    assert len(video) == 3 * len(landscape)


def test_latent_rows_become_pixel_buckets(tmp_path):
    path = tmp_path / "grid.jsonl"
    path.write_text('{"latent_t": 5, "latent_h": 4, "latent_w": 6, "count": 3}\n'
                    '{"frames": 1, "height": 32, "width": 32}\n')
    assert read_bucket_grid(path) == [Bucket(1, 32, 32), Bucket(17, 32, 48)]


@pytest.mark.parametrize("row, match", [
    ({"frames": 16, "height": 32, "width": 32}, "4k \\+ 1"),
    ({"frames": 17, "height": 40, "width": 32}, "multiples of 16"),
    ({"tokens": 100}, "grid.jsonl:2: a bucket grid row needs"),
])
def test_bad_rows_are_named(tmp_path, row, match):
    path = tmp_path / "grid.jsonl"
    path.write_text('{"frames": 1, "height": 32, "width": 32}\n' + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=match):
        read_bucket_grid(path)


def test_grid_rules_follow_the_token_spec():
    spec = TokenSpec(vae_stride_t=2, vae_stride_s=4, patch=(1, 1, 1))
    assert check_grid([(3, 4, 8)], spec) == [Bucket(3, 4, 8)]  # 2k + 1 frames, multiples of 4
    with pytest.raises(ValueError, match="2k \\+ 1"):
        check_grid([(4, 4, 8)], spec)


def test_resolution_nearest_aspect_then_largest_without_upscaling_on_either_axis():
    video = resolutions(DEFAULT_GRID, video=True)
    pick = {(h, w): choose_resolution(h, w, video).resolution for h, w in [
        (1080, 1920), (720, 1280), (480, 854), (360, 640), (100, 160),  # landscape
        (1920, 1080), (848, 480), (640, 360),                           # portrait: portrait buckets
        (1080, 1080), (640, 640), (400, 400), (200, 200)]}              # square: square buckets
    assert pick == {(1080, 1920): (720, 1280), (720, 1280): (720, 1280), (480, 854): (480, 832),
                    (360, 640): (256, 448), (100, 160): (256, 448),
                    (1920, 1080): (1280, 720), (848, 480): (832, 480), (640, 360): (448, 256),
                    (1080, 1080): (960, 960), (640, 640): (624, 624), (400, 400): (336, 336), (200, 200): (336, 336)}
    # per axis, not by area: 400x1000 has more pixels than 480x832 (400,000 > 399,360) but is 80 rows short
    assert choose_resolution(400, 1000, video).resolution == (256, 448)
    assert 480 * 832 < 400 * 1000
    # everything upscales: the least upscale, here 2.8x (448 / 160)
    tiny = choose_resolution(100, 160, video)
    assert tiny.scale == 448 / 160
    # a portrait source with only landscape buckets: nearest aspect is the squarest one
    assert choose_resolution(1280, 720, [(32, 96), (32, 48)]).resolution == (32, 48)


def test_fit_scale_and_crop_against_the_aspect_ratios():
    rng = np.random.default_rng(0)
    for h, w, bh, bw in rng.integers(16, 2000, (500, 4)):
        fit = fit_resolution(int(h), int(w), (int(bh), int(bw)))
        assert fit.scale == max(bh / h, bw / w)  # the smallest factor with both axes covered
        assert h * fit.scale >= bh - 1e-9 and w * fit.scale >= bw - 1e-9
        # one axis is cut: the kept fraction is the ratio of the two aspect ratios, the smaller over the larger
        ratio = (bw / bh) / (w / h)
        assert math.isclose(fit.crop, 1 - min(ratio, 1 / ratio), abs_tol=1e-12)


def test_default_grid_crops_at_most_a_quarter_between_9_16_and_16_9_and_rejects_3_1():
    video = resolutions(DEFAULT_GRID, video=True)
    crops = [choose_resolution(2000, round(2000 * a), video).crop for a in np.geomspace(9 / 16, 16 / 9, 400)]
    assert max(crops) <= 0.25 + 1e-12 < MAX_CROP  # worst: 4:3, halfway (in log aspect) between square and 16:9
    assert choose_resolution(3000, 4000, video).crop == pytest.approx(0.25)
    assert choose_resolution(1000, 3000, video).crop > MAX_CROP  # 3:1 panorama: far from every bucket


def test_fill_bucket_and_frame_buckets():
    grid = check_grid([(1, 32, 32), (5, 32, 32), (9, 32, 32), (17, 32, 48)])
    assert frame_buckets(grid, (32, 32), video=True) == [5, 9]
    assert frame_buckets(grid, (32, 32), video=False) == [1]
    assert frame_buckets(grid, (32, 48), video=False) == []
    assert [fill_bucket(n, [5, 9, 17]) for n in (4, 5, 8, 9, 16, 17, 100)] == [None, 5, 5, 9, 9, 17, 17]
