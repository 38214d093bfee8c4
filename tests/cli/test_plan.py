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
    code, out, err = run(capsys, "plan", "--shapes", SHAPES, "--cost-model", CURVE, "--m-mem", "65536")
    assert code == 0 and err == ""
    assert "100000 samples, 8273 dropped as longer than max_seq_len" in out
    assert "75600" in out


def test_plan_json_matches_formulas(capsys, fitted):
    path, model = fitted
    code, out, _ = run(capsys, "plan", "--shapes", SHAPES, "--cost-model", path, "--m-mem", "65536",
                       "--max-seq-len", "50000", "--json")
    assert code == 0
    table = json.loads(out)
    mix = read_shapes_jsonl(SHAPES)
    assert table["samples"] == mix.num_samples
    assert table["dropped_oversize"] == int(mix.counts[mix.tokens > 50000].sum())
    assert table["m_comp"] == pytest.approx(model.m_comp(65536, 46800))  # longest bucket <= 50000
    for row in table["buckets"]:
        s = row["tokens"]
        assert row["samples"] == int(mix.counts[mix.tokens == s].sum())
        if s > 50000:
            assert row["dropped"] == row["samples"] and row["batch_size"]["token_equal"] is None
            continue
        b_tok = token_equal_batch_size(s, 65536)
        b_dual = dual_constraint_batch_size(s, 65536, table["m_comp"], model.p)
        assert row["batch_size"] == {"token_equal": b_tok, "dual_constraint": b_dual, "balanced": b_dual}
        assert row["step_ms"]["token_equal"] == pytest.approx(model.predict(b_tok, s))


def test_plan_explicit_m_comp(capsys, fitted):
    code, out, _ = run(capsys, "plan", "--shapes", SHAPES, "--cost-model", fitted[0], "--m-mem", "65536",
                       "--m-comp", "1e5", "--json")
    table = json.loads(out)
    assert table["m_comp"] == 1e5
    row = next(r for r in table["buckets"] if r["tokens"] == 1024)
    assert row["batch_size"]["dual_constraint"] == max(1, min(64, int(np.floor(1e5 / 1024 ** fitted[1].p))))


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
