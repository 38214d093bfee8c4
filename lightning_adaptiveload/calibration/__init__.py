"""What `CostModelCalibration` is made of, below the Lightning hook (`loop.Calibration` runs it:
measure -> fit -> plan -> verify):

- config.py: CalibrationConfig, every setting, checked once; protocols.py: what the loop needs of
  the step runner and of the DataModule; result.py: CalibrationResult, what one calibration decided.
- grid.py: the (B, S) points; sweep.py: running them; runner.py: the state-preserving step runner
  that times real training steps under the active strategy (the one module here that knows Lightning).
- fit.py: the fits and whether to trust them; memory.py: optimizer state (predicted, and created for
  verification) and device memory; compiled.py: compiled regions and dynamo's recompile room.
- verify.py: every scheduled batch shape run before training, buckets that do not fit planned again.
- record.py: the calibration document's format, its cache and the model fingerprint; report.py: the
  files, the printed report and the logged metrics.
"""
