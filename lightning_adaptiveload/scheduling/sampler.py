"""BucketBatchSampler: a rank's batches of the epoch plan (epoch_plan.py) for a map-style dataset
whose per-sample token counts are known, resumable mid-epoch, also on another world size.

It is a plain iterable with `__len__`, not a `torch.utils.data.Sampler` subclass: DataLoader takes
any iterable as `batch_sampler`, and Lightning only looks for `set_epoch` on it (README.md in this
folder says what was checked), so the scheduling core imports no torch.
"""
from __future__ import annotations

import logging
from typing import Iterator

import numpy as np

from lightning_adaptiveload._distributed import world_size_and_rank
from lightning_adaptiveload._validation import require_choice, require_int
from lightning_adaptiveload.scheduling.buckets import BucketTable, assign_buckets
from lightning_adaptiveload.scheduling.depth_choice import MemoryPlan
from lightning_adaptiveload.scheduling.epoch_plan import EpochPlan, group_by_bucket, plan_epoch
from lightning_adaptiveload.scheduling.policies import POLICIES, keeps_partial_batches
from lightning_adaptiveload.scheduling.verification import Verification

STATE_VERSION = 1
log = logging.getLogger(__name__)


class BucketBatchSampler:
    """Yields this rank's batches (lists of dataset indices), the same number on every rank.

    seq_lens: (N,) tokens per sample. policy: "token_equal" | "dual_constraint" | "balanced".
    m_mem: memory budget, tokens per batch (B*S <= m_mem); m_comp, p: compute budget B*S^p <= m_comp,
    derived from `cost_model` when not given. max_seq_len: longest sample scheduled (tokens),
    default m_mem (one sample above the memory budget cannot run safely); longer ones are dropped
    (counted in `stats`) or, with oversize="resize", put in the largest allowed bucket
    (`target_seq_lens` says which; the dataset must resize them). num_replicas/rank default to
    torch.distributed's, else 1/0. dataset_fingerprint: an opaque string naming the dataset's
    samples in order (the DataModule's `index_fingerprint`); saved in the state and checked on load,
    so a resume never maps positions of one index onto another. memory_plan: plan with measured
    memory (`BucketTable.build` says what it changes: samples longer than the device allows are
    dropped as oversize, balanced takes each bucket's (B, k) from it and orders batches by their
    predicted time at that k); `bucket_table.checkpointed` holds each bucket's k. verification: what
    running the scheduled shapes found (limits on each bucket's (B, k), measured step times that
    price the balanced plan). drop_last: drop each bucket's last partial batch and the batches that
    cannot fill a last step (True) or keep every sample (False); None: False for balanced, True for
    the token-budget policies (`policies.keeps_partial_batches`).

    With Lightning use `DataLoader(dataset, batch_sampler=sampler)` and
    `Trainer(use_distributed_sampler=False)`; Lightning calls `set_epoch` each epoch (through the
    `sampler` property).
    """

    def __init__(self, seq_lens, *, policy: str, m_mem: int, m_comp: float | None = None, p: float | None = None,
                 cost_model=None, num_replicas: int | None = None, rank: int | None = None, seed: int = 0,
                 drop_last: bool | None = None, max_seq_len: int | None = None, oversize: str = "drop",
                 dataset_fingerprint: str | None = None, memory_plan: MemoryPlan | None = None,
                 verification: Verification | None = None):
        require_choice("policy", policy, POLICIES)
        m_mem = require_int("m_mem (tokens per batch)", m_mem)
        max_seq_len = require_int("max_seq_len (tokens)", m_mem if max_seq_len is None else max_seq_len)
        if memory_plan is not None:  # longer samples fit no configuration: dropped (counted) like oversize ones
            max_seq_len = memory_plan.limit_seq_len(max_seq_len, int(np.min(seq_lens)))
        if verification is not None and verification.max_seq_len is not None:  # buckets verification left out
            max_seq_len = min(max_seq_len, verification.max_seq_len)
        world, dist_rank = world_size_and_rank()
        self.num_replicas = world if num_replicas is None else int(num_replicas)
        self.rank = dist_rank if rank is None else int(rank)
        if self.num_replicas < 1 or not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"need num_replicas >= 1 and 0 <= rank < num_replicas, got {num_replicas=}, {rank=}")
        self.policy, self.m_mem, self.max_seq_len, self.oversize = policy, int(m_mem), int(max_seq_len), oversize
        if drop_last is None:
            drop_last = not keeps_partial_batches(policy)
        self.seed, self.drop_last, self.cost_model = int(seed), bool(drop_last), cost_model
        self.dataset_fingerprint = dataset_fingerprint
        self.bucket_of, self.bucket_seq_len = assign_buckets(seq_lens, self.max_seq_len, oversize)
        counts = np.bincount(self.bucket_of[self.bucket_of >= 0], minlength=len(self.bucket_seq_len))
        self.bucket_table = BucketTable.build(self.bucket_seq_len, counts, policy=policy, m_mem=self.m_mem,
                                              m_comp=m_comp, p=p, cost_model=cost_model, max_seq_len=self.max_seq_len,
                                              memory_plan=memory_plan, verification=verification)
        self.m_comp, self.p = self.bucket_table.m_comp, self.bucket_table.p
        self.bucket_batch = self.bucket_table.batch_size
        self._batch_costs = self.bucket_table.step_cost_model(cost_model)  # prices batches for balanced
        self._grouped = group_by_bucket(self.bucket_of)
        self.epoch = 0
        self._segments = [[self.num_replicas, 0]]  # [world_size, steps consumed] per (re-)plan of this epoch
        self._cache_key, self._cache_plan = None, None

    @property
    def target_seq_lens(self) -> np.ndarray:
        """(N,) int64 tokens each sample is scheduled at; -1 for dropped samples."""
        return np.where(self.bucket_of >= 0, self.bucket_seq_len[np.maximum(self.bucket_of, 0)], -1)

    def _plan(self, segments: list[list[int]], index: int, exclude: np.ndarray | None) -> EpochPlan:
        return plan_epoch(self.bucket_of, self.bucket_seq_len, self.bucket_batch, policy=self.policy,
                          world_size=segments[index][0], seed=self.seed, epoch=self.epoch,
                          drop_last=self.drop_last, exclude=exclude, segment=index, p=self.p,
                          cost_model=self._batch_costs, grouped=self._grouped)

    def plan(self) -> EpochPlan:
        """The plan this sampler is on: the epoch's, or its re-plan after a resume with another
        world size (previous segments' consumed steps excluded)."""
        key = (self.epoch, tuple(tuple(s) for s in self._segments[:-1]), self._segments[-1][0])
        if key != self._cache_key:
            exclude = None
            for i in range(len(self._segments) - 1):
                done = self._plan(self._segments, i, exclude).step_indices(0, self._segments[i][1])
                exclude = np.zeros(len(self.bucket_of), dtype=bool) if exclude is None else exclude
                exclude[done] = True
            self._cache_key, self._cache_plan = key, self._plan(self._segments, len(self._segments) - 1, exclude)
        return self._cache_plan

    @property
    def stats(self) -> dict:
        """Counts of the current plan (see plan_epoch), plus steps consumed so far."""
        return {**self.plan().stats, "steps_consumed": self._segments[-1][1]}

    @property
    def sampler(self) -> "BucketBatchSampler":
        # Lightning calls set_epoch on `loader.batch_sampler.sampler`, not on the batch sampler itself.
        return self

    def set_epoch(self, epoch: int) -> None:
        """Plan epoch `epoch`. The current epoch is kept as is (with its progress), so a call at the
        start of a resumed epoch does not restart it."""
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self._segments = [[self.num_replicas, 0]]

    def _start(self) -> int:
        """First step to run; a finished epoch iterates again from its start, like DistributedSampler."""
        done = self._segments[-1][1]
        if done and done >= len(self.plan().steps):
            self._segments = [[self.num_replicas, 0]]
        return self._segments[-1][1]

    def __len__(self) -> int:
        start = self._start()
        return len(self.plan().steps) - start

    def __iter__(self) -> Iterator[list[int]]:
        start = self._start()
        plan = self.plan()
        for step in range(start, len(plan.steps)):
            self._segments[-1][1] = step + 1
            yield plan.batch(step, self.rank).tolist()

    def _config(self) -> dict:
        table = self.bucket_table
        # under a memory plan or verification's limits the batch sizes and depths come from fitted
        # models and measurements, not from the budgets above: a resume must plan the same batches
        # (None without either, as in older states)
        planned = None if table.memory_plan is None and table.verification is None else {
            "batch_size": table.batch_size.tolist(), "checkpointed": table.checkpointed.tolist()}
        return {"policy": self.policy, "m_mem": self.m_mem, "m_comp": self.m_comp, "p": self.p,
                "max_seq_len": self.max_seq_len, "oversize": self.oversize, "drop_last": self.drop_last,
                "num_samples": len(self.bucket_of), "memory_plan": planned}

    def state_dict(self, steps_consumed: int | None = None) -> dict:
        """Rank-independent resume state. steps_consumed overrides the count of steps of the
        current plan taken so far (pass the trainer's count: a DataLoader prefetches ahead)."""
        segments = [list(s) for s in self._segments]
        if steps_consumed is not None:
            segments[-1][1] = int(steps_consumed)
        return {"version": STATE_VERSION, "seed": self.seed, "epoch": self.epoch, "segments": segments,
                "config": self._config(), "dataset_fingerprint": self.dataset_fingerprint}

    def load_state_dict(self, state: dict) -> None:
        """Continue where `state` stopped: the same plan if the world size is unchanged, else the
        rest of the epoch re-planned for this world size without the samples already consumed."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"sampler state must be a dict with version {STATE_VERSION}, got "
                             f"{state.get('version') if isinstance(state, dict) else type(state).__name__!r}")
        self._check_fingerprint(state.get("dataset_fingerprint"))
        saved = state.get("config") if isinstance(state.get("config"), dict) else {}
        changed = {k: (saved.get(k), v) for k, v in self._config().items() if saved.get(k) != v}
        if changed:
            raise ValueError(f"sampler state was saved with a different configuration (saved, now): {changed}")
        segments = [[int(w), int(k)] for w, k in state["segments"]]
        if not segments or any(w < 1 or k < 0 for w, k in segments):
            raise ValueError(f"sampler state has invalid segments {state['segments']!r}")
        self.seed, self.epoch = int(state["seed"]), int(state["epoch"])
        if segments[-1][0] != self.num_replicas:
            segments.append([self.num_replicas, 0])
        self._segments = segments

    def _check_fingerprint(self, saved: str | None) -> None:
        """Refuse a state saved for another dataset: its positions would name other samples, so the
        rest of the epoch would repeat some and skip others. A state or sampler without a
        fingerprint (older checkpoints) cannot be checked: one warning."""
        if saved == self.dataset_fingerprint:
            return
        if saved is None or self.dataset_fingerprint is None:
            log.warning("resuming a sampler state without checking its dataset (fingerprint of the state: %r, of "
                        "this sampler: %r)", saved, self.dataset_fingerprint)
            return
        raise ValueError(f"sampler state was saved for another dataset: its fingerprint is {saved!r}, this run's is "
                         f"{self.dataset_fingerprint!r} (the index was rebuilt, reordered or filtered differently). "
                         f"Resuming would repeat or skip samples of this epoch: resume with the index the checkpoint "
                         f"was made with, or leave out the loader state to restart the epoch (docs/data.md)")
