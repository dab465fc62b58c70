"""What the norm tests expect, derived from docs/architecture.md rather than from the code under test."""

from __future__ import annotations

import math
from fractions import Fraction


def expected_partial_size(n: int, p: float) -> int:
    """pRMSNorm's k: ceil(n * p) with p read as the decimal it is written as, clamped to [1, n]."""
    return min(n, max(1, math.ceil(Fraction(str(p)) * n)))
