"""The bucket grid: reading and checking it, the resolution a source gets, the frame bucket it fills."""
import json

import pytest

from lightning_adaptiveload.encode.grid import (REFERENCE_MIX, Bucket, check_grid, choose_resolution, fill_bucket,
                                                frame_buckets, read_bucket_grid, resolutions)
from lightning_adaptiveload.scheduling.shapes import TokenSpec


def test_reference_grid_is_the_reference_mix_shapes_and_follows_the_frame_rule():
    grid = read_bucket_grid(REFERENCE_MIX)
    rows = [json.loads(line) for line in REFERENCE_MIX.read_text().splitlines() if line.strip()]
    assert grid == sorted({Bucket(r["frames"], r["height"], r["width"]) for r in rows})
    assert {b.frames for b in grid} == {1, 17, 33, 49, 65, 81}
    assert all((b.frames - 1) % 4 == 0 and b.height % 16 == 0 and b.width % 16 == 0 for b in grid)


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


def test_resolution_nearest_aspect_then_largest_without_upscaling():
    video = resolutions(read_bucket_grid(REFERENCE_MIX), video=True)
    assert video == [(256, 448), (480, 832), (720, 1280)]
    # all three are ~16:9 (log-aspect within 0.025 of each other): size decides, never upscaling
    assert choose_resolution(1080, 1920, video) == (720, 1280)
    assert choose_resolution(720, 1280, video) == (720, 1280)
    assert choose_resolution(480, 854, video) == (480, 832)     # 480 * 832 <= 480 * 854
    assert choose_resolution(360, 640, video) == (256, 448)
    assert choose_resolution(100, 160, video) == (256, 448)     # everything upscales: the smallest
    image = resolutions(read_bucket_grid(REFERENCE_MIX), video=False)
    assert choose_resolution(1024, 1024, image) == (512, 512)   # square buckets are nearest
    assert choose_resolution(400, 400, image) == (256, 256)
    assert choose_resolution(1080, 1920, image) == (720, 1280)
    # a portrait source with only landscape buckets: nearest aspect is the squarest one
    assert choose_resolution(1280, 720, [(32, 96), (32, 48)]) == (32, 48)


def test_fill_bucket_and_frame_buckets():
    grid = check_grid([(1, 32, 32), (5, 32, 32), (9, 32, 32), (17, 32, 48)])
    assert frame_buckets(grid, (32, 32), video=True) == [5, 9]
    assert frame_buckets(grid, (32, 32), video=False) == [1]
    assert frame_buckets(grid, (32, 48), video=False) == []
    assert [fill_bucket(n, [5, 9, 17]) for n in (4, 5, 8, 9, 16, 17, 100)] == [None, 5, 5, 9, 9, 17, 17]
