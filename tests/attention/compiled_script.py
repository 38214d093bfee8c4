"""Run by tests/attention/test_attention_cuda.py, one process per backend (a kernel that faults leaves a
sticky CUDA error that would fail every later check in its process): F.scaled_dot_product_attention
compiled with torch.compile(dynamic=True) (inductor) under `attention_backend(BACKEND, strict=True)`,
run at each S of SEQ_LENS in turn (so the long one runs the dynamic graph traced at the short one),
forward and backward, against the fp32 reference. Prints one JSON line per S: backend, seq_len, status
("ok", "refused", "error"), max_rel_err, error, backends that ran.

Usage: python tests/attention/compiled_script.py BACKEND SEQ_LEN [SEQ_LEN ...]
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_adaptiveload.attention import attention_backend, backends_run, relative_error  # noqa: E402
from lightning_adaptiveload.attention.choose import reference_outputs  # noqa: E402
from tests.attention.shapes import self_attention  # noqa: E402


def attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def main(backend: str, seq_lens: list[int]) -> None:
    compiled = torch.compile(attend, dynamic=True)
    for s in seq_lens:
        row = {"backend": backend, "seq_len": s, "status": "ok", "max_rel_err": None, "error": None, "ran": None}
        args, grad_out, reference = reference_outputs(self_attention(s), "cuda", seed=s)
        q, k, v = args["query"], args["key"], args["value"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                got = []

                def step():
                    out = compiled(q, k, v)
                    got[:] = [out, *torch.autograd.grad(out, (q, k, v), grad_out)]
                    torch.cuda.synchronize()

                with attention_backend(backend, strict=True):
                    row["ran"] = sorted(backends_run(step))
                row["max_rel_err"] = max(relative_error(g, r) for g, r in zip(got, reference))
            except RuntimeError as e:
                refused = "No available kernel" in str(e) or "No viable backend" in str(e)
                row["status"] = "refused" if refused else "error"
                reasons = "; ".join(dict.fromkeys(str(w.message).splitlines()[0] for w in caught))
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}" + (f" ({reasons})" if reasons else "")
        print(json.dumps(row), flush=True)
        if row["status"] == "error":  # a CUDA fault is sticky: nothing later in this process can be trusted
            return


if __name__ == "__main__":
    main(sys.argv[1], [int(s) for s in sys.argv[2:]])
