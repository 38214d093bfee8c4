"""What `adaptiveload encode` reads: the list of inputs (clips and images with captions) and,
per input, its caption and media bytes; bad inputs are `BadInput`s with a reason.

Four kinds of source:
- a folder: every video/image file under it (recursively; names starting with "." are skipped),
  its caption in the `.txt` of the same name beside it; other files are counted as ignored, by
  extension;
- video/image files, each with its caption in the `.txt` of the same name beside it;
- a JSONL manifest: one {"path": ..., "caption": ...} object a line, relative paths taken from
  the manifest's folder;
- WebDataset tars: samples of a media member (mp4/webm/mov/mkv/avi, jpg/jpeg/png/webp) and a
  caption member (`txt`, or `json` with a "caption" string); other members are counted as ignored.

Every input has an `id` that is the same in every process given the same command (a path
relative to the folder, the path string given or in the manifest, or "tar#key"): ranks split the
inputs by it, keys of the written samples and bad.jsonl are derived from it.

Captions are cleaned as Wan's pipelines clean a prompt before tokenizing (`clean_caption`), so
training sees the text that inference would encode.
"""
from __future__ import annotations

import functools
import hashlib
import html
import importlib
import importlib.util
import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from lightning_adaptiveload._jsonl import iter_objects
from lightning_adaptiveload.data.index import scan_shard
from lightning_adaptiveload.data.shards import resolve_shards

VIDEO_SUFFIXES = ("mp4", "webm", "mov", "mkv", "avi")
IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp")
CAPTION_SUFFIXES = ("txt", "json")

# Why an input was skipped (bad.jsonl "reason"); never written as a sample.
BAD_INPUT_REASONS = (
    "missing_file",      # the manifest names a file that does not exist, or a tar sample has no media member
    "empty_file",        # the media file (or tar member) has zero bytes
    "missing_caption",   # no caption (.txt beside the file, manifest "caption", tar txt/json), or only whitespace
    "bad_caption",       # caption not UTF-8, or a tar json caption member that is not an object with a string "caption"
    "undecodable",       # the video does not open or decode (PyAV/FFmpeg error), has no video stream or no frames
    "unreadable_image",  # the image does not open or decode (Pillow error)
    "too_short",         # fewer frames at the target fps than the grid's smallest frame bucket at its resolution
    "too_small",         # it would be upscaled more than max_upscale (per axis) to the smallest bucket of its aspect
    "bad_aspect",        # its aspect ratio is far from every bucket: the nearest would crop more than max_crop
    "no_bucket",         # the grid has no bucket for this kind of input (e.g. an image with no frames=1 bucket)
    "non_finite",        # the encoders gave NaN or inf for it (checked by data/shards.py's inspect_sample)
)


class BadInput(ValueError):
    """An input that is skipped and listed in bad.jsonl; `reason` is one of BAD_INPUT_REASONS."""

    def __init__(self, reason: str, detail: str):
        assert reason in BAD_INPUT_REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class InputItem:
    """One clip or image to encode.

    id: stable name (see the module docstring); where: what messages name (path, `manifest:line`,
    `tar#key`); path: the file to read (the tar, for a tar member); kind: "video" | "image";
    caption: the manifest's caption (None: read it from `caption_path` or `caption_member`);
    member: (data offset, size) bytes of the media member in the tar; caption_member: (suffix,
    data offset, size) of the tar's caption member.
    """

    id: str
    where: str
    path: str
    kind: str
    caption: str | None = None
    caption_path: str | None = None
    member: tuple[int, int] | None = None
    caption_member: tuple[str, int, int] | None = None

    @property
    def location(self) -> str:
        """The media file, or `tar#key` for a tar sample (bad.jsonl's "path")."""
        return self.path if self.member is None and self.caption_member is None else self.where


def media_kind(suffix: str) -> str | None:
    """"video", "image" or None for a file suffix (without the dot, any case)."""
    suffix = suffix.lower()
    return "video" if suffix in VIDEO_SUFFIXES else "image" if suffix in IMAGE_SUFFIXES else None


_SOURCES = "one folder, one JSONL manifest, WebDataset tars, or video/image files"


def list_inputs(sources: str | Path | list, ignored: Counter | None = None) -> list[InputItem]:
    """The inputs of a folder, a JSONL manifest, tars (paths, brace patterns; several allowed) or
    video/image files (several allowed), sorted by id. `ignored`, if given, counts what was passed
    over by extension (`ignored_name`): a folder's files that are neither media nor the caption of
    one, a tar's members that are neither. Errors that stop the run (a path that does not exist,
    nothing to read, a malformed manifest line, an id given twice) name the source and line."""
    sources = [sources] if isinstance(sources, (str, Path)) else list(sources)
    ignored = Counter() if ignored is None else ignored
    if not sources:
        raise ValueError(f"no input given: {_SOURCES}")
    for source in sources:
        if "{" not in str(source) and not Path(source).exists():  # a brace pattern is checked once expanded
            raise FileNotFoundError(f"input {source}: no such file or folder")
    if len(sources) == 1 and Path(sources[0]).is_dir():
        items = _folder_inputs(Path(sources[0]), ignored)
    elif len(sources) == 1 and str(sources[0]).endswith(".jsonl"):
        items = _manifest_inputs(Path(sources[0]))
    elif all(media_kind(Path(s).suffix.lstrip(".")) for s in sources):
        items = [InputItem(id=str(s), where=str(s), path=str(s), kind=media_kind(Path(s).suffix.lstrip(".")),
                           caption_path=str(Path(s).with_suffix(".txt"))) for s in sources]
    elif all(not Path(s).is_dir() and not str(s).endswith(".jsonl") and not media_kind(Path(s).suffix.lstrip("."))
             for s in sources):
        items = [item for tar in resolve_shards([str(s) for s in sources]) for item in _tar_inputs(tar, ignored)]
    else:
        raise ValueError(f"inputs {[str(s) for s in sources]}: give {_SOURCES}")
    seen: dict[str, str] = {}
    for item in items:
        if item.id in seen:
            raise ValueError(f"{item.where}: input {item.id!r} is listed twice (first at {seen[item.id]})")
        seen[item.id] = item.where
    if not items:
        raise FileNotFoundError(f"no video or image inputs found in {[str(s) for s in sources]} (videos: "
                                f"{', '.join(VIDEO_SUFFIXES)}; images: {', '.join(IMAGE_SUFFIXES)})")
    return sorted(items, key=lambda item: item.id)


def ignored_name(name: str) -> str:
    """The `ignored` counter's key of a file or member name: "(hidden)" for names starting with
    ".", else its last extension, lower case, with the dot (".gif"), or "(none)"."""
    if name.startswith("."):
        return "(hidden)"
    suffix = Path(name).suffix.lower()
    return suffix or "(none)"


def _folder_inputs(folder: Path, ignored: Counter) -> list[InputItem]:
    items, captions, texts = [], set(), []
    for root, dirs, files in os.walk(folder):
        ignored.update("(hidden)" for d in dirs if d.startswith("."))  # a hidden folder counts once, unread
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            path = Path(root, name)
            kind = None if name.startswith(".") else media_kind(path.suffix.lstrip("."))
            if kind is None:
                if path.suffix == ".txt" and not name.startswith("."):
                    texts.append(path)  # a caption, or ignored if no media file names it
                else:
                    ignored[ignored_name(name)] += 1
                continue
            rel = path.relative_to(folder).as_posix()
            captions.add(path.with_suffix(".txt"))
            items.append(InputItem(id=rel, where=str(path), path=str(path), kind=kind,
                                   caption_path=str(path.with_suffix(".txt"))))
    ignored.update(".txt" for path in texts if path not in captions)
    return items


def _manifest_inputs(manifest: Path) -> list[InputItem]:
    items = []
    for line_no, row in iter_objects(manifest):
        where = f"{manifest}:{line_no}"
        path = row.get("path")
        if not isinstance(path, str) or not path:
            raise ValueError(f"{where}: field 'path' must be a non-empty string, got {path!r}")
        kind = media_kind(Path(path).suffix.lstrip("."))
        if kind is None:
            raise ValueError(f"{where}: {path!r} is not a video ({', '.join(VIDEO_SUFFIXES)}) or image "
                             f"({', '.join(IMAGE_SUFFIXES)}) file name")
        caption = row.get("caption")
        if caption is not None and not isinstance(caption, str):
            raise ValueError(f"{where}: field 'caption' must be a string, got {type(caption).__name__}")
        items.append(InputItem(id=path, where=where, path=str(manifest.parent / path), kind=kind,
                               caption=caption or ""))
    return items


def _tar_inputs(tar: str, ignored: Counter) -> list[InputItem]:
    items = []
    for key, spans, _, error in scan_shard(tar, read=set()):
        if error is not None:
            raise ValueError(f"input tar {tar}: cannot be read ({error}); inputs are {_SOURCES}")
        media = [s for s in spans if media_kind(s)]
        caption = next(((s, *spans[s][:2]) for s in CAPTION_SUFFIXES if s in spans), None)
        ignored.update(ignored_name(f"{key}.{s}") for s in spans if s not in media and (caption is None or
                                                                                       s != caption[0]))
        where = f"{tar}#{key}"
        if len(media) > 1:
            raise ValueError(f"{where}: sample has several media members {media}; one a sample")
        if not media and caption is None:
            continue  # neither media nor caption: not an input (e.g. a member of other data)
        offset, size = spans[media[0]][:2] if media else (0, 0)
        items.append(InputItem(id=where, where=where, path=tar, kind=media_kind(media[0]) if media else "video",
                               member=(offset, size) if media else None, caption_member=caption))
    return items


@functools.cache
def _ftfy():
    """ftfy if installed, else None: Wan's pipelines (diffusers) fix mojibake with it only when it is."""
    return importlib.import_module("ftfy") if importlib.util.find_spec("ftfy") else None


def caption_cleaning() -> dict:
    """What `clean_caption` does here (recorded in the run's settings: a resume must clean alike)."""
    ftfy = _ftfy()
    return {"html_unescape": 2, "whitespace": True, "ftfy": None if ftfy is None else ftfy.__version__}


def clean_caption(text: str) -> str:
    """`text` cleaned as Wan's pipelines clean a prompt before tokenizing (diffusers' Wan
    `prompt_clean`): ftfy.fix_text if ftfy is installed (optional, as there), html.unescape twice,
    every run of whitespace to one space, stripped."""
    ftfy = _ftfy()
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


def read_caption(item: InputItem) -> str:
    """The input's caption, cleaned (`clean_caption`); BadInput "missing_caption" (none, or nothing
    left after cleaning) / "bad_caption"."""
    if item.caption is not None:
        text = item.caption
    elif item.caption_path is not None:
        try:
            raw = Path(item.caption_path).read_bytes()
        except FileNotFoundError:
            raise BadInput("missing_caption", f"{item.where}: no caption file {item.caption_path}") from None
        text = _utf8(raw, f"{item.where}: caption {item.caption_path}")
    elif item.caption_member is not None:
        suffix, offset, size = item.caption_member
        raw = _pread(item.path, offset, size)
        text = _utf8(raw, f"{item.where}: caption member {suffix}")
        if suffix == "json":
            text = _json_caption(text, f"{item.where}: caption member json")
    else:
        raise BadInput("missing_caption", f"{item.where}: no txt or json caption member")
    text = clean_caption(text)
    if not text:
        raise BadInput("missing_caption", f"{item.where}: the caption is empty")
    return text


def _utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInput("bad_caption", f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _json_caption(text: str, where: str) -> str:
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInput("bad_caption", f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("caption", ""), str):
        raise BadInput("bad_caption", f"{where}: expected an object with a string 'caption'")
    return meta.get("caption", "")


def read_media(item: InputItem) -> str | bytes:
    """What the decoder opens: the file's path, or the tar member's bytes. BadInput "missing_file"
    (no file, or a tar sample without media) or "empty_file" (zero bytes)."""
    if item.member is None and item.caption_member is not None:
        raise BadInput("missing_file", f"{item.where}: tar sample has a caption but no video or image member")
    if item.member is not None:
        data = _pread(item.path, *item.member)
        if not data:
            raise BadInput("empty_file", f"{item.where}: media member has zero bytes")
        return data
    try:
        size = os.path.getsize(item.path)
    except FileNotFoundError:
        raise BadInput("missing_file", f"{item.where}: no such file {item.path}") from None
    if size == 0:
        raise BadInput("empty_file", f"{item.where}: the file has zero bytes")
    return item.path


def _pread(path: str, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(size)
    if len(data) != size:
        raise OSError(f"{path}: short read at byte {offset} ({len(data)} of {size} bytes): tar changed while encoding?")
    return data


def rank_of(item_id: str, world_size: int) -> int:
    """The rank that encodes input `item_id`: the first 8 bytes of sha1 of the id modulo the world
    size. A hash, not a position in the sorted list, so inputs added to the source later do not
    move the others to another rank (a resumed rank would otherwise redo, and duplicate, another
    rank's inputs). sha1, not crc32: crc32 is linear, so ids differing in a few characters (clip1,
    clip2, ...) can all have the same parity and land on one rank of two."""
    return int.from_bytes(hashlib.sha1(item_id.encode()).digest()[:8], "big") % world_size


_SLUG = re.compile(r"[^A-Za-z0-9_-]+")


def sample_key(item_id: str, window: int) -> str:
    """Key of window `window` of an input: readable stem (letters, digits, _ and - only: keys hold
    no dots), 12 hex digits of sha1 of the id (unique where stems repeat), the window number."""
    stem = Path(item_id.split("#")[-1]).stem
    slug = _SLUG.sub("_", stem)[:48].strip("_") or "input"
    return f"{slug}-{hashlib.sha1(item_id.encode()).hexdigest()[:12]}-{window:03d}"
