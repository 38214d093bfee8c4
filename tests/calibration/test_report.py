"""calibration/report.py: where the memory model's held-out error holds (interpolated or extrapolated
for the planned shapes), and the cold seconds in calibration.json."""
from lightning_adaptiveload.calibration.report import memory_coverage
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
