import math
import random

import numpy as np
import pytest

from lightning_adaptiveload.scheduling.shapes import TokenSpec, read_shapes_jsonl


def tokens_by_hand(frames, height, width, st=4, ss=8, patch=(1, 2, 2), extra=0):
    t, h, w = 1 + (frames - 1) // st, height // ss, width // ss
    return math.ceil(t / patch[0]) * (h // patch[1]) * (w // patch[2]) + extra


def test_wan21_default_matches_the_known_480p_81_frame_shape():
    assert TokenSpec().latent_from_pixels(81, 480, 832) == (21, 60, 104)
    assert TokenSpec().tokens_from_pixels(81, 480, 832) == 32760


def test_random_shapes_and_specs_match_the_formula():
    rng = random.Random(0)
    for _ in range(300):
        st, ss = rng.choice([1, 2, 4, 8]), rng.choice([4, 8, 16])
        patch = (rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 4))
        extra = rng.choice([0, 77, 512])
        f, h, w = rng.randint(1, 129), rng.randint(64, 1280), rng.randint(64, 1280)
        spec = TokenSpec(st, ss, patch, extra)
        assert spec.tokens_from_pixels(f, h, w) == tokens_by_hand(f, h, w, st, ss, patch, extra)


def test_vectorized_over_arrays():
    rng = np.random.default_rng(1)
    f, h, w = rng.integers(1, 120, 50), rng.integers(64, 900, 50), rng.integers(64, 900, 50)
    got = TokenSpec(extra_tokens=7).tokens_from_pixels(f, h, w)
    assert got.tolist() == [tokens_by_hand(*map(int, s), extra=7) for s in zip(f, h, w)]


@pytest.mark.parametrize("kwargs", [dict(vae_stride_t=0), dict(vae_stride_s=-1), dict(patch=(1, 2)),
                                    dict(patch=(1, 0, 2)), dict(extra_tokens=-1)])
def test_bad_spec_is_rejected(kwargs):
    with pytest.raises(ValueError, match="TokenSpec"):
        TokenSpec(**kwargs)


def test_shapes_file_all_three_kinds_and_default_count(tmp_path):
    path = tmp_path / "mix.jsonl"
    path.write_text('{"frames": 81, "height": 480, "width": 832, "count": 3}\n\n'
                    '{"latent_t": 2, "latent_h": 8, "latent_w": 10}\n{"tokens": 999, "count": 2}\n')
    mix = read_shapes_jsonl(path, TokenSpec(extra_tokens=1))
    assert mix.tokens.tolist() == [32761, 2 * 4 * 5 + 1, 999]
    assert mix.counts.tolist() == [3, 1, 2]
    assert mix.latent_thw.tolist() == [[21, 60, 104], [2, 8, 10], [-1, -1, -1]]
    assert mix.num_samples == 6
    assert mix.per_sample_tokens().tolist() == [32761] * 3 + [41] + [999] * 2


@pytest.mark.parametrize("line, needle", [
    ('{"frames": 0, "height": 480, "width": 832}', ":2: field 'frames' must be an integer >= 1, got 0"),
    ('{"tokens": 10, "count": 1.5}', ":2: field 'count' must be an integer"),
    ('{"tokens": true}', ":2: field 'tokens' must be an integer"),
    ('{"height": 480, "width": 832}', ":2: needs 'tokens'"),
    ('[1, 2]', ":2: expected a JSON object"),
    ('{"tokens": ', ":2: not valid JSON"),
    ('{"frames": 1, "height": 8, "width": 8}', ":2: shape"),
])
def test_malformed_line_names_line_and_field(tmp_path, line, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"tokens": 5}\n' + line + "\n")
    with pytest.raises(ValueError, match=needle.replace("[", r"\[")):
        read_shapes_jsonl(path)


def test_empty_file_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(ValueError, match="no shapes"):
        read_shapes_jsonl(path)


def test_non_utf8_line_names_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"tokens": 5}\n{"tokens": 6, "note": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.jsonl:2: not UTF-8 text"):
        read_shapes_jsonl(path)
