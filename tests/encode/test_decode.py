"""Decoding: frames resampled by timestamps, windows vs trim, resize + center crop, images."""
import numpy as np
import pytest

from lightning_adaptiveload.encode.decode import (DecodePlan, Finished, Window, decode_item, resample_by_time,
                                                  resize_center_crop)
from lightning_adaptiveload.encode.grid import DEFAULT_GRID, check_grid
from lightning_adaptiveload.encode.inputs import list_inputs

from tests.encode.conftest import GRID, index_video, read_index, write_image


def _decode(tmp_path, name, plan, caption="a cat"):
    (tmp_path / name).with_suffix(".txt").write_text(caption)
    item = next(i for i in list_inputs(tmp_path) if i.id == name)
    return list(decode_item(item, plan))


def test_resample_by_time_picks_the_frame_on_screen():
    timed = [(0.0, None, "a"), (0.1, None, "b"), (0.1, None, "dup"), (0.35, 0.05, "c")]
    out = list(resample_by_time(timed, fps=10, default_duration=1.0))
    # t = 0.0 a, 0.1 b, 0.2 b, 0.3 b, 0.35 + 0.05 = 0.4 is where c ends: c shown at 0.35 only, no t_k in [0.35, 0.4)
    assert [f for _, f in out] == ["a", "b", "b", "b"]
    out = list(resample_by_time([(1.0, None, "a"), (1.5, None, "b")], fps=4, default_duration=0.5))
    assert [(t, f) for t, f in out] == [(1.0, "a"), (1.25, "a"), (1.5, "b"), (1.75, "b")]


@pytest.mark.parametrize("long, windows", [("windows", [17, 9]), ("trim", [17])])
def test_24fps_clip_at_16fps_windows_and_trim(tmp_path, long, windows):
    # 48 frames at 24 fps = 2 s = 32 frames at 16 fps: frame k shows source frame floor(k * 24 / 16)
    index_video(tmp_path / "clip.mp4", 48, fps=24)
    events = _decode(tmp_path, "clip.mp4", DecodePlan(check_grid(GRID), fps=16, long=long))
    got = [e for e in events if isinstance(e, Window)]
    assert [w.frames.shape[0] for w in got] == windows
    assert all(tuple(w.frames.shape[1:]) == (32, 48, 3) for w in got)  # 48x64 source: 4:3 is nearest to 32x48
    start = 0
    for w in got:
        assert [read_index(f) for f in w.frames.numpy()] == [k * 3 // 2 for k in range(start, start + len(w.frames))]
        assert w.meta["start_s"] == pytest.approx(start / 16)
        start += len(w.frames)
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.windows == len(windows)
    assert finished.tail_frames == (32 - 26 if long == "windows" else 0)


def test_variable_frame_rate_follows_timestamps_not_frame_numbers(tmp_path):
    pts = [0, 40, 90, 300, 310, 500, 520, 560, 700, 1000, 1020, 1100]  # ms, irregular; last shown ~1/24 s
    index_video(tmp_path / "vfr.mp4", len(pts), fps=24, pts_ms=pts)
    events = _decode(tmp_path, "vfr.mp4", DecodePlan(check_grid(GRID), fps=10, long="trim"))
    window = next(e for e in events if isinstance(e, Window))
    # 0 .. 1.1 s + its duration at 10 fps: 12 frames available -> the 9-frame bucket, t_k = k / 10
    expected = [max(i for i, p in enumerate(pts) if p <= 100 * k) for k in range(9)]
    assert [read_index(f) for f in window.frames.numpy()] == expected
    assert expected != list(range(9))  # counting frames would have given 0, 1, 2, ...


def test_fps_none_keeps_source_frames_and_short_clips_fill_the_largest_bucket_they_can(tmp_path):
    index_video(tmp_path / "c.mp4", 12, fps=24)
    events = _decode(tmp_path, "c.mp4", DecodePlan(check_grid(GRID), fps=None, long="windows"))
    window, finished = events
    assert [read_index(f) for f in window.frames.numpy()] == list(range(9))
    assert window.meta["fps"] == pytest.approx(24) and finished.tail_frames == 3


def test_too_short_and_undecodable_and_caption_first(tmp_path):
    index_video(tmp_path / "short.mp4", 3, fps=16)
    (rejected,) = _decode(tmp_path, "short.mp4", DecodePlan(check_grid(GRID), fps=16))
    assert (rejected.reason, "3 frames at 16 fps" in rejected.detail, "is 5" in rejected.detail) == \
        ("too_short", True, True)
    (tmp_path / "junk.mp4").write_bytes(np.random.default_rng(0).bytes(4000))
    (rejected,) = _decode(tmp_path, "junk.mp4", DecodePlan(check_grid(GRID)))
    assert rejected.reason == "undecodable" and "junk.mp4" in rejected.detail
    (rejected,) = _decode(tmp_path, "junk.mp4", DecodePlan(check_grid(GRID)), caption=" ")
    assert rejected.reason == "missing_caption"
    (rejected,) = _decode(tmp_path, "short.mp4", DecodePlan(check_grid([(1, 32, 32)])))
    assert rejected.reason == "no_bucket"


def test_resize_center_crop_matches_pillow_and_crops_the_middle():
    from PIL import Image

    pixels = np.random.default_rng(3).integers(0, 256, (50, 90, 3), dtype=np.uint8)
    out = resize_center_crop(pixels, 32, 48).numpy()
    # scale max(32/50, 48/90) = 0.64 -> 32 x 58 (Pillow's bilinear with its antialiasing support), columns 5..53
    ref = np.asarray(Image.fromarray(pixels).resize((58, 32), Image.BILINEAR))[:, 5:53]
    assert out.shape == (32, 48, 3)
    assert np.abs(out.astype(int) - ref).max() <= 2
    exact = resize_center_crop(pixels[:32], 32, 48).numpy()  # no resampling needed: a pure crop
    np.testing.assert_array_equal(exact, pixels[:32, 21:69])


def test_image_window(tmp_path):
    from PIL import Image

    pixels = write_image(tmp_path / "img.png", seed=1, height=40, width=56)
    window, finished = _decode(tmp_path, "img.png", DecodePlan(check_grid(GRID)))
    assert window.frames.shape == (1, 32, 48, 3) and window.meta["kind"] == "image"
    assert window.meta["source_size"] == [40, 56] and finished.windows == 1
    ref = np.asarray(Image.fromarray(pixels).resize((48, 34), Image.BILINEAR))[1:33]
    assert np.abs(window.frames[0].numpy().astype(int) - ref).max() <= 2
    (tmp_path / "bad.png").write_bytes(b"\x89PNG not really")
    (rejected,) = _decode(tmp_path, "bad.png", DecodePlan(check_grid(GRID)))
    assert rejected.reason == "unreadable_image"


def test_trim_says_whether_frames_were_cut(tmp_path):
    plan = DecodePlan(check_grid(GRID), fps=16, long="trim")
    index_video(tmp_path / "long.mp4", 20, fps=16)   # 20 frames: the 17 bucket, 3 cut
    index_video(tmp_path / "exact.mp4", 17, fps=16)  # exactly the largest bucket: nothing cut
    assert _decode(tmp_path, "long.mp4", plan)[-1].trimmed is True
    assert _decode(tmp_path, "exact.mp4", plan)[-1].trimmed is False
    assert _decode(tmp_path, "long.mp4", DecodePlan(check_grid(GRID), fps=16))[-1].trimmed is False  # windows


@pytest.mark.parametrize("name, size, reason, words", [
    ("panorama.png", (20, 120), "bad_aspect", ["20x120 (aspect 6.00)", "32x48", "75%", "30%"]),
    ("speck.png", (10, 12), "too_small", ["10x12", "upscaled 3.20x", "32x32", "2x"]),
])
def test_far_aspect_and_tiny_sources_are_bad_inputs(tmp_path, name, size, reason, words):
    write_image(tmp_path / name, seed=0, height=size[0], width=size[1])
    (rejected,) = _decode(tmp_path, name, DecodePlan(check_grid(GRID)))
    assert rejected.reason == reason and all(w in rejected.detail for w in words), rejected.detail
    # the limits are the caller's: allowed, the source is cropped/upscaled and says by how much
    window, finished = _decode(tmp_path, name, DecodePlan(check_grid(GRID), max_crop=1, max_upscale=4))
    assert window.meta["crop"] == pytest.approx(0.75 if reason == "bad_aspect" else 1 - (32 / 32) / (12 / 10),
                                                abs=1e-4)
    assert finished.scale == window.meta["scale"] == pytest.approx(32 / 20 if reason == "bad_aspect" else 32 / 10)


def test_a_clip_too_far_from_every_bucket_is_rejected_before_its_frames_are_decoded(tmp_path):
    index_video(tmp_path / "strip.mp4", 9, fps=16, height=16, width=96)
    (rejected,) = _decode(tmp_path, "strip.mp4", DecodePlan(check_grid(GRID), max_upscale=4))
    assert rejected.reason == "bad_aspect"  # not "undecodable": the reason is the shape


def test_portrait_and_square_clips_go_to_buckets_of_their_orientation_in_the_default_grid(tmp_path):
    plan = DecodePlan(DEFAULT_GRID, fps=16)
    index_video(tmp_path / "portrait.mp4", 17, fps=16, height=848, width=480)
    index_video(tmp_path / "square.mp4", 17, fps=16, height=640, width=640)
    for name, resolution, crop in (("portrait.mp4", (832, 480), 1 - (480 / 848) / (480 / 832)),
                                   ("square.mp4", (624, 624), 0.0)):
        window, finished = _decode(tmp_path, name, plan)
        assert tuple(window.frames.shape) == (17, *resolution, 3) and finished.tail_frames == 0
        assert (window.meta["height"], window.meta["width"]) == resolution
        assert window.meta["crop"] == pytest.approx(crop, abs=1e-4) and window.meta["crop"] <= plan.max_crop
        assert window.meta["scale"] <= 1  # never upscaled
        # the stripes are whole: only rows were cut, the frames are in order
        assert [read_index(f) for f in window.frames.numpy()] == list(range(17))
