"""Tau chosen as a run goes: the fewest inner steps a round that keep the exchange's share low.

The paper's model (SparkNet, section 3; `sparknet.bench.scaling` fits it to benchmark runs): a
round of local SGD takes tau*C + S seconds, C one inner step of the slowest worker and S what the
round costs besides the steps (the weights sent out, the updates exchanged and averaged, the
outer step). The exchange's share of a round is S / (tau*C + S). A larger tau pays for S with
more steps, but the workers then drift further apart between averages, which costs convergence;
so the chooser takes the smallest tau whose predicted share is at most `share`:

    tau >= S*(1 - share) / (share*C), rounded up and kept within [low, high].

`high` (a run passes its `tau_max`, 100 by default; the class's own 1000 is for a chooser used
alone) bounds it because the model prices the exchange and
not what the workers' drift between averages costs: at 100 Mbit/s (`bench peers`,
`imagenet-like-wide`, K=2) the 10% goal asked for ~700 steps a round, and tau=100 reached the
target in 55 s, 200 in 57 s, 400 in 78 s and the chooser's 708 in 81 s (the samples it took grew
1.45x from 100 to 200 and 2.3x to 400).

How it reads the measurements, and why:

- Round 1 runs at the probe `first` and never counts: it carries the run's start-up (Python
  workers started, torch imported, the first batch read, lazy initialisation). Nor does the
  first round of a resume or of a restarted stage (`from_state`): it starts all that again.
- C is a round's compute over its own tau, so rounds run at different taus mix; C and S are
  always medians, which the odd slow round does not move.
- The first choice waits for `FIRST_CHOICE` (4) measured rounds, rounds 2 to 5, and takes their
  medians: one round is one hiccup away from a tau many times too large or too small, and with
  10% noise a choice from 3 rounds is at times a fifth off, enough for later estimates to move
  it again. The probe rounds cost one exchange each, little against a run's length. The first
  choice leaves the probe whatever the difference: the probe is a guess, not a measurement.
- Hysteresis: after that, tau moves only where an estimate puts the ideal (before rounding up)
  more than a factor `BAND` (1.25) away from tau, so that the noise of the measurements does not
  move it every round (a run's learning dynamics change with tau: they should not follow noise).
  The ideal before rounding, so that a small tau does not flip between two integers a third
  apart. The price: while the ideal stays within the band, the exchange's share may sit up to
  about a quarter above the goal (0.12 for a goal of 0.10).
- Two estimates may move it. The settled one is the medians of the rounds since the regime
  began (the last `REGIME` (25) of them), steady enough to move tau on its own once it holds
  `SETTLED` (9) rounds: it follows a slow drift, or a first choice that missed. A change of
  regime (a worker moved onto a slower link: S four times larger) must move tau within a few
  rounds, before the settled medians notice; but the medians of a few noisy rounds are often a
  fifth off, which against a tau chosen a fifth off the other way would cross the band on noise
  alone. So the last `AGREE` (3) rounds move tau when each of them alone puts the ideal beyond
  the band around the settled estimate, all on the same side (noise seldom does that three
  rounds running; a lasting change does it every round), and their medians put it beyond the
  band around tau. The regime then begins again from those 3 rounds.

Simulated with 10% noise on each round's C and S (uniform, ideal taus from 1 to 900): after
the first choice tau held through each of 2000 runs of 500 rounds, and followed an S made 4
times larger within 3 rounds in each of 2000 runs; the tests keep a sample of those runs.

Every change, and the first choice even where it keeps the probe's value (it is when the probe
ended), is a `decision`: data a metrics row can carry. `state` and `from_state` carry the chooser
across a resume, so that a resumed run goes on with the same tau and the same estimates.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparknet.config import TrainConfig

#: measured rounds (after round 1) the first choice waits for
FIRST_CHOICE = 4
#: rounds that must each, on their own, put the ideal beyond the band for a change of regime
AGREE = 3
#: rounds the settled estimate holds at most, and at least before it may move tau on its own
REGIME, SETTLED = 25, 9
#: how far (a factor either way) the ideal tau may move before tau follows it
BAND = 1.25
#: what `state` writes; `from_state` refuses any other
STATE_VERSION = 1
#: a quotient this close above an integer still rounds down to it (float noise, not a need)
_ROUNDING = 1e-9

#: one measured round, per step: (C, S) in seconds
Round = tuple[float, float]


class TauChooser:
    """Chooses each round's tau from the rounds measured so far (the rules: the module's
    docstring).

    Feed it every finished round with `observe`, then run the next round with `next_tau`;
    `decision` says why that tau, where it changed."""

    def __init__(
        self, share: float = 0.10, first: int = 10, low: int = 1, high: int = 1000
    ) -> None:
        _check_share(share)
        if not _is_int(low) or low < 1:
            raise ValueError(f"low must be a whole number of at least 1 (got {low!r})")
        _check_high(high, low)
        if not _is_int(first) or not low <= first <= high:
            raise ValueError(
                f"first must be a whole number from low={low} to high={high} (got {first!r})"
            )
        #: the next round observed is a (re)start's first, which carries its start-up: not counted
        self._startup = True
        self.share, self.first, self.low, self.high = float(share), first, low, high
        self._tau = first
        self._seen = 0  # rounds observed, round 1 included
        self._regime: list[Round] = []  # the measured rounds since the regime started
        self._chosen = False  # whether tau has left the probe
        self._decision: dict[str, Any] | None = None

    # ---- the loop's side ----------------------------------------------------------------------

    def observe(self, tau: int, compute_s: float, exchange_s: float) -> None:
        """One finished round: the tau it ran with, the seconds of its tau steps (the slowest
        worker's) and the rest of its seconds. Chooses the next round's tau."""
        if not _is_int(tau) or tau < 1:
            raise ValueError(f"tau must be a whole number of at least 1 (got {tau!r})")
        for name, value in (("compute_s", compute_s), ("exchange_s", exchange_s)):
            if not _is_number(value) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number of seconds, >= 0 (got {value!r})")
        self._seen += 1
        self._decision = None
        if self._startup:  # the round a run, a resume or a restarted stage began with
            self._startup = False
            return
        measured = (compute_s / tau, float(exchange_s))
        self._regime = [*self._regime, measured][-REGIME:]
        chosen = self._choose()
        if chosen is None:
            return
        rows, ideal = chosen
        new = math.ceil(ideal * (1 - _ROUNDING))
        if self._chosen and new == self._tau:
            return
        step_s, sync_s = medians(rows)
        self._decision = {
            "tau": new,
            "was": self._tau,
            "step_s": step_s,
            "exchange_s": sync_s,
            "share": predicted_share(new, step_s, sync_s),
        }
        self._tau, self._chosen = new, True

    def _choose(self) -> tuple[Sequence[Round], float] | None:
        """(the rounds a new tau comes from, its ideal), or None to keep tau."""
        if not self._chosen:
            if len(self._regime) < FIRST_CHOICE:
                return None
            return self._regime, self._ideal(self._regime)
        settled = self._ideal(self._regime)
        agree = self._regime[-AGREE:]  # the last rounds: a new regime begins with them
        each = [self._ideal([r]) for r in agree]
        moved = all(x > settled * BAND for x in each) or all(x < settled / BAND for x in each)
        if len(agree) == AGREE and moved and not self._near(self._ideal(agree)):
            self._regime = agree
            return agree, self._ideal(agree)
        if len(self._regime) >= SETTLED and not self._near(settled):
            return self._regime, settled
        return None

    def _near(self, ideal: float) -> bool:
        """Whether `ideal` is within the band around tau: around the ideals that round up to
        tau, (tau - 1, tau], so that at a small tau rounding up does not use up the band."""
        return (self._tau - 1) / BAND < ideal <= self._tau * BAND

    def _ideal(self, rows: Sequence[Round]) -> float:
        return min(max(self.ideal(*medians(rows)), float(self.low)), float(self.high))

    def next_tau(self) -> int:
        """The tau to run the next round with."""
        return self._tau

    def decision(self) -> dict[str, Any] | None:
        """Why the next round's tau, where the last `observe` chose it (None where it kept the
        tau it had): {"tau": the new tau, "was": the one before, "step_s": C, "exchange_s": S,
        "share": the exchange's predicted share of a round at the new tau}."""
        return dict(self._decision) if self._decision is not None else None

    def ideal(self, step_s: float, exchange_s: float) -> float:
        """The smallest tau (not rounded up, not clamped) whose predicted share is at most
        `share`: 0 where the exchange costs nothing, inf where a step does."""
        if exchange_s <= 0:
            return 0.0
        if step_s <= 0:
            return math.inf
        return exchange_s * (1 - self.share) / (self.share * step_s)

    def retarget(self, share: float, high: int) -> None:
        """A new goal and bound for the rounds to come (a resume that changed them): the tau
        held so far is brought within the bound at once, and the next estimates choose for
        the new goal."""
        _check_share(share)
        _check_high(high, self.low)
        self.share, self.high = float(share), high
        self.first = min(self.first, high)
        self._tau = min(self._tau, high)
        self._decision = None  # the last choice's, made for the old goal and bound

    # ---- resume -------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Everything the next choices depend on, as plain JSON values."""
        return {
            "version": STATE_VERSION,
            "share": self.share,
            "first": self.first,
            "low": self.low,
            "high": self.high,
            "tau": self._tau,
            "seen": self._seen,
            "regime": [list(r) for r in self._regime],
            "chosen": self._chosen,
            "decision": self.decision(),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> TauChooser:
        """The chooser that wrote `state`, to go on where it stopped (its settings included: a
        resumed run keeps the goal its tau was chosen for)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"state has version {state.get('version')!r}; this chooser reads {STATE_VERSION}"
            )
        chooser = cls(state["share"], state["first"], state["low"], state["high"])
        tau = state["tau"]
        if not _is_int(tau) or not chooser.low <= tau <= chooser.high:
            raise ValueError(f"state's tau must be a whole number from low to high (got {tau!r})")
        chooser._tau = tau
        chooser._seen = int(state["seen"])
        chooser._regime = [(float(c), float(s)) for c, s in state["regime"]][-REGIME:]
        chooser._chosen = bool(state["chosen"])
        decision = state.get("decision")
        chooser._decision = dict(decision) if decision is not None else None
        return chooser


def chooser_of(cfg: TrainConfig, state: dict[str, Any] | None) -> TauChooser | None:
    """A run's chooser: None for a fixed tau; under tau auto the one a checkpoint left (`state`),
    else a new one that starts at the probe."""
    if cfg.tau != "auto":
        return None
    if state is None:
        return TauChooser(share=cfg.tau_share, first=cfg.first_tau, high=cfg.tau_max)
    chooser = TauChooser.from_state(state)
    chooser.retarget(cfg.tau_share, cfg.tau_max)  # a resume that changed them: allow_change
    return chooser


def next_tau(cfg: TrainConfig, state: dict[str, Any] | None) -> int:
    """The steps of the round after the checkpoint that left `state` (a run's first round too)."""
    chooser = chooser_of(cfg, state)
    return cfg.first_tau if chooser is None else chooser.next_tau()


def after_round(chooser: TauChooser | None, tau: int, row: dict[str, Any]) -> int:
    """A finished round of `tau` steps, told to the chooser from its metrics row, which then
    names its tau and the choice made after it; returns the next round's tau. Its exchange is
    what the round cost besides its steps (`seconds.total` less `compute`): under overlap only
    what compute did not hide, as the model wants it (the part that does not grow with tau)."""
    if chooser is None:
        return tau
    seconds = row["seconds"]
    chooser.observe(tau, seconds["compute"], max(0.0, seconds["total"] - seconds["compute"]))
    row["tau"] = tau
    if (decision := chooser.decision()) is not None:
        row["tau_choice"] = decision
    return chooser.next_tau()


def medians(rows: Sequence[Round]) -> Round:
    """(C, S): the medians of the rounds' step and exchange seconds, each on its own."""
    return statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)


def predicted_share(tau: int, step_s: float, exchange_s: float) -> float:
    """The exchange's share of a round of tau steps, by the paper's model: S / (tau*C + S)."""
    total = tau * step_s + exchange_s
    return exchange_s / total if total > 0 else 0.0


def _check_share(share: Any) -> None:
    if not _is_number(share) or not 0 < share < 1:
        raise ValueError(f"share must be a number between 0 and 1, both left out (got {share!r})")


def _check_high(high: Any, low: int) -> None:
    if not _is_int(high) or high < low:
        raise ValueError(f"high must be a whole number of at least low={low} (got {high!r})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)
