"""Two CPU processes (gloo) with a different checkpointing depth per rank and step, under DDP, FSDP and FSDP2
(tests/checkpointing/distributed_script.py): no hang, and every loss and final parameter bitwise equal (fp64)
to the same training without checkpointing and to torch's static CheckpointWrapper at the same depth."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpointing.distributed_script import DEPTH, MODES, SCHEDULE, STATIC_K, WATCHDOG_S

SCRIPT = Path(__file__).resolve().parent / "distributed_script.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("checkpointing_distributed")
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), str(_free_port())], capture_output=True, text=True,
                          timeout=WATCHDOG_S + 60, cwd=SCRIPT.parents[2])
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_per_rank_depths_train_exactly_like_no_checkpointing(ranks, mode):
    for rank, result in enumerate(ranks):
        runs = result[mode]
        # the switch did what each rank asked: the first k blocks ran twice (recomputed), the rest once
        assert runs["switched"]["calls"] == [[2] * k + [1] * (DEPTH - k) for k in SCHEDULE[rank]]
        assert runs["switched"]["losses"] == runs["plain"]["losses"]
        assert runs["switched"]["params"] == runs["plain"]["params"]
    # the ranks really trained one model: equal parameters after the last step
    assert ranks[0][mode]["plain"]["params"] == ranks[1][mode]["plain"]["params"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_switched_equals_a_static_checkpoint_wrapper_at_the_same_depth(ranks, mode):
    for result in ranks:
        runs = result[mode]
        assert runs["static"]["calls"] == [[2] * STATIC_K + [1] * (DEPTH - STATIC_K)] * len(SCHEDULE[0])
        assert runs["switched_static"]["calls"] == runs["static"]["calls"]
        assert runs["switched_static"]["losses"] == runs["static"]["losses"]
        assert runs["switched_static"]["params"] == runs["static"]["params"]


@pytest.mark.slow
def test_fsdp_units_inside_blocks_are_refused(ranks):
    for result in ranks:
        assert "contains FSDP units" in result["inner_unit_error"]
