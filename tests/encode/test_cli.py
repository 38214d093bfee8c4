"""`adaptiveload encode`: --help without torch, a run from a pipeline folder, --finalize, clear errors."""
import json
import subprocess
import sys

from lightning_adaptiveload.cli import main

from tests.encode.conftest import index_video, write_image


def test_help_lists_the_options_and_imports_no_torch():
    code = ("import sys\nfrom lightning_adaptiveload.cli import main\ntry:\n    main(['encode', '--help'])\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for option in ("--model", "--fps", "--long", "--latent", "--text-len", "--rank", "--world-size", "--finalize",
                   "--buckets", "--check", "--tile-above", "--max-crop", "--max-upscale", "bad.jsonl",
                   "empty_prompt.text.npy", "480x832", "832x480", "624x624"):
        assert option in out, option
    assert out.strip().endswith("False")


def _grid(folder):
    grid = folder / "grid.jsonl"
    grid.write_text("".join(json.dumps({"frames": f, "height": 32, "width": 48}) + "\n" for f in (1, 5, 17)))
    return grid


def test_run_from_a_pipeline_folder_then_finalize(pipeline_dir, tmp_path, capsys):
    src = tmp_path / "in"
    src.mkdir()
    index_video(src / "clip.mp4", 20, fps=16)
    write_image(src / "pic.png", seed=0)
    for name in ("clip", "pic"):
        (src / f"{name}.txt").write_text("a dog on the grass")
    (src / "nocap.png").write_bytes((src / "pic.png").read_bytes())
    out = tmp_path / "out"
    args = ["encode", str(src), "--out", str(out), "--model", str(pipeline_dir), "--buckets", str(_grid(tmp_path)),
            "--text-len", "16", "--device", "cpu", "--num-workers", "0", "--no-progress", "--no-finalize"]
    assert main(args) == 0
    assert not (out / "index.jsonl").exists()
    assert main(["encode", "--finalize", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "indexed 2 samples of 1 shards" in printed and '"missing_caption": 1' in printed
    rows = [json.loads(line) for line in (out / "index.jsonl").read_text().splitlines()[1:]]
    assert sorted(r["latent_shape"] for r in rows if "key" in r) == [[1, 4, 6], [5, 4, 6]]  # 17 frames, an image
    assert main(args) == 0  # a rerun: everything is resumed, nothing encoded again
    assert "2 inputs encoded" not in capsys.readouterr().out


def test_a_single_clip_and_the_size_limits(pipeline_dir, tmp_path, capsys):
    index_video(tmp_path / "clip.mp4", 9, fps=16, height=16, width=24)  # 2x up to 32x48
    (tmp_path / "clip.txt").write_text("a dog")
    args = ["encode", str(tmp_path / "clip.mp4"), "--model", str(pipeline_dir), "--buckets", str(_grid(tmp_path)),
            "--text-len", "16", "--device", "cpu", "--num-workers", "0", "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "a"), "--max-upscale", "1.5"]) == 1  # no sample: bad input
    assert '{"too_small": 1}' in capsys.readouterr().out
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    assert "1 inputs upscaled (up to 2.00x)" in capsys.readouterr().out


def test_errors_are_one_line_naming_what_is_wrong(tmp_path, capsys, monkeypatch):
    assert main(["encode", "--finalize", "--out", str(tmp_path)]) == 2
    assert "no encode done markers" in capsys.readouterr().err
    assert main(["encode", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "give --model (a Wan diffusers pipeline folder) or --vae" in capsys.readouterr().err
    assert main(["encode", str(tmp_path / "videos"), "--out", str(tmp_path / "o"), "--vae", str(tmp_path),
                 "--no-text"]) == 2
    assert f"input {tmp_path / 'videos'}: no such file or folder" in capsys.readouterr().err
    assert main(["encode", str(tmp_path), "--out", str(tmp_path / "o"), "--vae", str(tmp_path), "--no-text"]) == 2
    assert "no video or image inputs found in" in capsys.readouterr().err  # listed before any model is loaded
    write_image(tmp_path / "pic.png", seed=0)
    monkeypatch.setitem(sys.modules, "diffusers", None)  # as if the extra were not installed
    assert main(["encode", str(tmp_path), "--out", str(tmp_path / "o"), "--vae", str(tmp_path), "--no-text"]) == 2
    assert 'pip install "lightning-adaptiveload[encode]"' in capsys.readouterr().err
