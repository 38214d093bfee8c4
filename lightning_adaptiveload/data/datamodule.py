"""AdaptiveLoadDataModule: batches of video latents from WebDataset shards, sized per bucket by a
batch-size policy, the same number of batches on every rank.

Two paths:
- map-style (`index` given): every sample's shape is known from the index; the
  `BucketBatchSampler` plans each epoch globally (balanced across ranks, resumable mid-epoch)
  and samples are read by byte offset from the tars.
- streaming (no index): a webdataset pipeline per DataLoader worker over explicitly split,
  endlessly re-shuffled shards, bucketed on the fly by the streaming stage, with a fixed
  `steps_per_epoch`.

Batch dict (see docs/data.md): latents (B, C, T, H, W) float32, text (B, L, D_text) float32,
seq_len int (tokens per sample), latent_shape (T, H, W), keys list[str].
"""
from __future__ import annotations

import functools
import logging
import os
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_adaptiveload.scheduling.cost_model import CostModel, load_cost_model
from lightning_adaptiveload.data.index import (SampleIndex, build_index, check_shards, index_fingerprint, read_index,
                                               read_members, scan_shard)
from lightning_adaptiveload.data.shards import (LATENT_SUFFIXES, SKIPPED_KEY, BadSample, check_config,
                                                decode_meta, decode_sample, failed_batch, inspect_sample,
                                                mix_latent_shapes, raise_if_any_batch_failed, resolve_shards,
                                                shape_for_tokens, write_synthetic_shards, write_text)
from lightning_adaptiveload.data.webdataset_stream import StreamingLatentDataset
from lightning_adaptiveload.scheduling.policies import batch_sizes, check_policy, require_int
from lightning_adaptiveload.scheduling.sampler import BucketBatchSampler, resolve_compute_budget
from lightning_adaptiveload.scheduling.shapes import ShapeMix, TokenSpec, read_shapes_jsonl
from lightning_adaptiveload.scheduling.stream_batcher import make_stream_plan

log = logging.getLogger(__name__)

REFERENCE_MIX = str(Path(__file__).with_name("reference_mix.jsonl"))
PROBE_SAMPLES = 256  # streaming without a shapes file: valid samples read at setup to learn the mix


# --- scheduling keys -------------------------------------------------------------------------

def schedule_keys(shapes: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """(N,) int64 token count each sample is scheduled at. The sampler buckets by token count, but
    a batch must hold one latent shape: where distinct shapes share a token count (480x832 and
    832x480), all but the first (sorted by tokens, T, H, W) get the next free count above, so each
    bucket is one shape. Batch sizes computed at a count >= the true tokens stay memory-safe."""
    distinct, inverse = np.unique(np.column_stack([tokens, shapes]), axis=0, return_inverse=True)
    keys = distinct[:, 0].copy()
    for i in range(1, len(keys)):
        keys[i] = max(keys[i], keys[i - 1] + 1)
    return keys[inverse.reshape(-1)]


# --- map-style dataset and collation ------------------------------------------------------------

class IndexedShardDataset(Dataset):
    """Samples of an index, read by byte offset. Item i is a decoded sample dict, or
    {"key", "skip": reason} when it fails to read or decode (counted by the collate function)."""

    def __init__(self, index: SampleIndex, decode_kwargs: dict):
        self.index = index
        self.decode_kwargs = decode_kwargs
        self._fds: OrderedDict[str, int] = OrderedDict()  # opened lazily: each DataLoader worker has its own

    def __len__(self) -> int:
        return len(self.index)

    def __getstate__(self) -> dict:
        # Spawned/forkserver DataLoader workers get a pickled copy: descriptor numbers opened here
        # would name other files (or none) there, so the copy starts with no open shards.
        return {**self.__dict__, "_fds": OrderedDict()}

    def __getitem__(self, i: int) -> dict:
        key = self.index.key(i)
        try:
            files = read_members(self._fds, self.index.shard_path(i), self.index.members(i), key)
            return decode_sample(key, files, **self.decode_kwargs)
        except BadSample as e:
            return {"key": key, "skip": e.reason, "detail": str(e)}


def collate_samples(samples: list[dict], text_len: int, text_dim: int) -> dict:
    """Batch dict of decoded samples, written straight into float32 batch tensors; skip markers
    become batch["skipped"] (reason -> count). Samples whose shape differs from the batch's most
    common one (two unplanned shapes with equal tokens in one streaming bucket) are skipped as
    "shape_collision". If no sample of the batch survived: a `failed_batch` marker, on which
    `on_before_batch_transfer` stops every rank together."""
    good = [s for s in samples if "skip" not in s]
    skipped = Counter(s["skip"] for s in samples if "skip" in s)
    if not good:
        return failed_batch(samples)
    shape = Counter(s["latent_shape"] for s in good).most_common(1)[0][0]  # ties: the first sample's
    skipped["shape_collision"] += sum(s["latent_shape"] != shape for s in good)
    good = [s for s in good if s["latent_shape"] == shape]
    latents = torch.empty(len(good), *good[0]["latent"].shape)
    text = torch.empty(len(good), text_len, text_dim)
    for i, sample in enumerate(good):
        latents[i].copy_(sample["latent"])
        write_text(text[i], sample)
    return {
        "latents": latents,
        "text": text,
        "seq_len": int(good[0]["seq_len"]),
        "latent_shape": tuple(shape),
        "keys": [s["key"] for s in good],
        SKIPPED_KEY: {k: v for k, v in skipped.items() if v},
    }


def _as_is(batch):
    return batch


class ResumableLoader(DataLoader):
    """A DataLoader that Lightning checkpoints (it has state_dict / load_state_dict) and that moves
    its data to the trainer's epoch when iteration starts (Lightning calls set_epoch only on a
    loader's `sampler`, not on a custom batch sampler or an iterable dataset).

    Map-style: the state is the BucketBatchSampler's, with the step count of batches this loader
    handed out (not those its sampler dispatched to workers ahead of time), so a resume neither
    repeats nor skips a sample. Streaming: the state is (epoch, steps done); a resume runs the
    remaining steps of the epoch from a fresh position of the (resampled) stream."""

    def __init__(self, *args, epoch_fn=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.epoch_fn = epoch_fn
        self.steps_taken = 0

    @property
    def streaming(self) -> bool:
        return isinstance(self.dataset, StreamingLatentDataset)

    def _start_epoch(self) -> int:
        """Move to the trainer's epoch if it changed; returns the steps of this epoch already taken."""
        epoch = self.epoch_fn() if self.epoch_fn is not None else None
        if self.streaming:
            data = self.dataset
            if epoch is not None and epoch != data.epoch:
                data.epoch, data.steps_done = epoch, 0
            elif data.steps_done >= data.steps_per_epoch:
                data.steps_done = 0
            return data.steps_done
        sampler = self.batch_sampler
        if epoch is not None and epoch != sampler.epoch:
            sampler.set_epoch(epoch)
        return len(sampler.plan().steps) - len(sampler)

    def __iter__(self):
        self.steps_taken = self._start_epoch()
        for batch in super().__iter__():
            self.steps_taken += 1
            yield batch
        if self.streaming:
            self.dataset.steps_done = 0

    def __len__(self) -> int:
        """Steps of the whole epoch, also after a resume (Lightning reads the length after
        restoring the state and counts the restored steps towards it)."""
        if self.streaming:
            return self.dataset.steps_per_epoch
        earlier = sum(k for _, k in self.batch_sampler.state_dict()["segments"][:-1])
        return earlier + len(self.batch_sampler.plan().steps)

    def state_dict(self) -> dict:
        if self.streaming:
            return {"streaming": True, "epoch": self.dataset.epoch, "steps_done": self.steps_taken,
                    "steps_per_epoch": self.dataset.steps_per_epoch}
        return self.batch_sampler.state_dict(steps_consumed=self.steps_taken)

    def load_state_dict(self, state: dict) -> None:
        if self.streaming != bool(state.get("streaming")):
            raise ValueError("loader state was saved by the other data path (map-style vs streaming)")
        if not self.streaming:
            self.batch_sampler.load_state_dict(state)
            return
        if state["steps_per_epoch"] != self.dataset.steps_per_epoch:
            raise ValueError(f"loader state has steps_per_epoch {state['steps_per_epoch']}, "
                             f"this run {self.dataset.steps_per_epoch}")
        self.dataset.epoch, self.dataset.steps_done = int(state["epoch"]), int(state["steps_done"])


# --- the DataModule -----------------------------------------------------------------------------

class AdaptiveLoadDataModule(L.LightningDataModule):
    """Bucketed latent batches from tar shards for video DiT training.

    Args (plain types, settable from LightningCLI YAML):
        shards: tar paths / brace pattern / folder, or a list of them.
        index: JSONL index from `adaptiveload index` -> map-style path; None -> streaming path.
        policy: "token_equal" | "dual_constraint" | "balanced".
        m_mem: memory budget, tokens per batch (B*S <= m_mem).
        m_comp, p: compute budget B*S^p <= m_comp; derived from the cost model when None.
        cost_model: path of a fitted cost-model JSON or a measurements JSON (or set later by
            `set_cost_model`, e.g. by the calibration callback).
        max_seq_len: longest sample in tokens (default m_mem); longer ones are dropped or resized.
        oversize: "drop" | "resize" (H, W scaled down keeping aspect, then T cropped if needed).
        vae_stride_t, vae_stride_s, patch, extra_tokens: TokenSpec (tokens of a latent use only
            patch and extra_tokens; the strides map pixel shapes of a shapes file).
        latent_channels: C of every latent. text_len, text_dim: (L, D_text) of the text entry.
        num_workers: DataLoader workers. seed: shuffling seed (all ranks share it).
        steps_per_epoch: batches per rank per epoch on the streaming path.
        shuffle_buffer: decoded samples shuffled before bucketing (streaming), per worker.
        max_buffer_samples, max_buffer_bytes: bound of the streaming batcher's bucket buffers, per
            worker (samples, bytes of decoded tensors).
        shapes: shapes JSONL describing the stream's mix (streaming: bucket table for calibration).
        synthesize: if set and `shards` (a folder) holds no tars, `prepare_data` writes this many
            synthetic samples there (and the index, if `index` is set and missing).
        synthesize_shapes: shapes JSONL to draw them from (default: the shipped reference mix).
        synthesize_latent_scale: latent H, W scale of synthesized samples (small for CPU demos).
        index_cache: load the index from its binary cache `<index>.npz` when that was made from the
            index's current bytes, and (re)write it after a parse; False: always parse, write nothing.
    """

    def __init__(self, shards: str | list[str], index: str | None = None, policy: str = "balanced",
                 m_mem: int = 65536, m_comp: float | None = None, p: float | None = None,
                 cost_model: str | None = None, max_seq_len: int | None = None, oversize: str = "drop",
                 vae_stride_t: int = 4, vae_stride_s: int = 8, patch: tuple[int, int, int] = (1, 2, 2),
                 extra_tokens: int = 0, latent_channels: int = 16, text_len: int = 512, text_dim: int = 4096,
                 num_workers: int = 2, seed: int = 0, steps_per_epoch: int | None = None,
                 shuffle_buffer: int = 64, max_buffer_samples: int = 4096, max_buffer_bytes: int = 1 << 30,
                 shapes: str | None = None, synthesize: int | None = None,
                 synthesize_shapes: str | None = None, synthesize_latent_scale: float = 1.0,
                 index_cache: bool = True):
        super().__init__()
        check_policy(policy)
        if oversize not in ("drop", "resize"):
            raise ValueError(f"oversize must be 'drop' or 'resize', got {oversize!r}")
        for name, value in (("m_mem", m_mem), ("latent_channels", latent_channels), ("text_len", text_len),
                            ("text_dim", text_dim)):
            require_int(name, value)
        self.save_hyperparameters()
        self.shards, self.index_path, self.policy = shards, index, policy
        self.m_mem, self.m_comp, self.p = int(m_mem), m_comp, p
        self.max_seq_len = require_int("max_seq_len (tokens)", m_mem if max_seq_len is None else max_seq_len)
        self.oversize = oversize
        self.spec = TokenSpec(vae_stride_t, vae_stride_s, tuple(patch), extra_tokens)
        self.latent_channels, self.text_len, self.text_dim = latent_channels, text_len, text_dim
        self.num_workers, self.seed = num_workers, seed
        self.steps_per_epoch, self.shuffle_buffer, self.shapes = steps_per_epoch, shuffle_buffer, shapes
        self.max_buffer_samples, self.max_buffer_bytes = max_buffer_samples, max_buffer_bytes
        self.synthesize, self.synthesize_shapes = synthesize, synthesize_shapes
        self.synthesize_latent_scale = synthesize_latent_scale
        self.index_cache = index_cache
        self.cost_model: CostModel | None = load_cost_model(cost_model) if cost_model else None
        self.skipped: Counter = Counter()
        self.dataset: IndexedShardDataset | None = None
        self._keys = None  # map-style: (N,) scheduled token count per indexed sample
        self._key_shape: dict[int, tuple[int, int, int]] = {}  # scheduled count -> latent (T, H, W)
        self._key_count: dict[int, int] = {}  # scheduled count -> samples (index) or weight (shapes mix)

    # -- data preparation and setup --

    def prepare_data(self) -> None:
        """With `synthesize`: write synthetic shards (and the index) where they are missing."""
        if not self.synthesize:
            return
        if not isinstance(self.shards, str) or "{" in self.shards or self.shards.endswith(".tar"):
            raise ValueError(f"synthesize needs `shards` to be one folder to write into, got {self.shards!r}")
        folder = Path(self.shards)
        if not any(folder.glob("*.tar")):
            mix = read_shapes_jsonl(self.synthesize_shapes or REFERENCE_MIX, self.spec)
            write_synthetic_shards(mix, self.synthesize, folder, spec=self.spec, seed=self.seed,
                                   latent_channels=self.latent_channels,
                                   latent_scale=self.synthesize_latent_scale)
        if self.index_path and not Path(self.index_path).exists():
            build_index(resolve_shards(str(folder)), self.index_path, self.spec)

    def setup(self, stage: str | None = None) -> None:
        """Resolve shards (clear error if missing), read the index and check every row against
        this configuration (failures counted in `skipped`), build the shape table. Runs once."""
        if self._key_shape:
            return
        self.shard_paths = resolve_shards(self.shards)
        if self.index_path:
            self._setup_indexed()
        else:
            self._setup_streaming()

    def _set_table(self, shapes: np.ndarray, tokens: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """Scheduling keys of (n, 3) shapes with (n,) tokens; fills the bucket table; returns keys."""
        keys = schedule_keys(shapes, tokens)
        distinct, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        counts = np.bincount(inverse.reshape(-1), weights=weights, minlength=len(distinct))
        self._key_shape = {int(k): tuple(int(v) for v in shapes[i]) for k, i in zip(distinct, first)}
        self._key_count = {int(k): int(c) for k, c in zip(distinct, counts)}
        return keys

    def _setup_indexed(self) -> None:
        index = read_index(self.index_path, cache=self.index_cache)
        if not len(index):
            raise ValueError(f"index {self.index_path!r} lists no samples")
        check_shards(index, self.index_path)  # missing or changed shards: a clear error before "outside `shards`"
        # realpath on both sides: the index resolves symlinks (its folder's), `shards` may not.
        known = {os.path.realpath(p) for p in self.shard_paths}
        foreign = np.flatnonzero([os.path.realpath(p) not in known for p in index.shard_paths])
        if len(foreign):
            raise ValueError(f"index {self.index_path!r} refers to {int(np.isin(index.shard, foreign).sum())} "
                             f"samples in shards outside `shards`, e.g. {index.shard_paths[foreign[0]]!r}")
        # The checks depend only on (C, T, H, W, D_text): run them once per distinct combination.
        combos, first, combo_of = np.unique(
            np.column_stack([index.channels, index.latent_shape, index.text_shape[:, 1]]), axis=0,
            return_index=True, return_inverse=True)
        combo_of = combo_of.reshape(-1)
        combo_size = np.bincount(combo_of, minlength=len(combos))
        fits = np.zeros(len(combos), dtype=bool)
        combo_thw, combo_tokens = np.zeros((len(combos), 3), np.int64), np.zeros(len(combos), np.int64)
        skipped = Counter()
        for c, (channels, t, h, w, text_dim) in enumerate(combos.tolist()):
            try:
                combo_thw[c], combo_tokens[c] = check_config(index.key(first[c]), channels, (t, h, w),
                                                             None if text_dim < 0 else text_dim, **self._check_kwargs())
                fits[c] = True
            except BadSample as e:
                skipped[e.reason] += int(combo_size[c])
        self._count_skipped(skipped, where=f"index {self.index_path}")
        kept = np.flatnonzero(fits[combo_of])
        if not len(kept):
            raise ValueError(f"no sample of index {self.index_path!r} fits this configuration "
                             f"(skipped: {dict(skipped)})")
        self._keys = self._set_table(combo_thw[combo_of[kept]], combo_tokens[combo_of[kept]],
                                     np.ones(len(kept), dtype=np.int64))
        if len(kept) < len(index):
            index = index.take(kept)
        self.dataset = IndexedShardDataset(index, self._decode_kwargs())

    def _setup_streaming(self) -> None:
        require_int("steps_per_epoch (needed on the streaming path, without an index)", self.steps_per_epoch)
        mix_file = self.shapes or self.synthesize_shapes
        probed, probe_skipped = self._probe(1 if mix_file else PROBE_SAMPLES)
        if not probed:
            raise ValueError(f"no valid sample in the {len(self.shard_paths)} shards of {self.shards!r} for this "
                             f"configuration (skipped: {dict(probe_skipped)})")
        if mix_file:
            mix = read_shapes_jsonl(mix_file, self.spec)
            scale = self.synthesize_latent_scale if not self.shapes else 1.0
            rows = []
            for thw, count in zip(mix_latent_shapes(mix, self.spec, scale), mix.counts):
                try:
                    thw, tokens = check_config("shapes mix", self.latent_channels, tuple(int(v) for v in thw), None,
                                               **self._check_kwargs())
                except BadSample:
                    continue
                rows.append((*thw, tokens, int(count)))
            if not rows:
                raise ValueError(f"no shape of {mix_file!r} fits max_seq_len={self.max_seq_len}")
        else:
            rows = [(*thw, tokens, n) for (thw, tokens), n in Counter(probed).items()]
        rows = np.asarray(rows, dtype=np.int64)
        self._set_table(rows[:, :3], rows[:, 3], rows[:, 4])

    def _probe(self, limit: int) -> tuple[list, Counter]:
        """Up to `limit` (latent (T, H, W), tokens) of valid samples from the first shards, and skip
        counts. Samples are decoded in full until one passes; after that only their JSON is read
        (the shapes estimate the mix; the stream validates every sample anyway)."""
        found, skipped = [], Counter()
        for shard in self.shard_paths:
            for key, spans, files, error in scan_shard(shard, read={"json"} if found else None):
                try:
                    if error is not None:
                        raise error
                    if found:
                        if not any(s in spans for s in LATENT_SUFFIXES):
                            raise BadSample("missing_latent", key)
                        thw = tuple(decode_meta(files.get("json"), key)["latent_shape"])
                        found.append(check_config(key, self.latent_channels, thw, None, **self._check_kwargs()))
                    else:
                        _, latent, text = inspect_sample(key, files)
                        found.append(check_config(key, latent.shape[0], tuple(latent.shape[1:]),
                                                  None if text is None else text.shape[1], **self._check_kwargs()))
                except BadSample as e:
                    skipped[e.reason] += 1
                if len(found) >= limit:
                    return found, skipped
        return found, skipped

    def _check_kwargs(self) -> dict:
        return {"spec": self.spec, "latent_channels": self.latent_channels, "text_dim": self.text_dim,
                "max_seq_len": self.max_seq_len, "oversize": self.oversize}

    def _collate(self):
        return functools.partial(collate_samples, text_len=self.text_len, text_dim=self.text_dim)

    def _decode_kwargs(self) -> dict:
        return {**self._check_kwargs(), "text_len": self.text_len}

    # -- bucket table, cost model --

    def bucket_seq_lens(self) -> np.ndarray:
        """(K,) int64 distinct scheduled token counts, ascending (after setup)."""
        if not self._key_shape:
            raise RuntimeError("bucket_seq_lens() needs setup() first (and an index or a shapes mix)")
        return np.asarray(sorted(self._key_shape), dtype=np.int64)

    def bucket_table(self) -> list[dict]:
        """One row per bucket: seq_len (scheduled tokens), latent_shape, samples (in the index; on
        the streaming path the shapes mix's count or probed samples), batch_size under the current
        policy, cost model and m_mem."""
        seq_lens = self.bucket_seq_lens()
        m_comp, p = resolve_compute_budget(self.policy, self.m_mem, int(seq_lens[-1]), self.m_comp, self.p,
                                           self.cost_model)
        sizes = batch_sizes(seq_lens, self.policy, self.m_mem, m_comp, p)
        return [{"seq_len": int(s), "latent_shape": self._key_shape[int(s)], "samples": self._key_count[int(s)],
                 "batch_size": int(b)} for s, b in zip(seq_lens, sizes)]

    def set_cost_model(self, cost_model: CostModel, m_mem: int | None = None) -> None:
        """Use `cost_model` (and `m_mem`, tokens) for batch sizes from now on; call before the
        train loader is built (the calibration callback does, in on_fit_start)."""
        self.cost_model = cost_model
        if m_mem is not None:
            self.m_mem = int(m_mem)
        if self._key_shape and max(self._key_shape) > self.m_mem:
            # Samples were admitted at setup under max_seq_len; the new memory budget is lower.
            log.warning("adaptiveload data: m_mem is now %d tokens but buckets up to %d tokens are scheduled "
                        "(max_seq_len %d); they run at batch size 1 and may not fit in memory. Set max_seq_len "
                        "<= m_mem to drop or resize them.", self.m_mem, max(self._key_shape), self.max_seq_len)

    # -- batches --

    def synthetic_batch(self, seq_len_or_shape: int | tuple[int, int, int], batch_size: int) -> dict:
        """A batch with the exact structure of training batches and N(0, 1) data. An int is a
        scheduled token count: its bucket's latent shape (or, if no bucket has it, a shape with
        exactly that many tokens); a (T, H, W) tuple is used as is."""
        if isinstance(seq_len_or_shape, (int, np.integer)):
            thw = self._key_shape.get(int(seq_len_or_shape)) or shape_for_tokens(int(seq_len_or_shape), self.spec)
        else:
            thw = tuple(int(v) for v in seq_len_or_shape)
        return {
            "latents": torch.randn(batch_size, self.latent_channels, *thw),
            "text": torch.randn(batch_size, self.text_len, self.text_dim),
            "seq_len": self.spec.tokens_from_latent(*thw),
            "latent_shape": thw,
            "keys": [f"synthetic{i}" for i in range(batch_size)],
        }

    def build_sampler(self, num_replicas: int | None = None, rank: int | None = None) -> BucketBatchSampler:
        """The map-style batch sampler for the current configuration and cost model."""
        if self._keys is None:
            raise RuntimeError("build_sampler() needs setup() with an index first")
        return BucketBatchSampler(self._keys, policy=self.policy, m_mem=self.m_mem, m_comp=self.m_comp, p=self.p,
                                  cost_model=self.cost_model, num_replicas=num_replicas, rank=rank,
                                  seed=self.seed, max_seq_len=int(self._keys.max()),
                                  dataset_fingerprint=index_fingerprint(self.dataset.index, self._keys))

    def build_stream_dataset(self, num_replicas: int = 1, rank: int = 0) -> StreamingLatentDataset:
        """The streaming dataset of one rank for the current configuration and cost model."""
        seq_lens = self.bucket_seq_lens()
        mix = ShapeMix(tokens=seq_lens, counts=np.array([self._key_count[int(k)] for k in seq_lens]),
                       latent_thw=np.array([self._key_shape[int(k)] for k in seq_lens]))
        # True tokens are checked against max_seq_len when decoding; keys may sit above it by at
        # most the number of planned keys (collision offsets), which the batcher must accept.
        plan = make_stream_plan(mix, policy=self.policy, m_mem=self.m_mem, m_comp=self.m_comp, p=self.p,
                                cost_model=self.cost_model,
                                max_seq_len=max(self.max_seq_len, int(seq_lens[-1])) + len(seq_lens))
        keys = {shape: key for key, shape in self._key_shape.items()}
        readers = num_replicas * max(1, self.num_workers)
        per_reader, rest = divmod(len(self.shard_paths), readers)
        if per_reader and rest:
            # Every reader yields the same number of batches, so a shorter slice is cycled faster.
            log.warning("adaptiveload data: %d shards over %d readers (ranks x workers): %d readers stream %d "
                        "shards and read each %.0f%% more often than the others' %d; use a multiple of %d shards "
                        "for an unbiased mix", len(self.shard_paths), readers, readers - rest, per_reader,
                        100 / per_reader, per_reader + 1, readers)
        return StreamingLatentDataset(self.shard_paths, plan, keys=keys, decode_kwargs=self._decode_kwargs(),
                                      collate=self._collate(), steps_per_epoch=self.steps_per_epoch, rank=rank,
                                      world_size=num_replicas, seed=self.seed, shuffle_buffer=self.shuffle_buffer,
                                      max_buffer_samples=self.max_buffer_samples,
                                      max_buffer_bytes=self.max_buffer_bytes)

    def build_train_loader(self, num_replicas: int | None = None, rank: int | None = None,
                           epoch_fn: Callable[[], int] | None = None) -> ResumableLoader:
        """The train loader of `rank` out of `num_replicas` (default: torch.distributed's, else
        1 and 0), either path. `epoch_fn() -> int` moves it to a new epoch on each iteration."""
        common = dict(num_workers=self.num_workers, pin_memory=torch.cuda.is_available(), epoch_fn=epoch_fn)
        if self.dataset is not None:
            return ResumableLoader(self.dataset, batch_sampler=self.build_sampler(num_replicas, rank),
                                   collate_fn=self._collate(), persistent_workers=self.num_workers > 0, **common)
        if num_replicas is None or rank is None:
            world = torch.distributed.is_available() and torch.distributed.is_initialized()
            num_replicas = torch.distributed.get_world_size() if world else 1
            rank = torch.distributed.get_rank() if world else 0
        # Workers restart each epoch so they see the dataset's new epoch (a fork copies it). Batches
        # come collated; the default conversion would turn latent_shape tuples into lists.
        return ResumableLoader(self.build_stream_dataset(num_replicas, rank), batch_size=None,
                               collate_fn=_as_is, **common)

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        if trainer is None:
            return self.build_train_loader()
        map_style = self.dataset is not None
        if map_style and trainer.world_size > 1 and trainer._accelerator_connector.use_distributed_sampler:
            raise ValueError("AdaptiveLoadDataModule plans batches for every rank itself: create the Trainer with "
                             "use_distributed_sampler=False")
        return self.build_train_loader(trainer.world_size, trainer.global_rank,
                                       epoch_fn=lambda: self.trainer.current_epoch)

    # -- skip accounting --

    def _count_skipped(self, counts: dict, where: str) -> None:
        counts = {k: v for k, v in counts.items() if v}
        if not counts:
            return
        self.skipped.update(counts)
        log.warning("adaptiveload data: skipped %d samples in %s (%s); total on this rank: %s", sum(counts.values()),
                    where, ", ".join(f"{k}={v}" for k, v in sorted(counts.items())), dict(self.skipped))

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        if isinstance(batch, dict) and SKIPPED_KEY in batch:
            self._count_skipped(batch.pop(SKIPPED_KEY), where="the train stream")
            raise_if_any_batch_failed(batch, self.trainer.strategy if self.trainer is not None else None)
        return batch
