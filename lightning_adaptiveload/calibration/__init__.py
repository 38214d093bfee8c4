"""What `CostModelCalibration` is made of, below the Lightning hook: the (B, S) grid (grid.py),
the state-preserving step runner that times real training steps under the active strategy
(runner.py), the fit and the check whether to trust it (fit.py), the shape warm-up that builds
every scheduled shape's kernels before training (warmup.py), compiled-model handling (compiled.py)
and the calibration record: its JSON document and cache (record.py)."""
