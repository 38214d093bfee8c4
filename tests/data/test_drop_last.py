"""AdaptiveLoadDataModule(drop_last=...) and counters(): with drop_last=False every sample is
trained exactly once per epoch with equal steps on 2 ranks (ranks simulated with two loaders, and
one real 2-process gloo run); with drop_last=True the counters account for every sample left out."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.data.ddp_drop_last_script import DATA_KWARGS, EPOCHS, WATCHDOG_S
from tests.helpers.data import indexed_datamodule, write_dataset

TESTS = Path(__file__).resolve().parent


def epochs_per_rank(dm_args: dict, root, world: int, epochs: int) -> tuple[list, list]:
    """keys[epoch][rank] = list of batches (lists of keys), and each rank's counters per epoch."""
    keys = [[None] * world for _ in range(epochs)]
    counters = [[None] * world for _ in range(epochs)]
    for rank in range(world):
        dm = indexed_datamodule(root, **dm_args)
        epoch = [0]
        loader = dm.build_train_loader(world, rank, epoch_fn=lambda: epoch[0])
        for e in range(epochs):
            epoch[0] = e
            keys[e][rank] = [dm.on_before_batch_transfer(b, 0)["keys"] for b in loader]
            counters[e][rank] = dm.counters()
    return keys, counters


@pytest.mark.parametrize("policy", ["token_equal", "balanced"])
@pytest.mark.parametrize("n", [61, 70, 83])
def test_drop_last_false_trains_every_sample_once_on_two_ranks(tmp_path, policy, n):
    written = write_dataset(tmp_path, n=n, seed=n)
    args = dict(policy=policy, p=1.5, m_comp=500.0, drop_last=False)
    keys, counters = epochs_per_rank(args, tmp_path, world=2, epochs=2)
    orders = []
    for e in range(2):
        assert len(keys[e][0]) == len(keys[e][1]) > 0  # equal steps
        flat = [k for rank in keys[e] for batch in rank for k in batch]
        assert sorted(flat) == sorted(written)  # every sample, each once
        assert all(len(batch) >= 1 for rank in keys[e] for batch in rank)
        assert counters[e][0] == counters[e][1] == {"dropped_oversize": 0, "dropped_partial_batch": 0,
                                                    "dropped_step_remainder": 0}
        orders.append(flat)
    assert orders[0] != orders[1]  # a new epoch is a new plan

    # the default drops: what is left out is what the counters say, the same on both ranks
    keys, counters = epochs_per_rank(dict(args, drop_last=True), tmp_path, world=2, epochs=1)
    trained = [k for rank in keys[0] for batch in rank for k in batch]
    assert len(trained) == len(set(trained)) and counters[0][0] == counters[0][1]
    assert len(trained) + sum(counters[0][0].values()) == n


def test_counters_and_the_epoch_log_line(tmp_path, monkeypatch):
    import lightning_adaptiveload.data.map_style as map_style

    said = []
    monkeypatch.setattr(map_style, "rank_zero_info", said.append)
    write_dataset(tmp_path, n=70)
    dm = indexed_datamodule(tmp_path, max_seq_len=30, m_mem=64)  # (3, 6, 6), (1, 6, 18), (5, 8, 8) exceed 30 tokens
    assert dm.counters() == {"dropped_oversize": 0, "dropped_partial_batch": 0, "dropped_step_remainder": 0,
                             "skipped/over_max_seq_len": dm.skipped["over_max_seq_len"]}
    loader = dm.build_train_loader(2, 0)
    trained = [k for b in loader for k in dm.on_before_batch_transfer(b, 0)["keys"]]
    stats = loader.batch_sampler.stats
    counts = dm.counters()
    assert counts["dropped_partial_batch"] == stats["dropped_partial_batch"] > 0
    assert counts["dropped_step_remainder"] == stats["dropped_step_remainder"]
    assert 0 < len(trained) <= stats["samples_scheduled"]
    assert len(said) == 1 and f"dropped_partial_batch={stats['dropped_partial_batch']}" in said[0]
    assert f"trains {stats['samples_scheduled']} of {stats['samples_total']} samples" in said[0]
    list(dm.build_train_loader(2, 1))
    assert len(said) == 1  # said once, by rank 0
    list(indexed_datamodule(tmp_path, max_seq_len=30, m_mem=64, drop_last=False).build_train_loader(2, 0))
    assert len(said) == 1  # nothing left out: nothing said


@pytest.mark.slow
def test_drop_last_false_two_process_gloo(tmp_path):
    written = write_dataset(tmp_path / "data", n=75, seed=4)
    proc = subprocess.run([sys.executable, str(TESTS / "ddp_drop_last_script.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=WATCHDOG_S + 60, cwd=TESTS.parents[1])
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {r: [json.loads(line) for line in (tmp_path / f"keys_rank{r}.jsonl").read_text().splitlines()]
            for r in (0, 1)}
    for epoch in range(EPOCHS):
        per_rank = [[row["keys"] for row in rows[r] if row["epoch"] == epoch] for r in (0, 1)]
        assert len(per_rank[0]) == len(per_rank[1]) > 0
        flat = [k for batches in per_rank for batch in batches for k in batch]
        assert sorted(flat) == sorted(written)
    for r in (0, 1):
        counters = json.loads((tmp_path / f"counters_rank{r}.json").read_text())
        assert counters == {"dropped_oversize": 0, "dropped_partial_batch": 0, "dropped_step_remainder": 0}
    assert DATA_KWARGS["drop_last"] is False
