"""Input checks shared by every layer: each names the argument and says what is wrong."""
from __future__ import annotations

import math


def is_positive_number(value) -> bool:
    """A finite int or float > 0 (true/false are not numbers here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
