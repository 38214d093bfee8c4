"""encode_videos end to end: the shards and index it writes against independent references,
resume after a kill, two ranks and one index, every bad-input reason, and training on the result."""
import json
import tarfile

import numpy as np
import pytest
import torch

from lightning_adaptiveload.data.index import read_index, read_members, scan_shard
from lightning_adaptiveload.data.shards import EMPTY_PROMPT_FILE, inspect_sample, read_empty_prompt
from lightning_adaptiveload.encode.decode import DecodePlan, Window, decode_item
from lightning_adaptiveload.encode.grid import check_grid
from lightning_adaptiveload.encode.inputs import caption_cleaning, list_inputs, sample_key
from lightning_adaptiveload.encode.models import LatentEncoder
from lightning_adaptiveload.encode.pipeline import encode_videos, finalize_encode
from lightning_adaptiveload.encode.state import STATE_DIR, claim_finalize

from tests.encode.conftest import (GRID, TEXT_DIM, TEXT_LEN, Z_DIM, index_video, tiny_text_encoder, tiny_tokenizer,
                                   tiny_vae, vae_reference, write_image, write_tar)

# input -> frame counts of its windows at 16 fps (grid frames 5, 9, 17; windows mode)
EXPECTED_WINDOWS = {"long.mp4": [17, 9], "mid.mp4": [9], "sub/pic.png": [1], "sq.jpg": [1], "five.mp4": [5],
                    "six.mp4": [5]}


def _inputs(root):
    """Clips and images with captions; the windows each gives are EXPECTED_WINDOWS."""
    root.mkdir(exist_ok=True)
    (root / "sub").mkdir(exist_ok=True)
    index_video(root / "long.mp4", 48, fps=24)   # 2 s -> 32 frames at 16 fps: 17 + 9 (6 left out)
    index_video(root / "mid.mp4", 12, fps=16)    # 12 frames: the 9 bucket
    index_video(root / "five.mp4", 5, fps=16, height=32, width=32)
    index_video(root / "six.mp4", 6, fps=16, height=64, width=64)
    write_image(root / "sub/pic.png", seed=1)
    write_image(root / "sq.jpg", seed=2, height=64, width=64)
    for i, name in enumerate(EXPECTED_WINDOWS):
        (root / name).with_suffix(".txt").write_text(f"a red car {'runs ' * i}on the grass")
    return root


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return _inputs(tmp_path_factory.mktemp("inputs"))


def _encode(inputs, out, **kw):
    args = dict(vae=tiny_vae(), text_encoder=tiny_text_encoder(), tokenizer=tiny_tokenizer(), buckets=GRID,
                text_len=TEXT_LEN, samples_per_shard=2, device="cpu", progress=False)
    return encode_videos(inputs, out, **{**args, **kw})


def _samples(out) -> dict[str, tuple[dict, np.ndarray, np.ndarray | None]]:
    """key -> (meta, latent, text) of every indexed sample, read by the index's byte offsets."""
    index, fds, samples = read_index(out / "index.jsonl", cache=False), {}, {}
    for i in range(len(index)):
        row = index[i]
        meta, latent, text = inspect_sample(row["key"], read_members(fds, row["shard"], row["members"], row["key"]))
        samples[row["key"]] = (meta, latent.numpy(), text)
    return samples


@pytest.fixture(scope="module")
def encoded(inputs, tmp_path_factory, pipeline_dir):
    out = tmp_path_factory.mktemp("out")
    result = encode_videos(inputs, out, vae=pipeline_dir, text_encoder=pipeline_dir, buckets=GRID, text_len=TEXT_LEN,
                           samples_per_shard=2, device="cpu", progress=False)  # weights from local folders
    return out, result


def test_shards_hold_each_window_with_hand_computed_shapes_and_reference_latents(inputs, encoded):
    out, result = encoded
    samples = _samples(out)
    expected = {sample_key(name, w): f for name, frames in EXPECTED_WINDOWS.items() for w, f in enumerate(frames)}
    assert sorted(samples) == sorted(expected)
    assert result.samples == len(expected) and result.index == str(out / "index.jsonl") and not result.bad
    vae, text_model, tokenizer = tiny_vae(), tiny_text_encoder(), tiny_tokenizer()
    plan = DecodePlan(check_grid(GRID), fps=16)
    for item in list_inputs(inputs):
        caption = (inputs / item.id).with_suffix(".txt").read_text()
        ids = torch.tensor([tokenizer(caption)["input_ids"]])
        with torch.no_grad():
            text_ref = text_model(input_ids=ids).last_hidden_state[0].numpy()
        for window in (e for e in decode_item(item, plan) if isinstance(e, Window)):
            meta, latent, text = samples[sample_key(item.id, window.index)]
            f, h, w = expected[sample_key(item.id, window.index)], meta["height"], meta["width"]
            assert (meta["frames"], meta["source"], meta["caption"]) == (f, item.id, caption)
            # frame rule and VAE strides by hand: T = 1 + (F - 1) / 4, H = h / 8, W = w / 8
            assert latent.shape == (Z_DIM, 1 + (f - 1) // 4, h // 8, w // 8) and latent.dtype == np.float16
            assert meta["latent_shape"] == list(latent.shape[1:])
            np.testing.assert_allclose(latent.astype(np.float32), vae_reference(vae, window.frames), atol=2e-3,
                                       rtol=2e-3)  # float16 storage
            np.testing.assert_allclose(text.astype(np.float32), text_ref, atol=2e-3, rtol=2e-3)
    # 16:9-ish and 4:3 sources at 32x48, squares at 32x32
    assert {samples[sample_key(n, 0)][0]["width"] for n in ("long.mp4", "sub/pic.png")} == {48}
    assert {samples[sample_key(n, 0)][0]["width"] for n in ("five.mp4", "six.mp4", "sq.jpg")} == {32}
    assert result.tail_frames_left_out == 6 + 3 + 1  # long: 32 - 26, mid: 12 - 9, six: 6 - 5


def test_resume_after_a_kill_rewrites_the_half_shard_and_matches_a_clean_run(inputs, encoded, tmp_path, monkeypatch):
    out = tmp_path / "killed"
    real, calls = LatentEncoder.encode, []

    def dies_after_four(self, frames, key):
        calls.append(key)
        if len(calls) == 5:
            raise KeyboardInterrupt("simulated kill")
        return real(self, frames, key)

    monkeypatch.setattr(LatentEncoder, "encode", dies_after_four)
    with pytest.raises(KeyboardInterrupt):
        _encode(inputs, out)
    assert list(out.glob("*.tar.partial")) and not (out / "index.jsonl").exists()
    journal = (out / STATE_DIR / "r00000.jsonl").read_text().splitlines()
    whole = [json.loads(line) for line in journal[1:]]
    assert whole and all((out / e["shard"]).exists() for e in whole)
    done_before = [i for e in whole for i in e["inputs"]]
    # a torn last journal line (a kill while appending) is ignored, not an error
    with open(out / STATE_DIR / "r00000.jsonl", "a") as f:
        f.write('{"shard": "shard-r00000-0000')
    calls.clear()
    monkeypatch.setattr(LatentEncoder, "encode", lambda self, frames, key: calls.append(key) or real(self, frames, key))
    result = _encode(inputs, out)
    assert result.resumed == len(done_before) and result.encoded == len(EXPECTED_WINDOWS) - len(done_before)
    assert calls and not set(calls) & {k for e in whole for k in e["keys"]}  # what was whole is not encoded again
    assert not list(out.glob("*.partial"))
    clean = _samples(encoded[0])
    resumed = _samples(out)
    assert sorted(resumed) == sorted(clean)
    for key in clean:
        np.testing.assert_array_equal(resumed[key][1], clean[key][1])


def _flip_a_latent_bit(shard) -> str:
    """Flip the lowest bit of the first value of the shard's first latent (float16: one ulp, still
    finite and valid); returns the sample's key."""
    with tarfile.open(shard) as tar:
        info = next(m for m in tar if m.name.endswith(".latent.npy"))
    data = bytearray(shard.read_bytes())
    assert data[info.offset_data:info.offset_data + 8] == b"\x93NUMPY\x01\x00"  # npy format 1.0
    header_len = int.from_bytes(data[info.offset_data + 8:info.offset_data + 10], "little")
    data[info.offset_data + 10 + header_len] ^= 1
    shard.write_bytes(bytes(data))
    return info.name.removesuffix(".latent.npy")


def test_resume_finds_a_flipped_bit_in_a_latent_by_its_checksum_and_rewrites_the_shard(inputs, encoded, tmp_path,
                                                                                      capsys):
    out = tmp_path / "damaged"
    first = _encode(inputs, out)
    shard = out / first.shards[0]
    key = _flip_a_latent_bit(shard)
    for k, _, files, _ in scan_shard(shard):
        inspect_sample(k, files)  # still a valid sample: only the checksum tells
    (out / "shard-r00000-000099.tar").write_bytes(b"renamed but never journaled")
    with pytest.raises(ValueError, match=f"{first.shards[0]}: member {key}.latent.npy: crc32"):
        finalize_encode(out, check="full")
    capsys.readouterr()
    again = _encode(inputs, out)
    log = capsys.readouterr().out
    assert f"{first.shards[0]} (member {key}.latent.npy: crc32" in log and "shard-r00000-000099.tar" in log
    assert not (out / "shard-r00000-000099.tar").exists()
    assert again.encoded == len(json.loads((out / STATE_DIR / "r00000.jsonl").read_text().splitlines()[1])["inputs"])
    clean, rewritten = _samples(encoded[0]), _samples(out)
    assert sorted(rewritten) == sorted(clean)
    for k in clean:
        np.testing.assert_array_equal(rewritten[k][1], clean[k][1])
    # --check headers reads no data: size and member table only, so it does not see a flipped bit
    _flip_a_latent_bit(out / again.shards[0])
    assert _encode(inputs, out, check="headers").encoded == 0


def test_settings_change_on_resume_is_refused(inputs, tmp_path):
    out = tmp_path / "o"
    _encode(inputs, out)
    with pytest.raises(ValueError, match="other settings \\(fps differ\\)"):
        _encode(inputs, out, fps=8)
    with pytest.raises(ValueError, match="world_size 1, this run has 2"):
        _encode(inputs, out, rank=0, world_size=2)
    assert (out / STATE_DIR / "r00000.done.json").exists() and (out / "index.jsonl").exists()  # left as it was


def test_two_ranks_write_disjoint_shards_and_the_last_builds_one_index(inputs, encoded, tmp_path):
    out = tmp_path / "ranks"
    first = _encode(inputs, out, rank=1, world_size=2)
    assert first.index is None and not (out / "index.jsonl").exists()  # rank 0 not done yet
    with pytest.raises(ValueError, match="ranks \\[0\\] of 2 have not finished"):
        finalize_encode(out)
    second = _encode(inputs, out, rank=0, world_size=2)
    assert second.index == str(out / "index.jsonl")
    assert first.inputs + second.inputs == len(EXPECTED_WINDOWS) and first.inputs and second.inputs
    assert all(s.startswith("shard-r00001-") for s in first.shards)
    assert all(s.startswith("shard-r00000-") for s in second.shards)
    rows = [json.loads(line) for line in (out / "index.jsonl").read_text().splitlines()[1:] if '"key"' in line]
    by_rank = {s: {r["key"] for r in rows if r["shard"] in set(s)} for s in (tuple(first.shards), tuple(second.shards))}
    assert not set.intersection(*by_rank.values())
    assert sorted(_samples(out)) == sorted(_samples(encoded[0]))
    assert not claim_finalize(out)  # the claim is taken: no second index build
    summary = finalize_encode(out)  # an explicit finalize step rebuilds it
    assert summary["samples"] == len(rows) and summary["world_size"] == 2


def test_every_bad_input_reason_is_counted_listed_and_never_written(inputs, tmp_path):
    root = tmp_path / "bad"
    root.mkdir()
    good = (inputs / "mid.mp4").read_bytes()
    files = {"ok.mp4": (good, "a cat"), "empty.mp4": (b"", "a cat"), "junk.mp4": (b"\x00junk" * 300, "a cat"),
             "junk.png": (b"\x89PNG\r\n\x1a\n broken", "a cat"), "nocap.mp4": (good, None),
             "blank.mp4": (good, "  \n"), "latin1.mp4": (good, b"caf\xe9")}
    for name, (data, caption) in files.items():
        (root / name).write_bytes(data)
        if caption is not None:
            (root / name).with_suffix(".txt").write_bytes(caption if isinstance(caption, bytes) else caption.encode())
    index_video(root / "short.mp4", 3, fps=16)
    (root / "short.txt").write_text("a dog")
    expected = {"ok.mp4": None, "empty.mp4": "empty_file", "junk.mp4": "undecodable", "junk.png": "unreadable_image",
                "nocap.mp4": "missing_caption", "blank.mp4": "missing_caption", "latin1.mp4": "bad_caption",
                "short.mp4": "too_short"}
    result = _encode(root, tmp_path / "out")
    _check_bad(tmp_path / "out", result, expected, root)

    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in (
        {"path": "bad/ok.mp4", "caption": "a cat"}, {"path": "bad/gone.mp4", "caption": "a cat"},
        {"path": "bad/junk.mp4"})))
    result = _encode(manifest, tmp_path / "out_m")
    _check_bad(tmp_path / "out_m", result, {"bad/ok.mp4": None, "bad/gone.mp4": "missing_file",
                                            "bad/junk.mp4": "missing_caption"}, None)

    tar = tmp_path / "in.tar"
    write_tar(tar, {"a.mp4": good, "a.txt": b"a cat", "b.txt": b"caption, no media", "c.png": b"\x89PNG",
               "c.txt": b"a dog", "d.jpg": (inputs / "sq.jpg").read_bytes()})
    result = _encode(str(tar), tmp_path / "out_t")
    _check_bad(tmp_path / "out_t", result, {f"{tar}#a": None, f"{tar}#b": "missing_file",
                                            f"{tar}#c": "unreadable_image", f"{tar}#d": "missing_caption"}, None)

    # an image with a grid of clips only, and encoders that give inf (latents_std 0)
    result = _encode(inputs / "sub", tmp_path / "out_nb", buckets=[(5, 32, 32)])
    assert result.bad == {"no_bucket": 1} and result.samples == 0
    assert not (tmp_path / "out_nb" / "index.jsonl").exists()
    result = _encode(inputs / "sub", tmp_path / "out_inf", vae=tiny_vae(latents_std=[1.0, 0.0, 1.0, 1.0]),
                     finalize_index=False)
    assert result.bad == {"non_finite": 1} and not result.shards


def _check_bad(out, result, expected: dict, root) -> None:
    bad = [json.loads(line) for line in (out / "bad.jsonl").read_text().splitlines()]
    assert {b["id"]: b["reason"] for b in bad} == {k: v for k, v in expected.items() if v}
    for b in bad:  # the detail names the input (its file, manifest line or tar sample); path is its file
        assert b["detail"].startswith(b["path"] if "#" in b["id"] or root else f"{out.parent / 'm.jsonl'}:")
        assert b["path"].endswith(b["id"])
    counts = {r: sum(v == r for v in expected.values()) for r in expected.values() if r}
    assert result.bad == dict(sorted(counts.items()))
    keys = {r["key"] for r in map(json.loads, (out / "index.jsonl").read_text().splitlines()[1:]) if "key" in r}
    assert {k.rsplit("-", 1)[0] for k in keys} == {sample_key(k, 0).rsplit("-", 1)[0] for k, v in expected.items()
                                                  if v is None}
    summary = json.loads((out / "encode_summary.json").read_text())
    assert summary["bad_by_reason"] == result.bad


def test_written_shards_train_through_the_datamodule_and_the_demo_model(encoded, tmp_path):
    import lightning as L

    from examples.video_dit.module import VideoDiTModule
    from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule

    out, _ = encoded
    stored = _samples(out)
    dm = AdaptiveLoadDataModule(shards=str(out), index=str(out / "index.jsonl"), policy="token_equal", m_mem=256,
                                latent_channels=Z_DIM, text_len=TEXT_LEN, text_dim=TEXT_DIM, num_workers=0, seed=0,
                                drop_last=False)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    seen = [key for batch in batches for key in batch["keys"]]
    assert batches and set(seen) <= set(stored)
    for batch in batches:
        for key, latent, text in zip(batch["keys"], batch["latents"], batch["text"]):
            np.testing.assert_array_equal(latent.numpy(), stored[key][1].astype(np.float32))
            n = len(stored[key][2])
            np.testing.assert_array_equal(text[:n].numpy(), stored[key][2].astype(np.float32))
            assert not text[n:].any()  # zero-padded to text_len, as Wan pads its context
    L.seed_everything(0)
    model = VideoDiTModule(in_channels=Z_DIM, dim=32, num_layers=1, num_heads=2, ffn_dim=64, text_dim=TEXT_DIM,
                           freq_dim=16)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
                        default_root_dir=tmp_path)
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 3 and torch.isfinite(trainer.callback_metrics["train/loss"])


def test_decoding_in_worker_processes_gives_the_same_samples(inputs, encoded, tmp_path):
    result = _encode(inputs / "sub", tmp_path / "w", num_workers=1)
    assert result.samples == 1
    key = sample_key("pic.png", 0)  # ids are relative to the folder given
    sample = _samples(tmp_path / "w")[key]
    reference = _samples(encoded[0])[sample_key("sub/pic.png", 0)]
    np.testing.assert_array_equal(sample[1], reference[1])


def test_throughput_line(capsys, inputs, tmp_path):
    result = _encode(inputs / "sub", tmp_path / "t")
    line = result.throughput()
    assert line in capsys.readouterr().out
    assert f"{result.samples} samples in {result.seconds:.1f} s: {result.encoded / result.seconds:.2f} inputs/s" in line


def test_rank_and_world_size_from_torchrun_environment(inputs, tmp_path, monkeypatch):
    from lightning_adaptiveload.encode.inputs import rank_of

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = _encode(inputs / "sub", tmp_path / "env", finalize_index=False)
    assert (result.rank, result.world_size) == (1, 2)
    assert result.inputs == int(rank_of("pic.png", 2) == 1)
    assert (tmp_path / "env" / STATE_DIR / "r00001.done.json").exists()
    with pytest.raises(ValueError, match="give rank and world_size together"):
        _encode(inputs / "sub", tmp_path / "env2", rank=0)


# portrait buckets beside the landscape and square ones of GRID
ORIENTED_GRID = GRID + [(f, 48, 32) for f in (1, 5, 9, 17)]


def test_orientations_cuts_and_ignored_files_are_counted_everywhere_and_survive_a_resume(tmp_path, capsys):
    src = tmp_path / "in"
    (src / ".cache").mkdir(parents=True)
    index_video(src / "portrait.mp4", 12, fps=16, height=80, width=48)  # 9 frames at 48x32, 3 left out
    index_video(src / "square.mp4", 12, fps=16, height=40, width=40)    # 9 at 32x32, 3 left out
    index_video(src / "wide.mp4", 12, fps=16, height=48, width=64)      # 9 at 32x48, 3 left out
    write_image(src / "tiny.png", seed=3, height=20, width=20)          # upscaled 1.6x: allowed, counted
    write_image(src / "speck.png", seed=4, height=10, width=10)         # 3.2x: too_small
    write_image(src / "panorama.png", seed=5, height=20, width=120)     # 6:1: bad_aspect
    for name in ("portrait", "square", "wide", "tiny", "speck", "panorama"):
        (src / f"{name}.txt").write_text("a dog on the grass")
    for name in ("notes.md", "clip.gif", ".DS_Store", "orphan.txt", ".cache/x.mp4"):
        (src / name).write_bytes(b"x")
    out = tmp_path / "out"
    result = _encode(src, out, buckets=ORIENTED_GRID, progress=True)
    printed = capsys.readouterr()
    samples = _samples(out)
    expected = {"portrait.mp4": (48, 32), "square.mp4": (32, 32), "wide.mp4": (32, 48), "tiny.png": (32, 32)}
    vae = tiny_vae()
    plan = DecodePlan(check_grid(ORIENTED_GRID), fps=16)
    for item in list_inputs(src):
        if item.id not in expected:
            continue
        meta, latent, _ = samples[sample_key(item.id, 0)]
        h, w = expected[item.id]
        source_h, source_w = meta["source_size"]
        ratio = (w / h) / (source_w / source_h)
        assert (meta["height"], meta["width"]) == (h, w) and latent.shape[2:] == (h // 8, w // 8)
        assert meta["crop"] == pytest.approx(1 - min(ratio, 1 / ratio), abs=1e-4) and meta["crop"] <= 0.3
        window = next(e for e in decode_item(item, plan) if isinstance(e, Window))
        np.testing.assert_allclose(latent.astype(np.float32), vae_reference(vae, window.frames), atol=2e-3, rtol=2e-3)
    assert samples[sample_key("tiny.png", 0)][0]["scale"] == 1.6
    bad = {b["id"]: b["reason"] for b in map(json.loads, (out / "bad.jsonl").read_text().splitlines())}
    assert bad == {"speck.png": "too_small", "panorama.png": "bad_aspect"}
    ignored = {".md": 1, ".gif": 1, "(hidden)": 2, ".txt": 1}
    counts = {"tail_frames_left_out": 9, "trimmed": 0, "upscaled": 1, "max_upscale": 1.6}
    assert {k: getattr(result, k) for k in counts} == counts and result.ignored == ignored
    done = json.loads((out / STATE_DIR / "r00000.done.json").read_text())
    summary = json.loads((out / "encode_summary.json").read_text())
    for doc in (done, summary):
        assert {k: doc[k] for k in counts} == counts and doc["ignored"] == ignored
    assert summary["bad_by_reason"] == {"bad_aspect": 1, "too_small": 1}
    assert "left out: 9 tail frames, 0 clips trimmed; 1 inputs upscaled (up to 1.60x); ignored files: 5" in \
        result.throughput() and result.throughput() in printed.out
    assert "tail_frames=9" in printed.err and "upscaled=1" in printed.err and "ignored=5" in printed.err  # the bar
    again = _encode(src, out, buckets=ORIENTED_GRID)  # nothing new: this run cut nothing, the summary still counts
    assert again.encoded == 0 and again.tail_frames_left_out == 0
    summary = json.loads((out / "encode_summary.json").read_text())
    assert {k: summary[k] for k in counts} == counts


def test_trimmed_clips_are_counted(inputs, tmp_path):
    result = _encode(inputs, tmp_path / "trim", long="trim")
    assert result.trimmed == 1 and result.tail_frames_left_out == 3 + 1  # long.mp4 is trimmed; mid 12 - 9, six 6 - 5
    assert json.loads((tmp_path / "trim" / "encode_summary.json").read_text())["trimmed"] == 1


def test_the_empty_prompt_is_encoded_once_per_output_as_a_caption_is(encoded, tmp_path, inputs):
    out, _ = encoded
    path = out / EMPTY_PROMPT_FILE
    embedding = read_empty_prompt(out)
    model, tokenizer = tiny_text_encoder(), tiny_tokenizer()
    ids = torch.tensor([tokenizer("")["input_ids"]])
    assert ids.tolist() == [[1]]  # the end token only: what is left of "" after the caption's trimming
    with torch.no_grad():
        reference = model(input_ids=ids).last_hidden_state[0].numpy()
    assert embedding.dtype == np.float16 and embedding.shape == (1, TEXT_DIM)
    np.testing.assert_allclose(embedding.astype(np.float32), reference, atol=2e-3, rtol=2e-3)
    assert json.loads((out / "encode_summary.json").read_text())["empty_prompt"] == str(path)
    # ranks: rank 0 writes it, another rank does not; a rerun leaves it as it is
    ranks = tmp_path / "ranks"
    _encode(inputs / "sub", ranks, rank=1, world_size=2)
    assert not (ranks / EMPTY_PROMPT_FILE).exists()
    _encode(inputs / "sub", ranks, rank=0, world_size=2)
    written = (ranks / EMPTY_PROMPT_FILE).stat().st_mtime_ns
    np.testing.assert_array_equal(read_empty_prompt(ranks), embedding)
    _encode(inputs / "sub", ranks, rank=0, world_size=2)
    assert (ranks / EMPTY_PROMPT_FILE).stat().st_mtime_ns == written
    (ranks / EMPTY_PROMPT_FILE).write_bytes(b"torn")  # damaged: rewritten on the next run
    _encode(inputs / "sub", ranks, rank=0, world_size=2)
    np.testing.assert_array_equal(read_empty_prompt(ranks), embedding)
    result = _encode(inputs / "sub", tmp_path / "notext", text_encoder=None)
    assert result.samples and not (tmp_path / "notext" / EMPTY_PROMPT_FILE).exists()
    assert json.loads((tmp_path / "notext" / "encode_summary.json").read_text())["empty_prompt"] is None


def test_a_single_video_file_is_encoded_and_messy_captions_are_cleaned(inputs, encoded, tmp_path):
    clip = tmp_path / "one.mp4"
    clip.write_bytes((inputs / "mid.mp4").read_bytes())
    clip.with_suffix(".txt").write_text("  a&#32;red   car\n\njumps &amp;amp; runs ")
    result = _encode(str(clip), tmp_path / "one")
    assert result.samples == 1 and not result.bad
    meta, latent, text = _samples(tmp_path / "one")[sample_key(str(clip), 0)]
    np.testing.assert_array_equal(latent, _samples(encoded[0])[sample_key("mid.mp4", 0)][1])  # same clip
    assert meta["caption"] == "a red car jumps & runs"  # html unescaped twice, whitespace collapsed
    ids = torch.tensor([tiny_tokenizer()("a red car jumps & runs")["input_ids"]])
    with torch.no_grad():
        reference = tiny_text_encoder()(input_ids=ids).last_hidden_state[0].numpy()
    np.testing.assert_allclose(text.astype(np.float32), reference, atol=2e-3, rtol=2e-3)
    config = json.loads((tmp_path / "one" / STATE_DIR / "r00000.jsonl").read_text().splitlines()[0])["config"]
    assert config["caption_cleaning"] == caption_cleaning()  # a resume must clean alike
