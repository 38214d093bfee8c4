"""calibration/report.py: where the memory model's held-out error holds (interpolated or extrapolated
for the planned shapes), and the cold seconds in calibration.json."""
from lightning_adaptiveload.calibration.report import format_verification, memory_coverage
from lightning_adaptiveload.calibration.result import CalibrationResult, Source
from lightning_adaptiveload.calibration.verify import VerifyOutcome
from lightning_adaptiveload.scheduling.verification import MeasuredShape, Verification


def _point(b, s, k, status="ok"):
    return {"batch_size": b, "seq_len": s, "checkpointed": k, "status": status, "time_ms": 1.0, "peak_bytes": 10,
            "reserved_bytes": 12}


def _result(points, shapes):
    outcome = None if shapes is None else VerifyOutcome(Verification(tuple(shapes)), 1, True, (), (), 0, 0.1)
    return CalibrationResult(Source.MEASURED, points, None, (), None, verification=outcome)


def _shape(b, s, k):
    return MeasuredShape(b, s, None, k, "fits", warm_ms=1.0, cold_ms=2.0, peak_bytes=10.0)


def test_planned_shapes_outside_the_measured_depths_or_tokens_are_called_extrapolated():
    # measured: k >= 2 (an out-of-memory point at k = 0 does not count), B*S <= 4 * 64 = 256
    points = [_point(1, 64, 8), _point(4, 64, 8), _point(1, 64, 4), _point(1, 64, 2), _point(4, 64, 0, "oom")]
    inside = [_shape(2, 64, 2), _shape(4, 64, 8)]
    assert memory_coverage(_result(points, inside)) == \
        "(interpolated: the 2 planned shape(s) lie within the measured k >= 2, B*S <= 256)"
    below = [*inside, _shape(1, 64, 0), _shape(8, 64, 4)]  # k below the grid's; B*S above it
    assert memory_coverage(_result(points, below)) == \
        "(EXTRAPOLATED for 2 of 4 planned shape(s): k down to 0, B*S up to 512; measured k >= 2, B*S <= 256)"
    assert memory_coverage(_result(points, None)) == "(measured k >= 2, B*S <= 256)"
    assert memory_coverage(_result([_point(1, 64, None)], None)) == "(no measured depths)"


def _measured(b, s, k, status, rnd):
    ran = status not in ("oom", "predicted_oom")
    return MeasuredShape(b, s, None, k, status, warm_ms=1.0 if ran else None, cold_ms=2.0 if ran else None,
                         peak_bytes=10.0 if ran else None, round=rnd)


def test_the_verification_line_says_what_each_round_ran():
    # round 1: the buckets' batches, one over the budget, one out of memory, one predicted over the
    # device (not run); round 2: their re-planned batches; round 3: everything fit before it, so partial
    shapes = [_measured(8, 256, 0, "fits", 1), _measured(4, 1024, 0, "over_budget", 1), _measured(2, 4096, 0, "oom", 1),
              _measured(2, 8192, 0, "predicted_oom", 1), _measured(4, 1024, 6, "fits", 2), _measured(2, 4096, 8, "fits", 2),
              _measured(2, 8192, 12, "fits", 2), _measured(3, 256, 0, "fits", 3)]
    outcome = VerifyOutcome(Verification(tuple(shapes)), 3, True, (), (), 0, 12.5)
    line = format_verification(CalibrationResult(Source.MEASURED, [], None, (), None, verification=outcome))
    assert line.startswith("verification: 7 shape(s) run in 3 round(s), 12.5 s (")
    assert ("round 1 (the buckets' batches): 3 run, 2 did not fit (1 out of memory) -> re-planned, 1 predicted over "
            "the device and not run; round 2 (the re-planned batches): 3 run, all fit; "
            "round 3 (partial batches): 1 run, all fit); converged") in line
