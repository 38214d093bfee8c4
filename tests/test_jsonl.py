import json

import numpy as np
import pytest

from lightning_adaptiveload._jsonl import iter_objects


def _write(path, rows, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def test_objects_and_their_line_numbers_blank_lines_skipped(tmp_path):
    rng = np.random.default_rng(7)
    rows = [{"k": int(v), "x": float(rng.normal())} for v in rng.integers(0, 1000, 20)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" + ("\n" if i % 3 == 0 else "") for i, r in enumerate(rows)))
    got = list(iter_objects(path))
    assert [r for _, r in got] == rows
    lines = path.read_text().split("\n")
    assert all(json.loads(lines[n - 1]) == r for n, r in got)


def test_a_torn_last_line_is_left_out_only_for_append_only_files(tmp_path):
    rows = [{"i": i} for i in range(5)]
    path = tmp_path / "journal.jsonl"
    _write(path, rows, tail='{"i": 5, "sha')
    assert [r for _, r in iter_objects(path, torn_tail=True)] == rows
    with pytest.raises(ValueError, match=r"journal.jsonl:6: not valid JSON"):
        list(iter_objects(path))
    _write(path, rows, tail='{"i": 5}')  # whole but unterminated: still being written, left out too
    assert [r for _, r in iter_objects(path, torn_tail=True)] == rows


def test_a_bad_line_before_the_last_is_an_error_even_for_append_only_files(tmp_path):
    path = tmp_path / "journal.jsonl"
    path.write_text('{"i": 0}\n{"i": 1\n{"i": 2}\n')
    with pytest.raises(ValueError, match=r"journal.jsonl:2: not valid JSON"):
        list(iter_objects(path, torn_tail=True))
    path.write_text('{"i": 0}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"journal.jsonl:2: expected a JSON object, got list"):
        list(iter_objects(path, torn_tail=True))
