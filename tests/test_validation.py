"""_validation (argument checks) and _distributed (world size and rank lookup)."""
import math

import numpy as np
import pytest

from lightning_adaptiveload._distributed import is_distributed, world_size_and_rank
from lightning_adaptiveload._validation import (is_finite_number, is_positive_number, require_choice, require_int,
                                                require_number)


def test_require_int():
    assert require_int("n", 4096.0) == 4096 and require_int("n", np.int64(7)) == 7 and require_int("n", 0, 0) == 0
    for bad in (None, "4096", True, 1.5, float("nan"), float("inf"), 0, -3, [1]):
        with pytest.raises(ValueError, match=r"^f.json:3: field 'n' must be an integer >= 1, got "):
            require_int("f.json:3: field 'n'", bad)


def test_numbers():
    good = (1, 2.5, np.float32(0.5), np.int64(3), 1e300)
    bad = (0, -1.0, float("nan"), float("inf"), True, "1", None, [1.0])
    assert all(is_finite_number(v) and is_positive_number(v) for v in good)
    assert not any(is_positive_number(v) for v in bad)
    assert is_finite_number(0) and is_finite_number(-1.0) and not is_finite_number(math.nan)
    assert require_number("x", 3) == 3.0 and isinstance(require_number("x", np.int64(3)), float)
    assert require_number("x", 0, minimum=0) == 0.0 and require_number("x", -2.5) == -2.5
    with pytest.raises(ValueError, match=r"^x must be a finite number > 0, got 0$"):
        require_number("x", 0, positive=True)
    with pytest.raises(ValueError, match=r"^x must be a finite number >= 0, got -1$"):
        require_number("x", -1, minimum=0)
    with pytest.raises(ValueError, match=r"^x must be a finite number, got nan$"):
        require_number("x", float("nan"))


def test_require_choice():
    assert require_choice("policy", "balanced", ("token_equal", "balanced")) == "balanced"
    for bad in ("fastest", None, 1, ["balanced"]):
        with pytest.raises(ValueError, match=r"policy must be one of \('token_equal', 'balanced'\), got"):
            require_choice("policy", bad, ("token_equal", "balanced"))


def test_world_size_and_rank(tmp_path):
    import torch.distributed as dist

    assert not is_distributed() and world_size_and_rank() == (1, 0)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert is_distributed() and world_size_and_rank() == (1, 0)
        group = dist.new_group([0])
        assert world_size_and_rank(group) == (1, 0)
    finally:
        dist.destroy_process_group()
    assert world_size_and_rank() == (1, 0)
