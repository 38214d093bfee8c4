"""Activation-checkpointing measurements on one H200, as shipped in
lightning_adaptiveload/data/h200_ac_measurements.json (its "source" says how they were taken), in the
tuple form the tests use."""
import json
from pathlib import Path

_DOC = json.loads((Path(__file__).resolve().parents[2] / "lightning_adaptiveload" / "data"
                   / "h200_ac_measurements.json").read_text())

NUM_BLOCKS = _DOC["num_blocks"]
# (B, S, k, step ms, peak GiB); k = blocks under activation checkpointing
H200_AC = [(m["batch_size"], m["seq_len"], m["checkpointed"], m["time_ms"], m["peak_bytes"] / 2**30)
           for m in _DOC["measurements"]]
# (B, S, k) that ran out of memory
H200_OOM = [(m["batch_size"], m["seq_len"], m["checkpointed"]) for m in _DOC["out_of_memory"]]
