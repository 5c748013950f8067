"""One input signature's life in the engine: everything known of one shape, in named states.

A ``Shape`` holds what the engine knows of one input signature (shapes and dtypes of a call):
its dry run (``trace``), the figures its measuring forward saw (``measurements``, grown when it
is measured again), the plan that runs it (``plan``; on several devices also ``placed``: the
placement, its hop rule and the dry run's hops), its unit clock (``times``), the budget error
that refused it (``failure``), why a steady forward sent it back to measuring (``again``) and the
shapes that share its plan (``joined``). Its state is one name, and each change of state is one
method that checks the state it starts from (``InvalidTransition`` names both), in the manner of
``asyncio.Future``::

    NEW --traced--> TRACED --measuring--> MEASURING --planned--> PLANNED --ran--> STEADY
                                              |  ^                  ^  |            |
                                        abort |  | measuring        |  | to_place   | measure_again
                                              v  |                  |  v            v   (once)
                                        (before) AGAIN <------------+-TO_PLACE     AGAIN
    refuse: MEASURING | TO_PLACE --> REFUSED --reopen--> TRACED | NEW   (the budgets changed)
    forget_plan: any but MEASURING --> TRACED | NEW (measurements kept); forget: --> NEW

The two rules a shape keeps for itself: it is measured again at most once in its life
(``measure_again``: a plan must stay stable), and a measurement taken again keeps the larger
figure of each unit (``measured``: the peak that sent it back).

``Shapes`` is the engine's table of them, with read-only views by kind (``plans()``,
``measurements()``, ``traces()``, ``failures()``). No torch here: the engine and its device side
(``one_device``, ``devices``) fill the figures in.
"""
from __future__ import annotations

from typing import Callable

from .figures.meters import UnitMeasurement
from .figures.speed import UnitTimes

NEW = "new"                # nothing known yet
TRACED = "traced"          # the dry run's profile is known (or why it could not run); nothing planned
MEASURING = "measuring"    # its measuring forward runs now
PLANNED = "planned"        # a plan from measured figures, not run yet
STEADY = "steady"          # forwards run that plan
AGAIN = "measure again"    # a steady forward passed the budget: the next forward measures again
TO_PLACE = "place again"   # the budgets moved: the next forward plans again from the measurements
REFUSED = "refused"        # a budget error; the same input fails so until the budgets change


class InvalidTransition(RuntimeError):
    """A transition asked of a shape in a state it does not start from."""


class Shape:
    def __init__(self, sig: tuple, top: Callable[[str], str]) -> None:
        self.sig = sig
        self.state = NEW
        self.trace = None                 # trace.TraceResult
        self.measurements: dict[str, UnitMeasurement] | None = None
        self.plan = None                  # plan.Plan: the one run (several devices: drawn as one)
        self.placed = None                # several devices: (Placement, hop rule, the dry run's hops)
        self.failure = None               # plan.BudgetError
        self.again: str | None = None     # why a steady forward sent it back to measuring (once)
        self.joined = frozenset((sig,))   # the signatures sharing its plan (itself at least)
        self.times = UnitTimes(top)       # measured compute seconds per unit
        self.untimed = False              # the next forward times its units (CPU)
        self._before: str | None = None   # the state a measuring forward started from

    def __repr__(self) -> str:
        return f"<Shape {self.state} {self.sig!r}>"

    def _expect(self, what: str, *states: str) -> None:
        if self.state not in states:
            raise InvalidTransition(f"shape {what}: it is {self.state!r}, not {' or '.join(map(repr, states))}")

    @property
    def planned(self) -> bool:
        """It has a plan to run (PLANNED or STEADY)."""
        return self.state in (PLANNED, STEADY)

    @property
    def again_warnings(self) -> tuple[str, ...]:
        """What a plan made after measuring again says of why (the node shows it)."""
        return (f"planned again: {self.again}",) if self.again else ()

    # -- transitions -------------------------------------------------------------------------

    def traced(self, tr) -> None:
        """The dry run's profile (a failed dry run too: it says why). NEW -> TRACED; kept as it is
        in any other state that lost its profile (a shape sent back to measuring traces again)."""
        if self.trace is not None:
            raise InvalidTransition(f"shape traced: it has its dry run already ({self.state!r})")
        self.trace = tr
        if self.state == NEW:
            self.state = TRACED

    def measuring(self) -> None:
        """Its measuring forward starts: NEW | TRACED | AGAIN -> MEASURING."""
        self._expect("measuring", NEW, TRACED, AGAIN)
        self._before, self.state = self.state, MEASURING

    def measured(self, meas: dict[str, UnitMeasurement]) -> dict[str, UnitMeasurement]:
        """The figures the measuring forward saw, grown by those of before (a shape measured
        again keeps the larger figure of each unit); MEASURING stays."""
        self._expect("measured", MEASURING)
        for n, m in (self.measurements or {}).items():
            if n in meas:
                new = meas[n]
                meas[n] = UnitMeasurement(max(m.entry_bytes, new.entry_bytes), max(m.peak_bytes, new.peak_bytes),
                                          max(m.calls, new.calls), m.modules | new.modules)
        self.measurements = meas
        return meas

    def planned_as(self, plan, placed=None) -> None:
        """Its plan from the measured figures: MEASURING | TO_PLACE -> PLANNED."""
        self._expect("planned", MEASURING, TO_PLACE)
        if self.measurements is None:
            raise InvalidTransition("shape planned: nothing measured")
        self.plan, self.placed, self.state = plan, placed, PLANNED
        self.joined = frozenset((self.sig,))

    def abort(self) -> None:
        """The measuring forward failed for a reason that is not the budget (an interrupt, an
        error in the model): MEASURING -> the state it started from."""
        self._expect("abort", MEASURING)
        self.state, self._before = self._before, None

    def ran(self) -> None:
        """A forward ran its plan: PLANNED | STEADY -> STEADY."""
        self._expect("ran", PLANNED, STEADY)
        self.state = STEADY

    def replanned(self, plan, joined: frozenset | None = None) -> None:
        """Its plan made again without measuring (timed from its measured unit times, or shared
        with the shapes ``joined``); PLANNED | STEADY stays."""
        self._expect("replanned", PLANNED, STEADY)
        self.plan = plan
        if joined is not None:
            self.joined = joined

    def measure_again(self, why: str) -> bool:
        """A steady forward passed the budget: STEADY -> AGAIN, its plan and dry run dropped (the
        dry run runs the host's code again too), once in its life (False when it was before:
        a plan must stay stable)."""
        self._expect("measure again", STEADY)
        if self.again is not None:
            return False
        self.again, self.state = why, AGAIN
        self.plan = self.placed = self.trace = None
        return True

    def to_place(self) -> None:
        """The budgets moved past what its plan holds: PLANNED | STEADY -> TO_PLACE; the next
        forward plans again from its measurements (none measures again)."""
        self._expect("to place", PLANNED, STEADY)
        self.plan = self.placed = None
        self.joined = frozenset((self.sig,))
        self.state = TO_PLACE

    def refuse(self, error) -> None:
        """A budget error: MEASURING | TO_PLACE -> REFUSED (the same input fails so next time)."""
        self._expect("refuse", MEASURING, TO_PLACE)
        self.failure, self.state, self._before = error, REFUSED, None
        self.plan = self.placed = None

    def reopen(self) -> None:
        """The budgets changed: REFUSED -> TRACED (or NEW without a dry run); measured first."""
        self._expect("reopen", REFUSED)
        self.failure = None
        self.state = TRACED if self.trace is not None else NEW

    def forget_plan(self) -> None:
        """Its plan and failure dropped, its figures kept: -> TRACED (or NEW)."""
        if self.state == MEASURING:
            raise InvalidTransition("shape forget plan: its measuring forward runs now")
        self.plan = self.placed = self.failure = None
        self.joined = frozenset((self.sig,))
        self.state = TRACED if self.trace is not None else NEW

    def forget(self) -> None:
        """The module's units changed: everything dropped (but ``again``: once in a life) -> NEW."""
        again = self.again
        self.__init__(self.sig, self.times.top)
        self.again = again


class Shapes(dict):
    """The engine's table: input signature -> ``Shape``."""

    def __init__(self, top: Callable[[str], str]) -> None:
        super().__init__()
        self.top = top

    def of(self, sig: tuple) -> Shape:
        """The shape of ``sig``, NEW the first time it is asked for."""
        s = self.get(sig)
        if s is None:
            s = self[sig] = Shape(sig, self.top)
        return s

    def plans(self) -> dict:
        return {sig: s.plan for sig, s in self.items() if s.plan is not None}

    def measurements(self) -> dict:
        return {sig: s.measurements for sig, s in self.items() if s.measurements is not None}

    def traces(self) -> dict:
        return {sig: s.trace for sig, s in self.items() if s.trace is not None}

    def failures(self) -> dict:
        return {sig: s.failure for sig, s in self.items() if s.failure is not None}

    def in_state(self, *states: str) -> list[Shape]:
        return [s for s in self.values() if s.state in states]
