"""`encode_videos`: clips and images with captions -> latent shards and an index in the sample
format of data/shards.py, ready for `AdaptiveLoadDataModule(shards=OUT, index=OUT/index.jsonl)`.

Per rank: list the inputs (every rank the same list), keep those whose id hashes to this rank,
skip those already in checked shards (state.py), decode them (decode.py; optionally in
DataLoader worker processes), encode each window with the VAE and each caption with UMT5
(models.py), validate every sample as the DataModule would (`inspect_sample`), and write shards
of about `samples_per_shard` samples, whole inputs each, each member's crc32 in the journal.
Rank 0 writes the empty prompt's text embedding beside the shards. Then a done marker; the rank
that sees every marker builds the index (or `finalize_encode` does, in a separate step).

Nothing is cut unreported: bad inputs by reason, files ignored by extension, frames left out at
clips' ends, clips trimmed, inputs upscaled are counted in the progress bar, the throughput line,
each rank's done marker and encode_summary.json.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from lightning_adaptiveload._validation import require_choice, require_int
from lightning_adaptiveload.data.shards import (BadSample, encode_sample, inspect_sample, read_empty_prompt,
                                                write_empty_prompt, write_shard)
from lightning_adaptiveload.encode.decode import DecodePlan, Finished, Rejected, Window, decode_item
from lightning_adaptiveload.encode.grid import (DEFAULT_GRID, LONG_CLIPS, MAX_CROP, MAX_UPSCALE, check_grid,
                                                read_bucket_grid)
from lightning_adaptiveload.encode.inputs import (InputItem, caption_cleaning, clean_caption, list_inputs, rank_of,
                                                  sample_key)
from lightning_adaptiveload.encode.models import (TILE_ABOVE, CaptionEncoder, LatentEncoder, compute_dtype,
                                                  load_text_encoder, load_tokenizer, load_vae)
from lightning_adaptiveload.encode.state import (CHECKS, NO_LOSSES, RankState, claim_finalize, finalize,
                                                 member_checksums, merge_losses, shard_name)

STORED_DTYPES = ("float16", "float32")


@dataclass
class EncodeResult:
    """What one rank's run did. inputs: this rank's share of the listed inputs; resumed: of those,
    already in checked shards; encoded: inputs written by this run; samples, tokens (latent
    tokens under the TokenSpec), video_s (seconds of source video covered): of this run's
    samples; what this run's inputs lost: tail_frames_left_out (frames at clips' ends that fill no
    frame bucket), trimmed (clips cut after their first window, long="trim"), upscaled (inputs
    enlarged to their bucket; max_upscale the largest factor); ignored: files or tar members of
    the listing that are no input, by extension (the same on every rank); bad: bad inputs by
    reason; shards: this rank's shards (all, not only this run's);
    seconds: wall time of decoding, encoding and writing (after the models are loaded and
    resumed shards checked); vae_s, text_s, wait_s: time in the VAE, in the text encoder, and waiting
    for decoded frames; index: the index path if this process built it, else None."""

    rank: int
    world_size: int
    inputs_listed: int
    inputs: int
    resumed: int
    encoded: int = 0
    samples: int = 0
    tokens: int = 0
    video_s: float = 0.0
    tail_frames_left_out: int = 0
    trimmed: int = 0
    upscaled: int = 0
    max_upscale: float = 1.0
    ignored: dict = field(default_factory=dict)
    bad: dict = field(default_factory=dict)
    shards: list = field(default_factory=list)
    seconds: float = 0.0
    vae_s: float = 0.0
    text_s: float = 0.0
    wait_s: float = 0.0
    index: str | None = None

    def throughput(self) -> str:
        s = max(self.seconds, 1e-9)
        return (f"rank {self.rank}/{self.world_size}: {self.encoded} inputs encoded ({self.resumed} already done, "
                f"{sum(self.bad.values())} bad), {self.samples} samples in {self.seconds:.1f} s: "
                f"{self.encoded / s:.2f} inputs/s, {self.samples / s:.2f} samples/s, {self.tokens / s:,.0f} latent "
                f"tokens/s, {self.video_s / s:.2f} s of video/s (VAE {self.vae_s:.1f} s, text {self.text_s:.1f} s, "
                f"waiting for frames {self.wait_s:.1f} s); left out: {self.tail_frames_left_out} tail frames, "
                f"{self.trimmed} clips trimmed; {self.upscaled} inputs upscaled (up to {self.max_upscale:.2f}x); "
                f"ignored files: {sum(self.ignored.values())}{_counts(self.ignored)}")


class _DecodeStream(torch.utils.data.IterableDataset):
    """decode_item over a list of inputs; in DataLoader workers each takes every n-th input."""

    def __init__(self, items: list[InputItem], plan: DecodePlan):
        self.items, self.plan = items, plan

    def __iter__(self) -> Iterator[Window | Finished | Rejected]:
        info = torch.utils.data.get_worker_info()
        items = self.items if info is None else self.items[info.id:: info.num_workers]
        for item in items:
            yield from decode_item(item, self.plan)


def _as_is(event):
    return event


def _one_thread(_worker_id: int) -> None:
    torch.set_num_threads(1)  # workers resize frames; n workers x all cores each would oversubscribe


def _decoded(items: list[InputItem], plan: DecodePlan, num_workers: int):
    # forkserver, not fork: a worker forked from this process inherits locks its other threads held
    # (FFmpeg's, the progress bar's, OpenMP's); with PyAV 18.1.1 every forked worker hung in its first
    # frame conversion (tests/benchmarks/test_encode_benchmark.py; 18.0.0 ran), with forkserver none did
    if num_workers == 0:
        return _DecodeStream(items, plan)
    return torch.utils.data.DataLoader(_DecodeStream(items, plan), batch_size=None, num_workers=num_workers,
                                       collate_fn=_as_is, worker_init_fn=_one_thread, prefetch_factor=2,
                                       multiprocessing_context="forkserver")


def _resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit rank/world size, else torchrun's RANK/WORLD_SIZE, else 0 of 1."""
    if (rank is None) != (world_size is None):
        raise ValueError(f"give rank and world_size together, got rank={rank!r}, world_size={world_size!r}")
    if rank is None:
        rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    world_size = require_int("world_size", world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return rank, world_size


def _device(device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def encode_videos(inputs, out_dir: str | Path, *, vae, text_encoder=None, tokenizer=None,
                  buckets: str | Path | list | None = None, fps: float | None = 16.0, long: str = "windows",
                  latent: str = "mean", text_len: int = 512, samples_per_shard: int = 64, dtype: str = "float16",
                  patch: tuple[int, int, int] = (1, 2, 2), rank: int | None = None, world_size: int | None = None,
                  finalize_index: bool = True, check: str = "full", num_workers: int = 0,
                  device: str | torch.device | None = None, precision: str = "auto",
                  tile_above: int | None = TILE_ABOVE, seed: int = 0, max_crop: float = MAX_CROP,
                  max_upscale: float = MAX_UPSCALE, progress: bool = True) -> EncodeResult:
    """Encode clips and images with captions into latent shards and an index in `out_dir`.

    inputs: a folder (videos/images, each with a `.txt` caption beside it), a JSONL manifest of
        {"path", "caption"}, WebDataset tars (paths, brace patterns) of media + txt/json members,
        or video/image files (a `.txt` caption beside each).
    vae: diffusers `AutoencoderKLWan`, or a local folder of one (or of a Wan pipeline, vae/).
    text_encoder, tokenizer: transformers `UMT5EncoderModel` and its tokenizer, or local folders
        (tokenizer defaults to the text encoder's path: a Wan pipeline folder, whose tokenizer/ is
        used, or a folder that holds both); text_encoder None: no
        `.text.npy` (the caption is still in each sample's JSON; the DataModule uses a stand-in).
        Captions are cleaned as Wan's pipelines clean prompts (`clean_caption`); with a text
        encoder, rank 0 writes the cleaned empty prompt's embedding to OUT/empty_prompt.text.npy.
    buckets: the pixel grid, a shapes JSONL (`read_bucket_grid`) or (frames, height, width)
        triples; default `DEFAULT_GRID`: 1, 17, ..., 81 frames at landscape, portrait and square
        resolutions of three sizes (256x448 / 448x256 / 336x336, Wan's 480x832 / 832x480 and
        720x1280 / 1280x720, 624x624, 960x960).
    max_crop, max_upscale: a source whose nearest bucket would crop away more than this fraction of
        its frame ("bad_aspect") or enlarge it more than this factor ("too_small") is a bad input.
    fps: target frame rate, frames resampled by timestamps (None: keep the source's frames).
    long: "windows" cuts a clip longer than the largest frame bucket into consecutive windows
        (the rest in the largest bucket it fills), "trim" keeps its first window only.
    latent: "mean" (posterior mean) or "sample" (one draw, seeded by key and `seed`).
    text_len: tokens the caption is padded/truncated to (the batches' text_len; Wan: 512).
    samples_per_shard: a shard is closed after the first whole input that brings it to this many.
    dtype: stored latents and text embeddings, "float16" (default) or "float32".
    patch: the DiT patch, for the index's token counts.
    rank, world_size: this process's share (inputs whose id hashes to it); default torchrun's
        RANK/WORLD_SIZE, else 0 of 1. Every rank must be given the same inputs and settings.
    finalize_index: build the index when this rank finishes and every rank has (False: leave it
        to `finalize_encode`).
    check: how a resumed run checks the shards it finds: "full" (every sample decoded and
        validated) or "headers" (size and tar member table).
    num_workers: DataLoader worker processes that decode and resize (0: in this process).
    device, precision: default the GPU (cuda:LOCAL_RANK) if there is one; "auto" is bf16 on GPU,
        fp32 on CPU.
    tile_above: frames with more pixels than this are VAE-encoded in spatial tiles (None: never).

    Returns this rank's `EncodeResult` (its `throughput()` line is printed). Bad inputs are
    skipped and listed (OUT/encode-state/bad-r*.jsonl, merged into OUT/bad.jsonl); errors that
    stop the run name the input.
    """
    require_choice("long", long, LONG_CLIPS)
    require_choice("dtype", dtype, STORED_DTYPES)
    require_choice("check", check, CHECKS)
    require_int("samples_per_shard", samples_per_shard)
    require_int("num_workers", num_workers, minimum=0)
    rank, world_size = _resolve_rank(rank, world_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ignored = Counter()
    items = list_inputs(inputs, ignored)  # before the models: a bad source fails in seconds, not after loading 11 GB
    mine = [item for item in items if rank_of(item.id, world_size) == rank]

    device = _device(device)
    compute = compute_dtype(device, precision)
    vae = load_vae(vae) if isinstance(vae, (str, Path)) else vae
    latents = LatentEncoder(vae, device=device, dtype=compute, latent=latent, tile_above=tile_above, seed=seed)
    spec = latents.spec(patch)
    captions = None
    if text_encoder is not None:
        if tokenizer is None:
            if not isinstance(text_encoder, (str, Path)):
                raise ValueError("text_encoder given as a model: give its tokenizer too")
            tokenizer = text_encoder  # a text encoder's folder, or a pipeline's (tokenizer/ beside it)
        if isinstance(tokenizer, (str, Path)):
            tokenizer = load_tokenizer(tokenizer)
        if isinstance(text_encoder, (str, Path)):
            text_encoder = load_text_encoder(text_encoder)
        captions = CaptionEncoder(text_encoder, tokenizer, device=device, dtype=compute, text_len=text_len)
    if isinstance(buckets, (str, Path)):
        grid = read_bucket_grid(buckets, spec)
    else:
        grid = check_grid(DEFAULT_GRID if buckets is None else buckets, spec)
    plan = DecodePlan(grid, fps, long, max_crop, max_upscale)
    config = {"grid": [list(b) for b in grid], "fps": fps, "long": long, "stored_dtype": dtype,
              "caption_cleaning": caption_cleaning(),
              "token_spec": {"vae_stride_t": spec.vae_stride_t, "vae_stride_s": spec.vae_stride_s,
                             "patch": list(spec.patch)},
              **latents.describe(), **({"text": captions.describe()} if captions else {"text": None})}
    state = RankState(out, rank, world_size, config)
    done = state.resume(check)
    if captions is not None and rank == 0:
        _write_empty_prompt(out, captions, dtype)
    todo = [item for item in mine if item.id not in done]
    result = EncodeResult(rank, world_size, len(items), len(mine), len(mine) - len(todo),
                          ignored=dict(sorted(ignored.items())))
    if ignored:
        print(f"adaptiveload encode: listed {len(items)} inputs; ignored {sum(ignored.values())} files that are no "
              f"video, image or caption: {json.dumps(result.ignored)}")
    bar = tqdm(total=len(mine), initial=result.resumed, desc=f"encode r{rank}", unit="input", disable=not progress)
    begin = time.perf_counter()
    try:
        events = _encoded(_decoded(todo, plan, num_workers), latents, captions, spec, dtype, result)
        _write_shards(events, state, samples_per_shard, result, bar)
    finally:
        bar.close()
        state.close()
    result.shards = [e["shard"] for e in state.entries]
    result.seconds = time.perf_counter() - begin
    print(f"adaptiveload encode: {result.throughput()}")
    ids = hashlib.sha256("\n".join(item.id for item in items).encode()).hexdigest()
    state.write_done({"inputs_listed": len(items), "inputs_sha256": ids, "inputs": len(mine),
                      "encoded": result.encoded, "resumed": result.resumed, "samples": result.samples,
                      "bad": result.bad, "shards": len(result.shards),
                      **{k: getattr(result, k) for k in NO_LOSSES}, "ignored": result.ignored})
    if finalize_index and claim_finalize(out):
        summary = finalize(out, progress=progress)
        result.index = summary["index"]
        print(f"adaptiveload encode: {summary_line(summary)}")
    return result


def summary_line(summary: dict) -> str:
    """One line of what `finalize` wrote and what the run left out (encode_summary.json's counts)."""
    return (f"indexed {summary['samples']} samples of {summary['shards']} shards -> "
            f"{summary['index'] or 'no index (no sample)'}; bad inputs: {summary['bad_inputs']}"
            f"{_counts(summary['bad_by_reason'])}; left out: "
            f"{summary['tail_frames_left_out']} tail frames, "
            f"{summary['trimmed']} clips trimmed; {summary['upscaled']} inputs upscaled (up to "
            f"{summary['max_upscale']:.2f}x); ignored files: {sum(summary['ignored'].values())}"
            f"{_counts(summary['ignored'])}")


def _counts(counts: dict) -> str:
    """' {"a": 1, ...}' of a non-empty counter, '' of an empty one."""
    return f" {json.dumps(counts)}" if counts else ""


def _write_empty_prompt(out: Path, captions: CaptionEncoder, dtype: str) -> None:
    """OUT/empty_prompt.text.npy: the cleaned empty prompt encoded exactly as a caption is (cut to
    its own tokens, the end token only, stored in `dtype`), what caption dropout trains on. Written
    when missing or different (an interrupted write leaves only a .partial), so reruns are no-ops."""
    embedding = captions.encode(clean_caption("")).astype(dtype)
    try:
        old = read_empty_prompt(out)
    except ValueError:  # missing or unreadable: (re)write it
        old = None
    if old is None or old.dtype != embedding.dtype or not np.array_equal(old, embedding):
        write_empty_prompt(out, embedding)


def finalize_encode(out_dir: str | Path, index: str | Path | None = None, check: str = "headers",
                    progress: bool = True) -> dict:
    """Build OUT/index.jsonl (or `index`) from every rank's shards once all ranks are done, merge
    their bad lists into OUT/bad.jsonl, write OUT/encode_summary.json; returns the summary.
    For runs with finalize_index=False, or to rebuild the index. `check`: as in encode_videos."""
    require_choice("check", check, CHECKS)
    return finalize(out_dir, index, check, progress)


def _encoded(events, latents: LatentEncoder, captions: CaptionEncoder | None, spec, dtype: str,
             result: EncodeResult):
    """Decoded events -> ("sample", key, files), ("done", input id) and ("bad", record) in input
    order. An input's samples are held until its last window is encoded and validated, so a bad
    input (an error in its 5th window, a NaN latent) leaves nothing in a shard."""
    pending: dict[str, list[tuple[Window, np.ndarray]]] = {}
    stream = iter(events)
    while True:
        waited = time.perf_counter()
        event = next(stream, None)
        result.wait_s += time.perf_counter() - waited
        if event is None:
            return
        item = event.item
        if isinstance(event, Window):
            started = time.perf_counter()
            try:
                latent = latents.encode(event.frames, sample_key(item.id, event.index))
            except Exception as e:  # noqa: BLE001 - re-raised naming the input (e.g. out of memory)
                frames = "x".join(str(v) for v in event.frames.shape[:3])
                raise RuntimeError(f"{item.where}: VAE encoding of window {event.index} ({frames} frames) failed: "
                                   f"{type(e).__name__}: {e}") from e
            result.vae_s += time.perf_counter() - started
            pending.setdefault(item.id, []).append((event, latent))
        elif isinstance(event, Rejected):
            pending.pop(item.id, None)
            yield "bad", {"path": item.location, "id": item.id, "reason": event.reason, "detail": event.detail}
        else:
            yield from _finish(event, pending.pop(item.id), captions, spec, dtype, result)


def _finish(event: Finished, windows, captions: CaptionEncoder | None, spec, dtype: str, result: EncodeResult):
    item = event.item
    text = None
    if captions is not None:
        started = time.perf_counter()
        text = captions.encode(event.caption).astype(dtype)
        result.text_s += time.perf_counter() - started
    samples = []
    for window, latent in windows:
        key = sample_key(item.id, window.index)
        meta = {**window.meta, "caption": event.caption, "source": item.id, "window": window.index,
                "text_tokens": None if text is None else len(text)}
        files = encode_sample(key, latent.astype(dtype), meta, text)
        try:
            inspect_sample(key, files)  # the DataModule's own checks, before anything is written
        except BadSample as e:
            if e.reason != "non_finite":
                raise RuntimeError(f"{item.where}: the sample written for it fails validation: {e}") from None
            yield "bad", {"path": item.location, "id": item.id, "reason": "non_finite",
                          "detail": f"{item.where}: window {window.index}: {e}"}
            return
        samples.append((key, files, latent.shape[1:], window.meta))
    for key, files, thw, meta in samples:
        result.samples += 1
        result.tokens += spec.tokens_from_latent(*thw)
        result.video_s += meta["frames"] / meta["fps"] if meta["kind"] == "video" and meta["fps"] else 0.0
        yield "sample", key, files
    losses = {"tail_frames_left_out": event.tail_frames, "trimmed": int(event.trimmed),
              "upscaled": int(event.scale > 1.0), "max_upscale": round(max(event.scale, 1.0), 4)}
    result.encoded += 1
    for k, v in merge_losses({k: getattr(result, k) for k in NO_LOSSES}, losses).items():
        setattr(result, k, v)
    yield "done", item.id, losses


def _write_shards(events, state: RankState, samples_per_shard: int, result: EncodeResult, bar) -> None:
    """Consume `events` into shards: each written as <name>.partial and renamed, then journaled,
    once the inputs in it are whole and it holds >= samples_per_shard samples (or the events end)."""
    number, exhausted = state.next_number, False
    bad = Counter()
    while not exhausted:
        inputs, keys, checksums, losses = [], [], {}, NO_LOSSES

        def shard_samples():
            nonlocal exhausted, losses
            for event in events:
                if event[0] == "sample":
                    keys.append(event[1])
                    checksums.update(member_checksums(event[1], event[2]))
                    yield event[1], event[2]
                elif event[0] == "done":
                    inputs.append(event[1])
                    losses = merge_losses(losses, event[2])
                    _progress(bar, result)
                    if len(keys) >= samples_per_shard:
                        return
                else:
                    state.add_bad(event[1])
                    bad[event[1]["reason"]] += 1
                    result.bad = dict(sorted(bad.items()))
                    _progress(bar, result)
            exhausted = True

        name = shard_name(state.rank, number)
        partial = state.out / (name + ".partial")
        write_shard(partial, shard_samples())
        if not keys:
            partial.unlink()
            continue
        with open(partial, "rb") as f:
            os.fsync(f.fileno())  # on disk before the journal says it is
        os.replace(partial, state.out / name)
        state.add_shard(name, inputs, keys, checksums, losses)
        number += 1


def _progress(bar, result: EncodeResult) -> None:
    """One more input done: the bar moves and shows what was written, bad, cut and ignored so far."""
    bar.update(1)
    bar.set_postfix(samples=result.samples, bad=sum(result.bad.values()), tail_frames=result.tail_frames_left_out,
                    trimmed=result.trimmed, upscaled=result.upscaled, ignored=sum(result.ignored.values()),
                    refresh=False)
