"""Budgets as the user sets and reads them: the ``max_vram_gb`` widget's GiB and every budget message.

Pure (no torch). ``gib_text`` writes a byte count as the widget's value (rounded up at its
precision, so that entering it gives at least those bytes) and ``gib_to_bytes`` reads one back;
``budget_gib`` and ``need_gib`` write a budget and a need beside it in a message. ``BudgetError``
is what a budget too small raises, its text written only by ``budget_error``, with the smallest
budget that works (``min_budget_text``: exact, or a lower bound and why: ``WEIGHTS_ALONE``,
``STOPPED``). ``plan`` builds the plans these messages speak of.
"""
from __future__ import annotations

import math

GIB_ROUND = 0.001      # the max_vram_gb widget's precision ("round" in nodes/max_vram.py)

# Why a minimum budget is only a lower bound (the message says so in these words).
WEIGHTS_ALONE = "weights alone: the activations of the input come on top"
STOPPED = "the forward could not be traced, and the measuring forward stopped before it saw every unit"


class BudgetError(ValueError):
    """No plan fits the budget, even with every unit cut as fine as it goes.

    ``kind`` says what does not fit: "weights" (a unit that cannot be cut finer, or what must stay
    resident) or "activations" (the live activation bytes of this input shape);
    ``min_budget_bytes`` is the smallest budget that works for this shape when ``exact``, a lower
    bound when not (a measuring forward stopped before it saw every unit). Build one with
    ``budget_error``, the one place its text is written."""

    def __init__(self, unit: str, need_bytes: int, budget_bytes: int, detail: str = "", *,
                 kind: str = "weights", min_budget_bytes: int | None = None, exact: bool = False,
                 message: str | None = None, bound: str = WEIGHTS_ALONE) -> None:
        self.unit, self.need_bytes, self.budget_bytes = unit, need_bytes, budget_bytes
        self.kind, self.min_budget_bytes, self.exact = kind, min_budget_bytes, exact
        msg = message or (f"VRAM budget {budget_gib(budget_bytes)} is too small: unit '{unit}' needs "
                          f"{need_gib(need_bytes)} on the device")
        msg += f" ({detail})" if detail else ""
        self.bound = bound     # why a minimum is only a lower bound
        self.what: str | None = None   # what does not fit, as "is too small…" goes on (``budget_error``)
        self.device_budgets: tuple[tuple[str, int], ...] | None = None  # per device (``placement``)
        if min_budget_bytes is not None:
            msg += "; " + min_budget_text(min_budget_bytes, exact, bound)
        super().__init__(msg)

    @property
    def min_budget_gb(self) -> str | None:
        """The ``max_vram_gb`` to set, as the message writes it."""
        return None if self.min_budget_bytes is None else gib_text(self.min_budget_bytes)


def min_budget_text(n: int, exact: bool, bound: str = WEIGHTS_ALONE) -> str:
    """The budget to set: "the smallest ... is X" only when X is known to work; else "at least X"
    and why that is a lower bound."""
    if exact:
        return f"the smallest max_vram_gb that works for this shape is {gib_text(n)}"
    return f"max_vram_gb must be at least {gib_text(n)} ({bound})"


def budget_error(unit: str, budget: int, *, kind: str, weight_bytes: int, activation_bytes: int | None,
                 min_budget_bytes: int | None, exact: bool, detail: str = "", bound: str = WEIGHTS_ALONE
                 ) -> BudgetError:
    """The one place a budget error's text is built. ``weight_bytes`` are the weights that must be
    on the device beside ``activation_bytes`` (None: not known); ``min_budget_bytes`` is exact, or a
    lower bound (``exact`` False) for the reason ``bound`` (``WEIGHTS_ALONE``, ``STOPPED``).
    Every figure is in GiB at the widget's three decimals, as the budget it stands beside."""
    act = activation_bytes or 0
    if kind == "activations":
        what = (f" for this input shape: its activations need {need_gib(act)} (unit '{unit}'), beside "
                f"{need_gib(weight_bytes)} of weights")
    else:
        what = (f": unit '{unit}' needs {need_gib(weight_bytes)} of weights on the device"
                + (f", {need_gib(weight_bytes + act)} with the activations" if activation_bytes is not None else ""))
    err = BudgetError(unit, weight_bytes + act, budget, detail, kind=kind, min_budget_bytes=min_budget_bytes,
                      exact=exact, message=f"VRAM budget {budget_gib(budget)} is too small{what}", bound=bound)
    err.what = what + (f" ({detail})" if detail else "")
    return err


def gib_text(n: int) -> str:
    """A byte count as a ``max_vram_gb`` value: rounded UP at the widget's precision, so that
    entering it gives at least ``n`` bytes."""
    text = lambda k: f"{k * GIB_ROUND:.3f}"  # noqa: E731
    k = max(1, math.ceil(n / 1024**3 / GIB_ROUND - 1e-9))
    while gib_to_bytes(text(k)) < n:  # the text read back, float rounding included
        k += 1
    return text(k)


def gib_given_text(n: int) -> str:
    """A budget given, as GiB text that reads back as no more than ``n`` bytes: rounded DOWN at
    the widget's precision (finer, to the first digit that is not 0, below it), so that a budget
    refused never reads as the smallest one that works (``gib_text`` rounds that one up)."""
    for digits in range(3, 13):
        text = lambda k: f"{k / 10**digits:.{digits}f}"  # noqa: E731
        k = math.floor(n / 1024**3 * 10**digits) + 1
        while k > 0 and gib_to_bytes(text(k)) > n:
            k -= 1
        if k > 0:
            return text(k)
    return "0"


def budget_gib(n: int) -> str:
    """A budget in a message, at the widget's three decimals: "2.250 GiB" (in bytes where that
    would read 0.000: a budget below the widget's precision)."""
    return f"{n / 1024**3:.3f} GiB" if n >= GIB_ROUND / 2 * 1024**3 else f"{n} B"


def need_gib(n: int) -> str:
    """What something needs, beside a budget: rounded up at the widget's precision ("2.248 GiB"),
    so the need and the budget that holds it read the same."""
    return f"{gib_text(n)} GiB" if n > 0 else "0.000 GiB"


def gib_to_bytes(gib) -> int:
    """Parse a budget in GiB (number or text); raises ValueError for 0, negative, NaN, text."""
    try:
        v = float(gib)
    except (TypeError, ValueError):
        raise ValueError(f"budget must be a number of GiB, got {gib!r}") from None
    if math.isnan(v) or math.isinf(v) or v <= 0:
        raise ValueError(f"budget must be a positive number of GiB, got {gib!r}")
    return int(v * 1024**3)
