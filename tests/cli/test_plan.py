import json
from importlib.resources import files

import numpy as np
import pytest

from lightning_adaptiveload.cli import main
from lightning_adaptiveload.scheduling.cost_model import load_cost_model
from lightning_adaptiveload.scheduling.policies import dual_constraint_batch_size, token_equal_batch_size
from lightning_adaptiveload.scheduling.shapes import read_shapes_jsonl

DATA = files("lightning_adaptiveload") / "data"
SHAPES = str(DATA / "reference_mix.jsonl")
CURVE = str(DATA / "h200_dit_cost_curve.json")


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """The shipped H200 curve fitted once, saved as a cost-model JSON."""
    path = tmp_path_factory.mktemp("cm") / "model.json"
    model = load_cost_model(CURVE)
    model.to_json(path)
    return str(path), model


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_on_shipped_measurements(capsys):
    code, out, err = run(capsys, "plan", "--shapes", SHAPES, "--cost-model", CURVE, "--m-mem", "65536",
                         "--world-size", "8")
    assert code == 0 and err == ""
    mix = read_shapes_jsonl(SHAPES)
    oversize = int(mix.counts[mix.tokens > 65536].sum())
    assert oversize > 0 and f"of {mix.num_samples} samples scheduled; dropped: oversize {oversize}," in out
    assert "epoch plan on 8 rank(s)" in out and "policy balanced" in out
    assert "75600" not in out  # the oversize bucket is not scheduled


@pytest.mark.parametrize("policy", ["token_equal", "dual_constraint", "balanced"])
@pytest.mark.parametrize("world, drop_last", [(1, True), (8, True), (8, False)])
def test_plan_json_matches_formulas(capsys, fitted, policy, world, drop_last):
    path, model = fitted
    code, out, _ = run(capsys, "plan", "--shapes", SHAPES, "--cost-model", path, "--m-mem", "65536",
                       "--max-seq-len", "50000", "--json", "--policy", policy, "--world-size", str(world),
                       "--drop-last" if drop_last else "--no-drop-last")
    assert code == 0
    doc = json.loads(out)
    table, stats = doc["bucket_table"], doc["epoch_plan"]
    mix = read_shapes_jsonl(SHAPES)
    fits = mix.tokens <= 50000
    assert table["seq_len"] == sorted(set(mix.tokens[fits].tolist()))  # no two shapes share a count here
    m_comp = model.m_comp(65536, 46800)  # longest bucket <= 50000
    assert table["m_comp"] == (None if policy == "token_equal" else pytest.approx(m_comp))
    full_batches = partial = 0
    for s, n, b, ms in zip(table["seq_len"], table["samples"], table["batch_size"], table["cost_ms"]):
        assert n == int(mix.counts[mix.tokens == s].sum())
        expect = token_equal_batch_size(s, 65536) if policy == "token_equal" \
            else dual_constraint_batch_size(s, 65536, m_comp, model.p)
        assert b == expect and ms == pytest.approx(model.predict(b, s))
        full_batches += n // b
        partial += n % b
    oversize = int(mix.counts[~fits].sum())
    assert stats["samples_total"] == mix.num_samples and stats["dropped_oversize"] == oversize
    assert stats["world_size"] == world and stats["batches"] == stats["steps"] * world
    left_out = stats["dropped_oversize"] + stats["dropped_partial_batch"] + stats["dropped_step_remainder"]
    assert stats["samples_scheduled"] + left_out == mix.num_samples
    if drop_last:
        assert stats["dropped_partial_batch"] == partial and stats["steps"] == full_batches // world
    else:  # every sample that fits is scheduled, in ceil(batches / world) steps
        batches = full_batches + sum(n % b > 0 for n, b in zip(table["samples"], table["batch_size"]))
        assert left_out == oversize and stats["steps"] == -(-batches // world)


def test_plan_explicit_m_comp(capsys, fitted):
    code, out, _ = run(capsys, "plan", "--shapes", SHAPES, "--cost-model", fitted[0], "--m-mem", "65536",
                       "--m-comp", "1e5", "--json")
    table = json.loads(out)["bucket_table"]
    assert table["m_comp"] == 1e5 and table["policy"] == "balanced"
    b = table["batch_size"][table["seq_len"].index(1024)]
    assert b == max(1, min(64, int(np.floor(1e5 / 1024 ** fitted[1].p))))


def test_simulate_json(capsys, fitted):
    code, out, err = run(capsys, "simulate", "--shapes", SHAPES, "--cost-model", fitted[0], "--m-mem", "65536",
                         "--world-size", "16", "--policy", "balanced", "--steps", "300", "--json")
    assert code == 0, err
    r = json.loads(out)
    for key in ("policy", "world_size", "load_cv_mean", "load_max_over_mean_mean", "bubble_frac",
                "predicted_tokens_per_s", "predicted_samples_per_s", "steps", "dropped_oversize"):
        assert key in r
    assert r["policy"] == "balanced" and r["world_size"] == 16 and r["steps"] == 300
    code, out, _ = run(capsys, "simulate", "--shapes", SHAPES, "--cost-model", fitted[0], "--m-mem", "65536",
                       "--world-size", "16", "--policy", "token_equal", "--steps", "300")
    assert code == 0 and "load_cv_mean" in out


@pytest.mark.parametrize("line, needle", [
    ('{"frames": 1, "height": 0, "width": 64}', ":2: field 'height' must be an integer >= 1, got 0"),
    ('{"tokens": 512, "count": 2.5}', ":2: field 'count' must be an integer"),
    ('{"tokens": 512', ":2: not valid JSON"),
    ('{"frames": 1, "height": 64}', ":2: needs 'tokens'"),
])
def test_malformed_shapes(capsys, tmp_path, fitted, line, needle):
    shapes = tmp_path / "shapes.jsonl"
    shapes.write_text('{"tokens": 1024, "count": 3}\n' + line + "\n")
    code, out, err = run(capsys, "plan", "--shapes", str(shapes), "--cost-model", fitted[0], "--m-mem", "65536")
    assert code == 2 and out == ""
    assert needle in err and "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize("text, needle", [
    ("{not json", "not valid JSON"),
    ('{"measurements": [{"batch_size": 1, "seq_len": 256}]}', "measurements[0] is missing 'time_ms'"),
    ('{"format": "adaptiveload.cost_model", "version": 1}', "missing keys"),
    ("[1, 2]", "neither a cost model"),
])
def test_malformed_cost_model(capsys, tmp_path, text, needle):
    path = tmp_path / "cm.json"
    path.write_text(text)
    code, out, err = run(capsys, "simulate", "--shapes", SHAPES, "--cost-model", str(path), "--m-mem", "65536",
                         "--world-size", "2", "--policy", "balanced", "--steps", "3")
    assert code == 2 and needle in err and "Traceback" not in err


def test_missing_file_and_too_many_ranks(capsys, fitted):
    code, _, err = run(capsys, "plan", "--shapes", "/nonexistent/shapes.jsonl", "--cost-model", fitted[0],
                       "--m-mem", "65536")
    assert code == 2 and "No such file" in err
    code, _, err = run(capsys, "simulate", "--shapes", SHAPES, "--cost-model", fitted[0], "--m-mem", "65536",
                       "--world-size", "1000000", "--policy", "token_equal", "--steps", "3")
    assert code == 2 and "world size 1000000 is larger than the number of batches" in err


def test_help_loads_neither_torch_nor_lightning():
    import subprocess
    import sys

    code = ("import sys; from lightning_adaptiveload.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_index_command_offers_the_duplicate_rules_of_build_index():
    from lightning_adaptiveload.cli import build_parser
    from lightning_adaptiveload.data.index import DUPLICATES

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["index"]
    assert tuple(next(a for a in sub._actions if a.dest == "duplicates").choices) == DUPLICATES
