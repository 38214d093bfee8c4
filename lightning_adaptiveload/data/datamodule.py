"""AdaptiveLoadDataModule: batches of video latents from WebDataset shards, sized per bucket by a
batch-size policy, the same number of batches on every rank.

The DataModule holds the configuration (its constructor arguments are LightningCLI's YAML keys),
the scheduling budgets and cost model, and the skip counts; the data itself comes from one of two
sources, chosen at setup:
- `MapStyleSource` (data/map_style.py, `index` given): every sample's shape is known from the
  index; the `BucketBatchSampler` plans each epoch globally (balanced across ranks, resumable
  mid-epoch) and samples are read by byte offset from the tars.
- `StreamingSource` (data/webdataset_stream.py, no index): a webdataset pipeline per DataLoader
  worker over explicitly split, endlessly re-shuffled shards, bucketed on the fly by the
  streaming stage, with a fixed `steps_per_epoch`.

Batch dict (see docs/data.md): latents (B, C, T, H, W) float32, text (B, L, D_text) float32,
seq_len int (tokens per sample), latent_shape (T, H, W), keys list[str], and under a memory plan
ac_blocks int (blocks to checkpoint, for PerBucketCheckpointing; docs/memory.md).
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import lightning as L
import numpy as np
import torch

from lightning_adaptiveload._distributed import world_size_and_rank
from lightning_adaptiveload._validation import require_choice, require_int
from lightning_adaptiveload.data.index import build_index
from lightning_adaptiveload.data.map_style import MapStyleSource
from lightning_adaptiveload.data.shards import (SKIPPED_KEY, raise_if_any_batch_failed, resolve_shards, shape_for_tokens,
                                                write_synthetic_shards)
from lightning_adaptiveload.data.source import SampleConfig, TrainLoader
from lightning_adaptiveload.data.webdataset_stream import StreamingSource
from lightning_adaptiveload.scheduling.buckets import OVERSIZE, BucketTable, ScheduledShape, schedule_keys
from lightning_adaptiveload.scheduling.cost_model import CostModel, load_cost_model
from lightning_adaptiveload.scheduling.depth_cost_model import DepthCostModel
from lightning_adaptiveload.scheduling.depth_choice import MemoryPlan
from lightning_adaptiveload.scheduling.epoch_plan import DROP_COUNTERS
from lightning_adaptiveload.scheduling.memory_model import MemoryModel
from lightning_adaptiveload.scheduling.policies import POLICIES
from lightning_adaptiveload.scheduling.sampler import BucketBatchSampler
from lightning_adaptiveload.scheduling.shapes import ShapeMix, TokenSpec, read_shapes_jsonl
from lightning_adaptiveload.scheduling.verification import Verification

log = logging.getLogger(__name__)

REFERENCE_MIX = str(Path(__file__).with_name("reference_mix.jsonl"))


class AdaptiveLoadDataModule(L.LightningDataModule):
    """Bucketed latent batches from tar shards for video DiT training.

    Args (plain types, settable from LightningCLI YAML):
        shards: tar paths / brace pattern / folder, or a list of them.
        index: JSONL index from `adaptiveload index` -> map-style path; None -> streaming path.
        policy: "token_equal" | "dual_constraint" | "balanced".
        m_mem: memory budget, tokens per batch (B*S <= m_mem); under a memory plan the token cap of
            balanced batches (a sample longer than it runs at B = 1).
        m_comp, p: compute budget B*S^p <= m_comp; derived from the cost model when None.
        cost_model: path of a fitted cost-model JSON or a measurements JSON (or set later by
            `set_cost_model`, e.g. by the calibration callback).
        max_seq_len: longest sample in tokens (default m_mem; with memory_planning, no bound);
            longer ones are dropped or resized.
        memory_planning: plan batches with measured memory (docs/memory.md): CostModelCalibration,
            with PerBucketCheckpointing among the callbacks, hands over a memory plan
            (`set_memory_plan`); then balanced batches get each bucket's (B, k) from it, every batch
            carries "ac_blocks", and a sample longer than m_mem is trained at B = 1 when it fits the
            device with every block checkpointed. Samples are admitted at setup up to max_seq_len
            (None: all); the plan leaves out, counted, only those that fit the device nowhere. Until
            a plan is set (or if calibration cannot fit one), samples longer than m_mem are left out
            of the schedule, counted, as without this flag.
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
        drop_last: map-style: drop each bucket's last partial batch and the batches that cannot fill
            a last step (True), or keep every sample, in smaller batches, with the same number of
            steps on every rank (False); None (default): False for balanced, which prices every
            batch, True for the token-budget policies (`policies.keeps_partial_batches`; what it
            costs: docs/data.md). The streaming path never drops a partial batch.
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
                 index_cache: bool = True, drop_last: bool | None = None, memory_planning: bool = False):
        super().__init__()
        require_choice("policy", policy, POLICIES)
        require_choice("oversize", oversize, OVERSIZE)
        if memory_planning and max_seq_len is None and oversize == "resize":
            raise ValueError("oversize='resize' resizes samples to max_seq_len: with memory_planning give max_seq_len "
                             "(tokens), or use oversize='drop' and let the memory plan decide which samples fit")
        for name, value in (("m_mem", m_mem), ("latent_channels", latent_channels), ("text_len", text_len),
                            ("text_dim", text_dim)):
            require_int(name, value)
        self.save_hyperparameters()
        self.shards, self.index_path, self.policy = shards, index, policy
        self.m_mem, self.m_comp, self.p = int(m_mem), m_comp, p
        self.memory_planning = bool(memory_planning)
        # admission bound at setup; None (memory planning): every sample, the memory plan decides
        self.max_seq_len: int | None = (None if memory_planning else int(m_mem)) if max_seq_len is None \
            else require_int("max_seq_len (tokens)", max_seq_len)
        self.oversize = oversize
        self.spec = TokenSpec(vae_stride_t, vae_stride_s, tuple(patch), extra_tokens)
        self.latent_channels, self.text_len, self.text_dim = latent_channels, text_len, text_dim
        self.num_workers, self.seed = num_workers, seed
        self.steps_per_epoch, self.shuffle_buffer, self.shapes = steps_per_epoch, shuffle_buffer, shapes
        self.max_buffer_samples, self.max_buffer_bytes = max_buffer_samples, max_buffer_bytes
        self.synthesize, self.synthesize_shapes = synthesize, synthesize_shapes
        self.synthesize_latent_scale = synthesize_latent_scale
        self.index_cache, self.drop_last = index_cache, None if drop_last is None else bool(drop_last)
        self.cost_model: CostModel | None = load_cost_model(cost_model) if cost_model else None
        self.memory_plan: MemoryPlan | None = None  # set_memory_plan
        self.verification: Verification | None = None  # set_verification
        self.skipped: Counter = Counter()  # reason -> samples skipped on this rank, setup and stream
        self.source: MapStyleSource | StreamingSource | None = None
        self.mix: ShapeMix | None = None  # the shapes found at setup, one row per distinct shape
        self._key_shape: dict[int, tuple[int, int, int]] = {}  # scheduled token count -> latent (T, H, W)
        self._train_loader: TrainLoader | None = None

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
        """Resolve shards (clear error if missing), pick the source (map-style with an index, else
        streaming) and let it find the shapes (index rows checked against this configuration,
        failures counted in `skipped`). Runs once."""
        if self.source is not None:
            return
        shard_paths = resolve_shards(self.shards)
        config = SampleConfig(self.spec, self.latent_channels, self.text_len, self.text_dim, self.max_seq_len,
                              self.oversize)
        if self.index_path:
            source = MapStyleSource(self.index_path, shard_paths, config, num_workers=self.num_workers,
                                    seed=self.seed, drop_last=self.drop_last, index_cache=self.index_cache)
        else:
            source = StreamingSource(shard_paths, config, steps_per_epoch=self.steps_per_epoch,
                                     mix_file=self.shapes or self.synthesize_shapes,
                                     mix_scale=1.0 if self.shapes else self.synthesize_latent_scale,
                                     num_workers=self.num_workers, seed=self.seed, shuffle_buffer=self.shuffle_buffer,
                                     max_buffer_samples=self.max_buffer_samples, max_buffer_bytes=self.max_buffer_bytes)
        self.mix = source.setup(self._count_skipped)
        keys = schedule_keys(self.mix.latent_thw, self.mix.tokens)
        self._key_shape = {int(k): tuple(int(v) for v in thw) for k, thw in zip(keys, self.mix.latent_thw)}
        self.source = source

    # -- bucket table, cost model --

    def _scheduling(self) -> dict:
        """What the bucket table and the sources plan with; max_seq_len is the longest sample (true
        tokens) to schedule: the admission bound, lowered to what the memory plan fits, or to m_mem
        under memory_planning while no plan is set."""
        bound = self.max_seq_len
        if self.memory_plan is not None:  # (a clear error when not even the shortest sample fits)
            plan = self.memory_plan
            bound = plan.limit_seq_len(plan.max_seq_len if bound is None else bound,
                                       int(self.mix.tokens.min()) if self.mix is not None else 1)
        elif self.memory_planning:
            bound = self.m_mem if bound is None else min(bound, self.m_mem)
        return {"policy": self.policy, "m_mem": self.m_mem, "m_comp": self.m_comp, "p": self.p,
                "cost_model": self.cost_model, "memory_plan": self.memory_plan, "verification": self.verification,
                "max_seq_len": bound}

    def bucket_seq_lens(self) -> np.ndarray:
        """(K,) int64 distinct scheduled token counts, ascending (after setup)."""
        if not self._key_shape:
            raise RuntimeError("bucket_seq_lens() needs setup() first (and an index or a shapes mix)")
        return np.asarray(sorted(self._key_shape), dtype=np.int64)

    def bucket_table(self) -> BucketTable:
        """The buckets under the current policy, cost model and m_mem (after setup): samples are the
        index's (map-style) or the shapes mix's weights or probed samples (streaming)."""
        if self.mix is None:
            raise RuntimeError("bucket_table() needs setup() first")
        return BucketTable.build(self.mix.tokens, self.mix.counts, self.mix.latent_thw, **self._scheduling())

    def step_cost_model(self):
        """What the schedule prices a batch of (B, S) by, in ms (and `LoadBalanceMonitor` its load):
        `BucketTable.step_cost_model`: the measured step times of a verification where they exist,
        under a memory plan the step time at the checkpointing depth of the bucket scheduled at S,
        else `cost_model` (None before one is set)."""
        if self.memory_plan is None and self.verification is None:
            return self.cost_model
        return self.bucket_table().step_cost_model(self.cost_model)

    def set_cost_model(self, cost_model: CostModel | None, m_mem: int | None = None, policy: str | None = None) -> None:
        """Use `cost_model` (and `m_mem`, tokens; `policy`) for batch sizes from now on, without a
        memory plan (call set_memory_plan after it for one); call before the train loader is built
        (the calibration callback does, in on_fit_start; it passes cost_model=None and
        policy="token_equal" when its fit is not trusted)."""
        if policy is not None:
            self.policy = require_choice("policy", policy, POLICIES)
        if cost_model is None and self.policy != "token_equal" and (self.m_comp is None or self.p is None):
            raise ValueError(f"policy {self.policy!r} needs a cost model (or m_comp and p)")
        self.cost_model = cost_model
        self.memory_plan = self.verification = None
        if m_mem is not None:
            self.m_mem = require_int("m_mem", m_mem)
        if not self.memory_planning and self._key_shape and max(self._key_shape) > self.m_mem:
            # Samples were admitted at setup under max_seq_len; the new memory budget is lower.
            log.warning("adaptiveload data: m_mem is now %d tokens but buckets up to %d tokens are scheduled "
                        "(max_seq_len %d); they run at batch size 1 and may not fit in memory. Set max_seq_len "
                        "<= m_mem to drop or resize them.", self.m_mem, max(self._key_shape), self.max_seq_len)

    def set_memory_plan(self, cost_model: DepthCostModel, memory_model: MemoryModel, device_memory_bytes: float,
                        max_memory_fraction: float = 0.85, plan_margin: float = 0.0) -> None:
        """Plan with measured memory from now on (docs/memory.md): `cost_model` (t(B, S, k) ms; its
        base, the time at k = L, becomes `self.cost_model`) and `memory_model` (peak bytes), the
        device's memory (bytes, one rank) and the share of it a step may be predicted to use, of which a
        bucket's first plan leaves `plan_margin` unused (scheduling/depth_choice.PLAN_MARGIN). Policy
        balanced then takes each bucket's (B, k) from `choose_batch_and_depth` with m_mem as the token
        cap; every batch carries its bucket's k as "ac_blocks"; samples that fit the device nowhere are
        left out, counted. Call before the train loader is built (CostModelCalibration does)."""
        if not isinstance(cost_model, DepthCostModel):
            raise ValueError(f"set_memory_plan needs a DepthCostModel (step time with a checkpointing depth), got "
                             f"{type(cost_model).__name__}")
        plan = MemoryPlan(memory_model, cost_model, device_memory_bytes, max_memory_fraction, plan_margin)
        self.cost_model, self.memory_plan = cost_model.base, plan
        if self.mix is not None:
            longest = plan.max_seq_len
            unfit = int(self.mix.counts[self.mix.tokens > longest].sum())
            if unfit:
                log.warning("adaptiveload data: %d admitted samples are longer than %d tokens, the longest that fits "
                            "the device at B = 1 with all %d blocks checkpointed (predicted peak <= %.2f GiB); they "
                            "are left out of the schedule (counted)", unfit, longest, plan.num_blocks,
                            plan.budget_bytes / 2**30)

    def set_verification(self, verification: Verification | None) -> None:
        """Plan within what running the scheduled shapes found (scheduling/verification.py): each
        bucket's limits on (B, k) and the measured step times the balanced plan prices batches with.
        Kept across `set_memory_plan` (calibration refits the models and keeps the limits); cleared
        by `set_cost_model`. Call before the train loader is built (CostModelCalibration does)."""
        if verification is not None and not isinstance(verification, Verification):
            raise ValueError(f"set_verification needs a Verification or None, got {type(verification).__name__}")
        self.verification = verification

    def memory_budget_bytes(self) -> float | None:
        """The memory (bytes, one rank) a step may hold under the current plan: the memory plan's
        budget, else the one verification held the scheduled shapes to; None with neither
        (`LoadBalanceMonitor` counts the steps over it)."""
        if self.memory_plan is not None:
            return self.memory_plan.budget_bytes
        return None if self.verification is None else self.verification.budget_bytes

    def scheduled_batch_shapes(self) -> list[ScheduledShape]:
        """Every (batch size, latent (T, H, W)) training can schedule, with its number of batches
        per epoch over all ranks and its depth k (None without a memory plan): on the map-style path
        from this epoch's plan for the trainer's world size (full batches of every bucket, and this
        epoch's partial ones); on the streaming path the full batch of every planned bucket,
        weighted by its expected count."""
        world = self.trainer.world_size if self.trainer is not None else 1
        if isinstance(self.source, MapStyleSource):
            sampler = self.build_sampler(world, 0)
            plan = sampler.plan()
            checkpointed = {row["seq_len"]: row["checkpointed"] for row in sampler.bucket_table.rows()}
            ids = plan.steps.ravel()
            pairs, counts = np.unique(np.column_stack([plan.batch_len[ids], plan.batch_seq_len[ids]]), axis=0,
                                      return_counts=True)
            return [ScheduledShape(int(b), self._key_shape[int(s)], int(n), checkpointed[int(s)])
                    for (b, s), n in zip(pairs, counts)]
        return [ScheduledShape(row["batch_size"], row["latent_shape"], max(1, round(row["samples"] / row["batch_size"])),
                               row["checkpointed"])
                for row in self.bucket_table().rows()]

    def _depth_of_shape(self) -> dict[tuple[int, int, int], int] | None:
        """latent (T, H, W) -> k of its bucket under the memory plan (None without one): what each
        batch carries as "ac_blocks"."""
        if self.memory_plan is None:
            return None
        return {row["latent_shape"]: row["checkpointed"] for row in self.bucket_table().rows()}

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
        if not isinstance(self.source, MapStyleSource):
            raise RuntimeError("build_sampler() needs setup() with an index first")
        return self.source.sampler(self._scheduling(), num_replicas, rank)

    def build_train_loader(self, num_replicas: int | None = None, rank: int | None = None,
                           epoch_fn: Callable[[], int] | None = None) -> TrainLoader:
        """The train loader of `rank` out of `num_replicas` (default: torch.distributed's, else
        1 and 0), either source. `epoch_fn() -> int` moves it to a new epoch on each iteration."""
        if self.source is None:
            raise RuntimeError("build_train_loader() needs setup() first")
        if num_replicas is None or rank is None:
            num_replicas, rank = world_size_and_rank()
        self._train_loader = self.source.train_loader(self._scheduling(), num_replicas, rank, epoch_fn)
        self._train_loader.depth_of_shape = self._depth_of_shape()
        return self._train_loader

    def train_dataloader(self) -> TrainLoader:
        trainer = self.trainer
        if trainer is None:
            return self.build_train_loader()
        loader = self.build_train_loader(trainer.world_size, trainer.global_rank,
                                         epoch_fn=lambda: self.trainer.current_epoch)
        if isinstance(loader.batch_sampler, BucketBatchSampler) and trainer.world_size > 1 \
                and trainer._accelerator_connector.use_distributed_sampler:
            raise ValueError("AdaptiveLoadDataModule plans batches for every rank itself: create the Trainer with "
                             "use_distributed_sampler=False")
        return loader

    # -- what is left out --

    def counters(self) -> dict[str, int]:
        """This epoch's samples left out on this rank's train loader ("dropped_oversize",
        "dropped_partial_batch", "dropped_step_remainder"; 0 before the loader exists) and the
        samples skipped as bad input so far on this rank ("skipped/<reason>"). docs/data.md
        explains each counter."""
        counts = self._train_loader.drop_counts() if self._train_loader is not None \
            else dict.fromkeys(DROP_COUNTERS, 0)
        counts.update({f"skipped/{reason}": int(n) for reason, n in sorted(self.skipped.items())})
        return counts

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
