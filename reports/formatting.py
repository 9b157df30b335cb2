"""Number formats shared by the HTML and Markdown renderings (NaN and None print as ``n/a``)."""

from __future__ import annotations

import math
from typing import Any

NA = "n/a"


def _missing(x: Any) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def num(x: Any, digits: int = 3) -> str:
    """A float with ``digits`` decimals; ints as they are."""
    if _missing(x):
        return NA
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return str(x)
    try:
        return f"{float(x):.{digits}f}"
    except (TypeError, ValueError):
        return str(x)


def pct(x: Any, digits: int = 1) -> str:
    """A ratio as a percentage: ``0.973`` -> ``97.3%``."""
    return NA if _missing(x) else f"{100 * float(x):.{digits}f}%"


def pts(x: Any, digits: int = 1) -> str:
    """A retention difference in percentage points: ``0.058`` -> ``5.8 pts``."""
    return NA if _missing(x) else f"{100 * float(x):.{digits}f} pts"


def signed_pct(x: Any, digits: int = 1) -> str:
    """A ratio change as a signed percentage: ``-0.027`` -> ``-2.7%``."""
    return NA if _missing(x) else f"{100 * float(x):+.{digits}f}%"


def signed(x: Any, digits: int = 3) -> str:
    """A signed float: ``+0.012``."""
    return NA if _missing(x) else f"{float(x):+.{digits}f}"


def si(x: Any) -> str:
    """A large count with an SI suffix: ``1234567`` -> ``1.23M``."""
    if _missing(x):
        return NA
    v = float(x)
    for factor, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= factor:
            return f"{v / factor:.3g}{suffix}"
    return f"{v:.3g}"


def pvalue(x: Any) -> str:
    """A p-value: ``0.0123``, ``<1e-4``."""
    if _missing(x):
        return NA
    return "<1e-4" if float(x) < 1e-4 else f"{float(x):.4f}"


def ci(low: Any, high: Any, fmt=pct) -> str:
    """An interval ``[low, high]`` in format ``fmt``."""
    if _missing(low) or _missing(high):
        return NA
    return f"[{fmt(low)}, {fmt(high)}]"


def text(x: Any) -> str:
    """Anything as text (``n/a`` for missing)."""
    return NA if _missing(x) else str(x)
