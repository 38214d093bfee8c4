"""End to end, 2-process DDP (gloo, CPU): real AdaptiveLoadDataModule on tiny shards +
CostModelCalibration + LoadBalanceMonitor + the example video DiT (tests/callbacks/ddp_e2e_script.py).

Checks: equal step counts per rank; the calibrated cost model identical on both ranks and reused
by later fits; the monitor's gathered per-rank rows agree with what each rank recorded itself and
with the cost model; metrics logged; a mid-epoch checkpoint + resume trains on exactly the batches
of an uninterrupted epoch (no sample lost or repeated)."""
from __future__ import annotations

import csv
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from tests.callbacks.ddp_e2e_script import DATA_KWARGS, NUM_SAMPLES, RESUME_AT, WATCHDOG_S

from lightning_adaptiveload.callbacks.monitor import CSV_NAME
from lightning_adaptiveload.scheduling.cost_model import CostModel
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
from tests.helpers.resume import read_batches

TESTS = Path(__file__).resolve().parent
FITS = ("first", "resumed", "reference")


def _read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp_e2e")
    # Shards and index written once, here, so the two ranks never race to create them.
    AdaptiveLoadDataModule(shards=str(out / "shards"), index=str(out / "index.jsonl"), synthesize=NUM_SAMPLES,
                           **DATA_KWARGS).prepare_data()
    proc = subprocess.run([sys.executable, str(TESTS / "ddp_e2e_script.py"), str(out)], capture_output=True,
                          text=True, timeout=WATCHDOG_S + 90, cwd=TESTS.parent)
    (out / "stdout.txt").write_text(proc.stdout)
    (out / "stderr.txt").write_text(proc.stderr)
    hang = proc.stderr.find("Timeout (")  # the script's watchdog fired: show where rank 0 waited
    assert proc.returncode == 0, proc.stderr[hang:hang + 6000] if hang >= 0 else proc.stderr[-4000:]
    return out


@pytest.mark.slow
def test_equal_steps_per_rank_and_resume_without_loss_or_repeat(run_dir):
    keys = {(fit, r): read_batches(run_dir, fit, r) for fit in FITS for r in (0, 1)}
    meta = {(fit, r): json.loads((run_dir / f"calib_{fit}_rank{r}.json").read_text()) for fit in FITS for r in (0, 1)}
    epoch_steps = meta[("reference", 0)]["num_training_batches"]
    assert epoch_steps > RESUME_AT + 1, "the epoch must be long enough to checkpoint in its middle"
    for r in (0, 1):
        assert len(keys[("reference", r)]) == epoch_steps
        assert len(keys[("first", r)]) == RESUME_AT
        assert len(keys[("resumed", r)]) == epoch_steps - RESUME_AT
        assert meta[("resumed", r)]["global_step"] == RESUME_AT
        # first + resumed trained on exactly the reference epoch's batches, in the same order
        interrupted = [b["keys"] for b in keys[("first", r)] + keys[("resumed", r)]]
        assert interrupted == [b["keys"] for b in keys[("reference", r)]]
        assert [b["step"] for b in keys[("resumed", r)]] == list(range(RESUME_AT, epoch_steps))
    for fit_pair in (("first", "resumed"), ("reference",)):
        seen = [k for fit in fit_pair for r in (0, 1) for b in keys[(fit, r)] for k in b["keys"]]
        assert len(seen) == len(set(seen)), f"a sample was repeated in {fit_pair}"
    # The two ranks train on different samples with different batch shapes (unequal batches).
    assert {len(b["keys"]) for b in keys[("reference", 0)]} | {len(b["keys"]) for b in keys[("reference", 1)]} != {1}


@pytest.mark.slow
def test_calibration_identical_on_both_ranks_and_reused(run_dir):
    docs = {(fit, r): json.loads((run_dir / f"calib_{fit}_rank{r}.json").read_text()) for fit in FITS for r in (0, 1)}
    first = {k: docs[("first", 0)][k] for k in ("form", "params", "p", "m_mem")}
    for doc in docs.values():
        assert {k: doc[k] for k in first} == first
    saved = CostModel.from_json(run_dir / "first" / "version_0" / "calibration_cost_model.json")
    assert saved.params == first["params"]
    calibration = json.loads((run_dir / "reference" / "version_0" / "calibration.json").read_text())
    assert calibration["source"] == "cache" and calibration["trusted"] is True
    # verification ran every (B, S) the epoch plan holds (the same shapes on both ranks: one plan), and
    # each fit
    verified = {(m["batch_size"], m["seq_len"]) for m in calibration["verification"]["shapes"]}
    trained = {(len(b["keys"]), b["seq_len"]) for fit in ("reference",) for r in (0, 1)
               for b in read_batches(run_dir, fit, r)}
    assert verified >= trained and all(m["status"] == "fits" for m in calibration["verification"]["shapes"])


@pytest.mark.slow
def test_monitor_rows_match_each_ranks_batches_and_the_measured_costs(run_dir):
    """Each batch's load is what balanced priced it by: the warm step time verification measured for
    its (B, S) (every trained shape was measured: see the test above)."""
    for fit in ("reference", "resumed"):
        log_dir = run_dir / fit / "version_0"
        verification = json.loads((log_dir / "calibration.json").read_text())["verification"]
        measured = {(m["batch_size"], m["seq_len"]): m["warm_ms"] for m in verification["shapes"]}
        rows = _read_csv(log_dir / CSV_NAME)
        recorded = {r: read_batches(run_dir, fit, r) for r in (0, 1)}
        steps = len(recorded[0])
        assert len(rows) == 2 * steps
        for i in range(steps):
            loads = []
            for r in (0, 1):
                row, batch = rows[2 * i + r], recorded[r][i]
                assert (int(row["rank"]), int(row["step"])) == (r, batch["step"])
                b, s = len(batch["keys"]), batch["seq_len"]
                assert (int(row["samples"]), int(row["seq_len"]), int(row["tokens"])) == (b, s, b * s)
                assert float(row["load"]) == pytest.approx(measured[(b, s)], rel=1e-9)
                loads.append(float(row["load"]))
        metrics = [m for m in _read_csv(log_dir / "metrics.csv") if m.get("balance/load_cv")]
        assert metrics, f"no balance metrics logged in {fit}"
        # The last logged interval's load CV recomputed from the per-rank rows (fp64 formula).
        last_step = int(metrics[-1]["step"])
        prev_step = int(metrics[-2]["step"]) if len(metrics) > 1 else -1
        per_step = {}
        for row in rows:
            if prev_step < int(row["step"]) <= last_step:
                per_step.setdefault(int(row["step"]), []).append(float(row["load"]))
        cvs = [statistics.pstdev(v) / statistics.fmean(v) for v in per_step.values()]
        assert float(metrics[-1]["balance/load_cv"]) == pytest.approx(statistics.fmean(cvs), rel=1e-5, abs=1e-9)
        assert float(metrics[-1]["throughput/tokens_per_s"]) > 0
        assert {"rank0/load", "rank1/load", "balance/step_time_cv_temporal"} <= metrics[-1].keys()
    assert "LoadBalanceMonitor:" in (run_dir / "stdout.txt").read_text()
