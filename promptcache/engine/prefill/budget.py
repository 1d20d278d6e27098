"""The recompute setting's names and checks, without torch (``config.py`` and the command line's
options read them; ``recompute.py`` does the work and re-exports them)."""

from __future__ import annotations

__all__ = ["AUTO", "AUTO_FRACTION", "DEFAULT_SELECTION", "check_fraction", "check_recompute", "fraction_of"]

AUTO = "auto"  # the engine picks the budget: nothing for exact layouts, AUTO_FRACTION of the drifted tokens
AUTO_FRACTION = 0.15  # the measured budget rule (eval/results/quality.md)
DEFAULT_SELECTION = "qmatch"  # the best measured selection, and the cheapest (eval/results/quality.md)


def check_fraction(r, where: str = "recompute") -> float:
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= float(r) <= 1.0:
        raise ValueError(f"{where} must be a fraction in [0, 1], got {r!r}")
    return float(r)


def check_recompute(r, where: str = "recompute") -> float | str:
    """``"auto"`` or a fraction in [0, 1] (``where`` names the setting in the error)."""
    if isinstance(r, str) and r.strip().lower() == AUTO:
        return AUTO
    if isinstance(r, str):
        raise ValueError(f"{where} must be 'auto' or a fraction in [0, 1], got {r!r}")
    try:
        return check_fraction(r, where)
    except ValueError:
        raise ValueError(f"{where} must be 'auto' or a fraction in [0, 1], got {r!r}") from None


def fraction_of(r: float | str) -> float:
    """The fraction a checked setting stands for: ``AUTO_FRACTION`` for ``"auto"``, else itself.
    Only drifted tokens are candidates, so ``"auto"`` on an exact layout recomputes nothing."""
    return AUTO_FRACTION if r == AUTO else float(r)
