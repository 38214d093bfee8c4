"""The verification loop on a CPU with injected measurements: a fake device whose true peaks differ
from the memory model's, out-of-memory steps, the bound on re-plans, the fallback, the buckets left
out, and a recorded verification (cache, resume)."""
import numpy as np
import pytest

from lightning_adaptiveload.calibration.config import COLD_STANDS_MS, LONG_STEP_MS
from lightning_adaptiveload.calibration.verify import RECHECK_MARGIN, PlanVerifier
from lightning_adaptiveload.scheduling.buckets import BucketTable, ScheduledShape
from lightning_adaptiveload.scheduling.cost_model import CostModel
from lightning_adaptiveload.scheduling.depth_cost_model import DepthCostModel
from lightning_adaptiveload.scheduling.depth_choice import MemoryPlan
from lightning_adaptiveload.scheduling.memory_model import MemoryModel
from lightning_adaptiveload.scheduling.verification import BucketLimit, MeasuredShape, held_bytes

L = 8
GIB = 2**30
DEVICE = 80 * GIB
FRACTION = 0.85
BUDGET = FRACTION * DEVICE
TOKENS = np.array([256, 1024, 4096, 9408, 32760])
COUNTS = np.array([300, 120, 60, 25, 9])
THW = np.array([[1, 32, 32], [1, 64, 64], [4, 64, 64], [12, 28, 112], [21, 60, 104]])


def models():
    base = CostModel("linear_quadratic", {"a": 30.0, "c1": 4e-3, "c2": 6e-8}, 1.0, {})
    return (MemoryModel("linear", {"m0": 12 * GIB, "c": 3e6, "a": 5e3, "c_k": 2e6, "b": 1.2e5}, L),
            DepthCostModel(base, L, 0.25))


def table_buckets(table: BucketTable) -> dict:
    """verify.Plan.buckets of a bucket table."""
    return {r["seq_len"]: (r["batch_size"], r["latent_shape"], r["checkpointed"]) for r in table.rows()}


def table_shapes(table: BucketTable) -> list[ScheduledShape]:
    """verify.Plan.shapes of a bucket table: each bucket's full batches, then its rest."""
    out = []
    for r in table.rows():
        full, rest = divmod(r["samples"], r["batch_size"])
        if full:
            out.append(ScheduledShape(r["batch_size"], r["latent_shape"], full, r["checkpointed"]))
        if rest:
            out.append(ScheduledShape(rest, r["latent_shape"], 1, r["checkpointed"]))
    return out


class FakePlan:
    """verify.Plan over a real BucketTable (balanced, memory plan) and a fake device."""

    def __init__(self, memory, depth, true_scale=1.3, oom_above=DEVICE, refit_scale=None):
        self.memory, self.depth = memory, depth
        self.true_scale, self.oom_above = true_scale, oom_above
        self.verification = None
        self.refits = 0
        self.measured = []  # (B, S, k, warm) of every measure call
        self.reserve, self.gap = 1.02, 0.0  # reserved = reserve * allocated + gap

    def table(self) -> BucketTable:
        return BucketTable.build(TOKENS, COUNTS, THW, policy="balanced", m_mem=65536,
                                 memory_plan=MemoryPlan(self.memory, self.depth, DEVICE, FRACTION),
                                 verification=self.verification)

    def buckets(self):
        return table_buckets(self.table())

    def shapes(self):
        return table_shapes(self.table())

    def seq_len(self, thw):
        return {tuple(t): int(s) for s, t in zip(TOKENS, THW.tolist())}[tuple(thw)]

    def predict(self, shape):
        s = self.seq_len(shape.latent_shape)
        return float(self.depth.predict(shape.batch_size, s, shape.checkpointed)), \
            float(self.memory.predict(shape.batch_size, s, shape.checkpointed))

    def true_peak(self, b, s, k):
        return self.true_scale * float(self.memory.predict(b, s, k))

    def measure(self, shape, warm=True):
        s = self.seq_len(shape.latent_shape)
        self.measured.append((shape.batch_size, s, shape.checkpointed, warm))
        peak = self.true_peak(shape.batch_size, s, shape.checkpointed)
        if peak > self.oom_above:
            return {"status": "oom"}
        t = 1.1 * float(self.depth.predict(shape.batch_size, s, shape.checkpointed))
        out = {"status": "ok", "cold_ms": t + 50.0, "peak_bytes": peak, "reserved_bytes": self.reserve * peak + self.gap}
        return {**out, "warm_ms": t} if warm else out

    def refit(self, verification):
        self.refits += 1

    def apply(self, verification):
        self.verification = verification


def run(plan, **kw):
    verifier = PlanVerifier(plan.measure, plan, budget_bytes=BUDGET, device_bytes=DEVICE, num_blocks=L,
                            max_rounds=kw.pop("max_rounds", 3), **kw)
    return verifier, verifier.run()


def assert_bounds_hold(outcome, plan):
    """Each bounded shape names a shape that ran and fit with no fewer samples and tokens at no more blocks
    checkpointed, was predicted RECHECK_MARGIN under the budget, and truly fits on the fake device."""
    shapes = {m.key: m for m in outcome.verification.shapes}
    for m in shapes.values():
        if m.status != "bounded":
            continue
        bound = shapes[m.bound_by]
        assert bound.ran and bound.fits
        assert bound.batch_size >= m.batch_size and bound.seq_len >= m.seq_len and bound.checkpointed <= m.checkpointed
        assert m.predicted_peak_bytes <= (1 - RECHECK_MARGIN) * BUDGET
        assert held_bytes(plan.true_peak(m.batch_size, m.seq_len, m.checkpointed), None) <= BUDGET


def test_one_failure_moves_k_by_the_measured_activation_bytes_in_one_jump():
    """A device whose activations are 1.3x the model's and whose allocator reserves 3 GiB more than it
    allocates: after one round each failed bucket's new choice is the fewest blocks checkpointed that
    cover the excess as the measured scale and gap predict it (fp64 reference from the model's
    parameters), and every one of them fits: one re-plan, not one block per round."""
    memory, depth = models()
    m0 = memory.params["m0"]
    plan = FakePlan(memory, depth)
    plan.true_peak = lambda b, s, k: m0 + 1.3 * (float(memory.predict(b, s, k)) - m0)
    plan.reserve, plan.gap = 1.0, 3 * GIB
    before = plan.buckets()
    verifier, outcome = run(plan)
    failed = {m.seq_len for m in outcome.verification.shapes if m.round == 1 and not m.fits}
    assert failed and outcome.converged
    assert all(m.fits for m in outcome.verification.shapes if m.round >= 2)  # one re-plan sufficed
    for s in failed:
        b0, _, k0 = before[s]
        limit = outcome.verification.limits[s]
        assert limit.gap_bytes == pytest.approx(3 * GIB)
        # the device's activation factor, measured by every step that ran, plus the 2% margin
        assert limit.memory_scale == pytest.approx(1.3 * 1.02, rel=1e-9)
        b1, _, k1 = plan.buckets()[s]
        held = lambda b, k: m0 + limit.memory_scale * (memory.predict(b, s, k) - m0) + 3 * GIB  # noqa: E731
        assert held(b1, k1) <= BUDGET
        if b1 == b0 and k1 > 0:
            assert held(b1, k1 - 1) > BUDGET and k1 - k0 >= 1


def test_a_plan_whose_peaks_are_predicted_low_is_planned_again_until_every_target_fits():
    memory, depth = models()
    plan = FakePlan(memory, depth, true_scale=1.3)
    before = plan.buckets()
    over = [s for s, (b, _, k) in before.items() if plan.true_peak(b, s, k) * 1.02 > BUDGET]
    assert over, "the fake device must put some planned buckets over the budget"
    verifier, outcome = run(plan)
    assert outcome.converged and not outcome.settled and not outcome.unresolved
    assert plan.refits >= 1 and outcome.rounds <= 3 + PlanVerifier.MAX_PARTIAL_ROUNDS
    after = plan.buckets()
    for s, (b, _, k) in after.items():
        assert plan.true_peak(b, s, k) * 1.02 <= BUDGET  # what the device really holds, within the budget
        limit = outcome.verification.limits[s]
        assert limit.pinned == (b, k)
        if s in over:  # re-planned off the failure's quadrant: a smaller B or more blocks checkpointed
            b0, _, k0 = before[s]
            assert (b0, k0) in limit.failed and (b < b0 or k > k0)
    # every scheduled shape ran or is bounded by one that ran; each that ran a cold step, then a warm one
    # when it fitted (these steps are short: no long-step rule), none for a shape over the budget
    assert {(x.batch_size, plan.seq_len(x.latent_shape), x.checkpointed) for x in plan.shapes()} <= \
        {(m.batch_size, m.seq_len, m.checkpointed) for m in outcome.verification.shapes}
    cold = [call[:3] for call in plan.measured if not call[3]]
    warm = [call[:3] for call in plan.measured if call[3]]
    fitted = {m.key for m in outcome.verification.shapes if m.fits and m.ran}
    assert len(cold) == len(set(cold)) and set(warm) == fitted and len(warm) == len(fitted)
    assert all(m.timed_cold == (m.status == "over_budget") for m in outcome.verification.shapes
               if m.status in ("fits", "over_budget"))
    bounded = [m for m in outcome.verification.shapes if m.status == "bounded"]
    assert bounded and outcome.left_cold == len(bounded)  # partial batches at least: their own bucket's B bounds them
    assert_bounds_hold(outcome, plan)


def test_a_long_step_of_a_batch_shape_already_built_runs_once_and_a_new_one_gets_its_warm_step():
    """The long-step rule of verification: a shape whose cold step takes LONG_STEP_MS or more and whose
    (B, S) an earlier step of the process ran (`built`) is timed on its one cold step; a shape of a new
    (B, S), a short one, or any shape when `built` is None (a compiled model) gets its warm step."""
    memory, depth = models()
    plan = FakePlan(memory, depth, true_scale=1.0)
    long = {4096, 9408, 32760}  # these buckets' steps take LONG_STEP_MS more than the fake's times

    def measure(shape, warm):
        raw = plan.measure(shape, warm)
        if raw["status"] == "ok" and plan.seq_len(shape.latent_shape) in long:
            raw = {**raw, **{k: raw[k] + LONG_STEP_MS for k in ("cold_ms", "warm_ms") if k in raw}}
        return raw

    # the full batches of two long buckets were built (bounded partial batches never run, so none of theirs)
    built = {(b, s) for s, (b, _, _) in plan.buckets().items() if s in (4096, 9408)}
    outcome = PlanVerifier(measure, plan, budget_bytes=BUDGET, device_bytes=DEVICE, num_blocks=L,
                           built=set(built)).run()
    measured = [m for m in outcome.verification.shapes if m.fits and m.ran]
    assert outcome.converged and measured
    long_built = {m.key for m in measured if (m.batch_size, m.seq_len) in built and m.seq_len in long}
    assert long_built and long_built != {m.key for m in measured}  # the rule applies to some shapes, not all
    for m in measured:
        assert m.timed_cold == (m.key in long_built), m
        assert m.timed_cold or m.warm_ms < m.cold_ms  # a warm step's own time, not the cold one's
    warm_calls = [(b, s, k) for b, s, k, warm in plan.measured if warm]
    assert len(warm_calls) == len(measured) - len(long_built)

    plan.measured.clear()
    plan.verification = None
    again = PlanVerifier(measure, plan, budget_bytes=BUDGET, device_bytes=DEVICE, num_blocks=L, built=None).run()
    assert not any(m.timed_cold for m in again.verification.shapes if m.fits)


def test_a_very_long_first_step_of_an_eager_model_stands_for_its_time_whatever_was_built():
    """config.cold_step_stands: in an eager model a cold step of COLD_STANDS_MS or more is the shape's time even
    at a new (B, S) (its kernel builds are a few percent of it), shorter ones get a warm step; in a compiled
    model (built None) every shape that fits gets its warm step (its first step may hold a compilation)."""
    memory, depth = models()
    plan = FakePlan(memory, depth, true_scale=1.0)
    very_long = {32760}

    def measure(shape, warm):
        raw = plan.measure(shape, warm)
        if raw["status"] == "ok" and plan.seq_len(shape.latent_shape) in very_long:
            raw = {**raw, **{k: raw[k] + COLD_STANDS_MS for k in ("cold_ms", "warm_ms") if k in raw}}
        return raw

    for built in (set(), None):
        plan.measured.clear()
        plan.verification = None
        outcome = PlanVerifier(measure, plan, budget_bytes=BUDGET, device_bytes=DEVICE, num_blocks=L,
                               built=built).run()
        ran = [m for m in outcome.verification.shapes if m.ran and m.fits]
        assert any(m.seq_len in very_long for m in ran) and any(m.seq_len not in very_long for m in ran)
        one_step = {m.key for m in ran if m.seq_len in very_long} if built is not None else set()
        for m in ran:
            assert m.timed_cold == (m.key in one_step), m
            assert (m.warm_ms == m.cold_ms) == m.timed_cold
        warm_calls = {(b, s, k) for b, s, k, warm in plan.measured if warm}
        assert warm_calls == {m.key for m in ran} - one_step


def test_out_of_memory_steps_count_as_needing_the_whole_device():
    memory, depth = models()
    plan = FakePlan(memory, depth, true_scale=1.6, oom_above=0.9 * DEVICE)
    _, outcome = run(plan)
    statuses = [m.status for m in outcome.verification.shapes]
    assert "oom" in statuses and not outcome.unresolved
    for s, (b, _, k) in plan.buckets().items():
        assert plan.true_peak(b, s, k) * 1.02 <= BUDGET
        # a bucket settled after the re-plans still runs every block checkpointed at the largest B the
        # scaled model fits, not at B = 1
        assert s not in outcome.settled or k == L and (b > 1 or s == 32760)


def test_re_plans_are_bounded_and_unresolved_buckets_settle_on_their_safest_measured_choice():
    memory, depth = models()
    # a device on which nothing but B = 1 with every block checkpointed fits, whatever the models say
    plan = FakePlan(memory, depth, true_scale=1.0)
    plan.true_peak = lambda b, s, k: 0.5 * BUDGET if (b, k) == (1, L) else 2 * BUDGET
    _, outcome = run(plan, max_rounds=2)
    assert not outcome.converged and outcome.settled and not outcome.unresolved
    assert plan.refits == 2  # two re-plans, then the fallback
    for s, (b, _, k) in plan.buckets().items():
        assert (b, k) == (1, L) and outcome.verification.limits[s].pinned


def test_a_bucket_that_fits_nowhere_is_left_out_with_every_longer_one():
    memory, depth = models()
    plan = FakePlan(memory, depth, true_scale=1.0)
    plan.true_peak = lambda b, s, k: 2 * DEVICE if s >= 9408 else 0.5 * BUDGET
    _, outcome = run(plan, max_rounds=5)
    assert outcome.verification.max_seq_len == 4096 and sorted(plan.buckets()) == [256, 1024, 4096]
    assert all(limit.pinned for limit in outcome.verification.limits.values())  # what is left fits
    only_short = FakePlan(memory, depth)
    only_short.true_peak = lambda b, s, k: 2 * DEVICE
    with pytest.raises(RuntimeError, match="no scheduled batch fits the device"):
        run(only_short)


def test_a_recorded_verification_runs_each_shape_near_the_budget_once_and_replans_only_what_no_longer_fits():
    memory, depth = models()
    first = FakePlan(memory, depth, true_scale=1.3)
    _, recorded = run(first)
    again = FakePlan(memory, depth, true_scale=1.3)
    verifier = PlanVerifier(again.measure, again, budget_bytes=BUDGET, device_bytes=DEVICE, num_blocks=L)
    outcome = verifier.run(recorded.verification)
    assert again.buckets() == first.buckets() and outcome.converged
    # one cold step per recorded fitting shape of the schedule that held within RECHECK_MARGIN of the
    # budget, nothing measured warm, the shapes further under it taken as recorded
    held = {m.key: held_bytes(m.peak_bytes, m.reserved_bytes) for m in recorded.verification.shapes if m.fits}
    scheduled = {(x.batch_size, again.seq_len(x.latent_shape), x.checkpointed) for x in again.shapes()}
    near = {key for key in scheduled if held[key] >= (1 - RECHECK_MARGIN) * BUDGET}
    assert near and near != scheduled  # both kinds are in the schedule
    assert not any(warm for *_, warm in again.measured)
    assert sorted(call[:3] for call in again.measured) == sorted(near)
    # on a device with less room one recorded shape no longer fits: it alone is planned again
    tight = FakePlan(memory, depth, true_scale=1.3)
    biggest = max(first.buckets().items(), key=lambda item: tight.true_peak(item[1][0], item[0], item[1][2]))
    s_big, (b_big, _, k_big) = biggest
    tight.true_peak = lambda b, s, k: (1.0 if (s, b, k) == (s_big, b_big, k_big) else 0.0) * 2 * BUDGET + \
        1.3 * float(memory.predict(b, s, k)) * ((s, b, k) != (s_big, b_big, k_big))
    verifier = PlanVerifier(tight.measure, tight, budget_bytes=BUDGET, device_bytes=DEVICE, num_blocks=L)
    outcome = verifier.run(recorded.verification)
    assert outcome.converged and tight.buckets()[s_big] != (b_big, first.buckets()[s_big][1], k_big)
    assert {s: v for s, v in tight.buckets().items() if s != s_big} == \
        {s: v for s, v in first.buckets().items() if s != s_big}
    frozen = FakePlan(memory, depth)
    frozen.true_peak = tight.true_peak
    with pytest.raises(RuntimeError, match="no longer fit .* resuming would change the epoch's batches"):
        PlanVerifier(frozen.measure, frozen, budget_bytes=BUDGET, device_bytes=DEVICE, num_blocks=L).run(
            recorded.verification, frozen=True)


def test_a_recorded_verification_checks_its_cheapest_shape_first():
    """In a cached run the first recheck is the process's first step, which the runner precedes with an
    uncounted one (StepRunner.measure): the rechecks run cheapest (B * S) first, so that step costs least."""
    memory, depth = models()
    first = FakePlan(memory, depth, true_scale=1.3)
    _, recorded = run(first)
    again = FakePlan(memory, depth, true_scale=1.3)
    PlanVerifier(again.measure, again, budget_bytes=BUDGET, device_bytes=DEVICE, num_blocks=L).run(recorded.verification)
    calls = [call[:3] for call in again.measured]
    assert len(calls) > 1 and [b * s for b, s, _ in calls] == sorted(b * s for b, s, _ in calls)


def test_a_recorded_bound_that_no_longer_fits_takes_what_it_bounded_with_it():
    memory, depth = models()
    first = FakePlan(memory, depth, true_scale=1.3)
    _, recorded = run(first)
    bounded = {m.key: m.bound_by for m in recorded.verification.shapes if m.status == "bounded"}
    assert bounded
    gone = next(iter(bounded.values()))
    tight = FakePlan(memory, depth, true_scale=1.3)
    true_peak = tight.true_peak
    tight.true_peak = lambda b, s, k: 2 * BUDGET if (b, s, k) == gone else true_peak(b, s, k)
    # a tighter budget, so the bound is among the recorded shapes checked again
    budget = 0.85 * BUDGET
    outcome = PlanVerifier(tight.measure, tight, budget_bytes=budget, device_bytes=DEVICE, num_blocks=L).run(
        recorded.verification)
    now = {m.key: m for m in outcome.verification.shapes}
    assert not outcome.unresolved and not now[gone].fits
    assert not any(m.bound_by == gone for m in now.values())
    for m in now.values():  # every bound now is a shape that fits on this device, and holds on it
        if m.status == "bounded":
            assert now[m.bound_by].ran and now[m.bound_by].fits
            assert true_peak(m.batch_size, m.seq_len, m.checkpointed) <= budget
    scheduled = {(x.batch_size, tight.seq_len(x.latent_shape), x.checkpointed) for x in tight.shapes()}
    assert all(now[key].fits for key in scheduled if key in now)


def test_a_shape_is_bounded_only_by_a_measured_fit_of_no_fewer_samples_and_tokens_at_no_deeper_k():
    memory, depth = models()
    plan = FakePlan(memory, depth)
    verifier = PlanVerifier(plan.measure, plan, budget_bytes=BUDGET, device_bytes=DEVICE, num_blocks=L)

    def ran(b, s, k, held_gib, status="fits"):
        return MeasuredShape(b, s, None, k, status, warm_ms=1.0, cold_ms=2.0, peak_bytes=held_gib * GIB,
                             reserved_bytes=held_gib * GIB)

    verifier.shapes = {m.key: m for m in (ran(4, 9408, 2, 50), ran(2, 32760, 4, 40), ran(8, 9408, 0, 70, "over_budget"),
                                          ran(16, 9408, 8, 30))}
    thw = tuple(THW[3])
    low = 0.5 * BUDGET

    def bound(b, k, predicted=low):
        found = verifier._bound(9408, ScheduledShape(b, thw, 1, k), predicted)
        return None if found is None else found.key

    assert bound(2, 3) == (4, 9408, 2)  # fewer samples, more blocks checkpointed than a measured fit
    assert bound(2, 5) == (2, 32760, 4)  # both bound it: the one that held least names it
    assert bound(4, 2) == (4, 9408, 2)  # the measured shape itself (equal in all three)
    assert bound(2, 1) is None  # no fit at k <= 1 (B = 8 at k = 0 was over the budget)
    assert bound(5, 3) is None  # more samples than any fit at k <= 3
    assert bound(16, 8) == (16, 9408, 8) and bound(17, 8) is None
    assert bound(2, 3, predicted=(1 - RECHECK_MARGIN) * BUDGET * 1.001) is None  # too near the budget to skip
    assert bound(2, 3, predicted=None) is None  # no memory model: every shape runs
    assert verifier._bound(40000, ScheduledShape(1, thw, 1, 8), low) is None  # longer than anything measured


def test_without_a_memory_plan_only_the_batch_size_shrinks():
    shapes = [ScheduledShape(16, (1, 32, 32), 4, None), ScheduledShape(3, (1, 32, 32), 1, None)]
    state = {"limit": None}

    class Plain:
        def buckets(self):
            b = 16 if state["limit"] is None else min(16, state["limit"].max_batch_size)
            return {256: (b, (1, 32, 32), None)}

        def shapes(self):
            b = self.buckets()[256][0]
            return [ScheduledShape(b, (1, 32, 32), 4, None), ScheduledShape(3, (1, 32, 32), 1, None)]

        def seq_len(self, thw):
            return 256

        def predict(self, shape):
            return None, None

        def refit(self, verification):
            pass

        def apply(self, verification):
            state["limit"] = verification.limits.get(256)

    def measure(shape, warm=True):
        if shape.batch_size > 6:
            return {"status": "oom"}
        return {"status": "ok", "cold_ms": 9.0, "warm_ms": 5.0, "peak_bytes": 1e9 * shape.batch_size,
                "reserved_bytes": 1e9 * shape.batch_size}

    outcome = PlanVerifier(measure, Plain(), budget_bytes=20e9, device_bytes=40e9, num_blocks=None).run()
    assert outcome.converged and state["limit"].pinned and Plain().buckets()[256][0] <= 6
    assert [m.status for m in outcome.verification.shapes][0] == "oom" and shapes
