"""Listing inputs (folder, manifest, tars), captions, keys and the rank split."""
import json
import types
from collections import Counter

import numpy as np
import pytest

from lightning_adaptiveload.encode.inputs import (BadInput, caption_cleaning, clean_caption, list_inputs, rank_of,
                                                  read_caption, read_media, sample_key)
from tests.encode.conftest import write_tar


def test_folder_lists_media_recursively_with_captions_beside(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("b.mp4", "sub/a.PNG", "notes.txt", ".hidden.mp4", "sub/c.webm", "x.gif"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "b.txt").write_text("  a cat  \n")
    items = list_inputs(tmp_path)
    assert [(i.id, i.kind) for i in items] == [("b.mp4", "video"), ("sub/a.PNG", "image"), ("sub/c.webm", "video")]
    assert read_caption(items[0]) == "a cat"
    with pytest.raises(BadInput) as e:
        read_caption(items[1])
    assert e.value.reason == "missing_caption" and "a.PNG" in e.value.detail


def test_manifest_paths_relative_to_it_and_errors_name_the_line(tmp_path):
    (tmp_path / "clip.mp4").write_bytes(b"")
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"path": "clip.mp4", "caption": "a dog"}) + "\n"
                        + json.dumps({"path": "gone.png"}) + "\n")
    clip, gone = list_inputs(manifest)
    assert read_caption(clip) == "a dog" and clip.path == str(tmp_path / "clip.mp4")
    for item, call, reason in ((clip, read_media, "empty_file"), (gone, read_media, "missing_file"),
                               (gone, read_caption, "missing_caption")):
        with pytest.raises(BadInput) as e:
            call(item)
        assert e.value.reason == reason
    assert gone.where == f"{manifest}:2"
    for bad, match in (({"path": 3}, "m.jsonl:1: field 'path'"), ({"path": "a.doc"}, "m.jsonl:1: 'a.doc' is not"),
                       ({"path": "a.mp4", "caption": 1}, "m.jsonl:1: field 'caption'")):
        manifest.write_text(json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=match):
            list_inputs(manifest)
    manifest.write_text(json.dumps({"path": "a.mp4"}) + "\n" + json.dumps({"path": "a.mp4"}) + "\n")
    with pytest.raises(ValueError, match=f"{manifest}:2: input 'a.mp4' is listed twice \\(first at {manifest}:1"):
        list_inputs(manifest)


def test_tar_samples_media_and_caption_members(tmp_path):
    tar = tmp_path / "in.tar"
    write_tar(tar, {"a.mp4": b"video", "a.txt": b"a cat", "b.jpg": b"img", "b.json": json.dumps({"caption": "sky"}).encode(),
               "c.txt": b"caption only", "d.png": b"img", "e.json": b"{bad", "e.png": b"img"})
    items = {i.id.split("#")[1]: i for i in list_inputs(str(tar))}
    assert sorted(items) == ["a", "b", "c", "d", "e"]
    assert read_media(items["a"]) == b"video" and read_caption(items["a"]) == "a cat"
    assert read_caption(items["b"]) == "sky" and items["b"].kind == "image"
    for key, call, reason in (("c", read_media, "missing_file"), ("d", read_caption, "missing_caption"),
                              ("e", read_caption, "bad_caption")):
        with pytest.raises(BadInput) as e:
            call(items[key])
        assert e.value.reason == reason and f"in.tar#{key}" in e.value.detail


def test_keys_have_no_dots_and_differ_for_equal_stems():
    a, b = sample_key("x/clip.v2.mp4", 0), sample_key("y/clip.v2.mp4", 0)
    assert a.startswith("clip_v2-") and a.endswith("-000") and "." not in a and "/" not in a
    assert a != b and sample_key("x/clip.v2.mp4", 1) != a


def test_rank_split_depends_on_the_id_alone_and_is_balanced():
    ids = [f"clip{i}.mp4" for i in range(3000)]
    ranks = [rank_of(i, 3) for i in ids]
    assert ranks[:1000] == [rank_of(i, 3) for i in ids[:1000]]  # a shorter listing: the same ranks
    counts = np.bincount(ranks, minlength=3)
    assert abs(counts - 1000).max() < 4 * 1000 ** 0.5  # binomial: 4 sigma
    assert all(rank_of(i, 1) == 0 for i in ids)


def test_files_that_are_no_input_are_counted_by_extension(tmp_path):
    for name in ("a.mp4", "a.txt", "orphan.txt", "notes.md", "x.gif", "README", ".DS_Store", ".cache/b.mp4",
                 "sub/c.png", "sub/c.txt", "sub/d.GIF"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    ignored = Counter()
    items = list_inputs(tmp_path, ignored)
    assert [i.id for i in items] == ["a.mp4", "sub/c.png"]
    # captions of a listed file are not ignored; a hidden folder counts once and is not read
    assert ignored == {".txt": 1, ".md": 1, ".gif": 2, "(none)": 1, "(hidden)": 2}
    tar = tmp_path / "in.tar"
    write_tar(tar, {"a.mp4": b"v", "a.txt": b"a cat", "a.json": b"{}", "a.cls": b"3", "b.txt": b"caption only"})
    ignored = Counter()
    assert len(list_inputs(str(tar), ignored)) == 2
    assert ignored == {".json": 1, ".cls": 1}  # the txt caption wins over the json one


def test_video_files_given_as_inputs_and_paths_that_do_not_exist(tmp_path):
    (tmp_path / "a.mp4").write_bytes(b"x")
    (tmp_path / "b.png").write_bytes(b"x")
    (tmp_path / "a.txt").write_text("a cat")
    items = list_inputs([str(tmp_path / "a.mp4"), str(tmp_path / "b.png")])
    assert [(i.id, i.kind, i.member) for i in items] == [(str(tmp_path / "a.mp4"), "video", None),
                                                         (str(tmp_path / "b.png"), "image", None)]
    assert read_media(items[0]) == str(tmp_path / "a.mp4") and read_caption(items[0]) == "a cat"
    with pytest.raises(FileNotFoundError, match=f"input {tmp_path / 'gone'}: no such file or folder"):
        list_inputs(tmp_path / "gone")
    with pytest.raises(FileNotFoundError, match="gone.mp4: no such file or folder"):
        list_inputs([str(tmp_path / "a.mp4"), str(tmp_path / "gone.mp4")])
    with pytest.raises(ValueError, match="give one folder, one JSONL manifest, WebDataset tars, or video/image"):
        list_inputs([str(tmp_path / "a.mp4"), str(tmp_path)])
    (tmp_path / "notes.doc").write_bytes(b"not a tar")
    with pytest.raises(ValueError, match="notes.doc: cannot be read .*inputs are one folder"):
        list_inputs(str(tmp_path / "notes.doc"))


MESSY = ["  a red\tcar\n\njumps  ", "fish &amp; chips", "&amp;lt;b&amp;gt; bold", "caf&eacute; au&nbsp;lait",
         "tab\x0bvertical\u2003em space", "&#39;quoted&#39; &quot;twice&quot;", "plain"]


def test_captions_are_cleaned_as_wan_pipelines_clean_prompts(monkeypatch):
    from diffusers.pipelines.wan import pipeline_wan

    for text in MESSY:  # diffusers' own prompt_clean, with ftfy as installed there and here
        assert clean_caption(text) == pipeline_wan.prompt_clean(text), text
    assert clean_caption("fish &amp;amp; chips") == "fish & chips"  # unescaped twice, as Wan does
    assert clean_caption(" \n\t ") == "" and clean_caption("") == ""


def test_ftfy_is_used_when_installed_and_recorded(monkeypatch, tmp_path):
    from lightning_adaptiveload.encode import inputs

    fake = types.SimpleNamespace(fix_text=lambda t: t.replace("Ã©", "é"), __version__="9.9")
    monkeypatch.setattr(inputs, "_ftfy", lambda: fake)
    assert clean_caption("cafÃ©  &amp; more") == "café & more"
    assert caption_cleaning() == {"html_unescape": 2, "whitespace": True, "ftfy": "9.9"}
    monkeypatch.setattr(inputs, "_ftfy", lambda: None)
    assert caption_cleaning()["ftfy"] is None and clean_caption("cafÃ©") == "cafÃ©"


def test_read_caption_returns_the_cleaned_caption_and_nothing_left_is_missing(tmp_path):
    (tmp_path / "a.mp4").write_bytes(b"x")
    (tmp_path / "b.mp4").write_bytes(b"x")
    (tmp_path / "a.txt").write_text("a &amp;  cat\n")
    (tmp_path / "b.txt").write_text("&nbsp; \n")  # only a no-break space once unescaped
    a, b = list_inputs(tmp_path)
    assert read_caption(a) == "a & cat"
    with pytest.raises(BadInput) as e:
        read_caption(b)
    assert e.value.reason == "missing_caption"
