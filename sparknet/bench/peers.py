"""`sparknet bench peers`: sparknet against the alternatives a Spark user already has.

Measured on fast and slow links.

SparkNet's claim (Moritz et al., ICLR 2016) is that local SGD tolerates slow networks: a round
costs one exchange whatever tau is. The alternative inside pyspark is `TorchDistributor`: DDP,
one all-reduce of the gradients per step. This benchmark runs both, and plain PyTorch in one
process as the K=1 reference, with the same model, data, K, batch, threads, inner optimizer and
seed, for the same seconds of training, on each link setting in turn (`peers_run` has the runs).

Links are emulated for real (`links`): a network namespace per Spark worker and one for the
driver and master, joined by veth pairs to a bridge, every veth end shaped with `tc` (netem
delay, tbf rate), a standalone master and one worker per namespace; the lab is removed at the
end, on error and on Ctrl-C. Where namespaces cannot be made (not root, no `ip netns`), it says
so in one line and measures unshaped only, on loopback, with `local-cluster` executors.

Reported per link, dataset and contender: samples/s, bytes on the wire per sample (the links'
counters), seconds of training to the dataset's target accuracy, the accuracy at the end of the
budget, the share of the training time spent waiting on the network and the rate the exchange
moved bytes at against the link's (`WAIT_NOTE`); per link and dataset, sparknet's best against
TorchDistributor and the issue's goal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparknet.bench.common import BenchReport, pyplot, save_figure
from sparknet.bench.convergence import PEERS_DATASETS, RECIPES
from sparknet.bench.links import (
    Link,
    NetLab,
    die_with_parent,
    parse_links,
    why_no_delay,
    why_no_namespaces,
)
from sparknet.bench.peers_run import (
    COMPRESS,
    EVAL_S,
    KINDS,
    Contender,
    PeersSpec,
    Settings,
    Variant,
)
from sparknet.errors import SparknetError

Status = Callable[[str], None]
#: the names `--data` takes: `bench convergence`'s, and a model that the links bind
DATASETS = PEERS_DATASETS
__all__ = ["DATASETS", "KINDS", "Plan", "Variant", "contenders_of", "run", "taus_of", "variants_of"]

COLUMNS = [
    "link", "dataset", "contender", "samples_per_s", "wire_bytes_per_sample", "target",
    "seconds_to_target", "accuracy_at_budget", "setup_s", "wait_share", "wire_rate_share",
]  # fmt: skip

#: how `wait_share` and `wire_rate_share` are measured, a note of every report
WAIT_NOTE = (
    "wait_share: the share of a contender's seconds of training spent waiting on the network: "
    "sparknet allreduce, the rows' seconds.exchange (under overlap only what compute did not "
    "hide); spark, seconds.broadcast + aggregate (the round's first batch read included); "
    "TorchDistributor, DDP's own runtime "
    "statistics of rank 0, per step the all-reduce's end less the backward's compute end (the "
    "all-reduce time the backward did not hide; a rank slower to compute counts there too); "
    "plain PyTorch, 0. wire_rate_share: the bytes the links carried, per worker, a second of "
    "the exchange's time on the link, over the link's rate (1.0: a link kept full): sparknet's "
    "from round 2 on (round 1 carries the start), in its wait, under overlap in its whole "
    "training time (spark's evaluations send the weights out too: more bytes than its "
    "exchange's); DDP's over the run, in its all-reduces from the first bucket's launch to "
    "the last one's end"
)

#: the issue's goals: sparknet's best seconds to the target over TorchDistributor's, by rate
#: (None: unshaped); rates without a goal are reported without one
GOALS: dict[int | None, float] = {None: 1.0, 10**9: 0.5, 10**8: 0.2}
#: how long one link's runs may take beyond their budgets: each run's own start (a warm-up
#: round, TorchDistributor's ~25 s of torchrun) and evaluations, and the link's Spark start
RUN_SLACK_S, SLACK_S = 120.0, 600.0


@dataclass(frozen=True)
class Plan(Settings):
    """What to run, as asked: the settings, on each of `links`, the files into `out`."""

    links: list[Link]
    out: Path


def contenders_of(
    kinds: Sequence[str],
    taus: Sequence[int | str],
    outers: Sequence[str],
    variants: Sequence[Variant] = (Variant(),),
) -> list[Contender]:
    """Every contender asked for: `allreduce` at each tau, outer optimizer and variant (its
    slow-link settings), `spark` at each tau with plain averaging (its outer optimizers and
    slow-link settings are `allreduce`'s), the others once."""
    out: list[Contender] = []
    for kind in kinds:
        if kind == "allreduce":
            out += [
                Contender(kind, t, o, v.compress, v.overlap, v.fragments)
                for t in taus
                for o in outers
                for v in variants
            ]
        elif kind == "spark":
            out += [Contender(kind, t, "average") for t in taus]
        else:
            out.append(Contender(kind))
    return out


def taus_of(text: str) -> list[int | str]:
    """`--tau`'s values: whole numbers >= 1 or `auto` (sparknet chooses as the run goes),
    comma-separated, each once."""
    values: list[int | str] = []
    for term in (t.strip() for t in text.split(",")):
        if term == "auto":
            values.append(term)
        elif term.isdigit() and int(term) >= 1:
            values.append(int(term))
        else:
            raise SparknetError(
                f"--tau takes whole numbers >= 1 or auto, comma-separated, got {text!r}"
            )
    _once(values, "--tau")
    return values


def variants_of(text: str) -> list[Variant]:
    """`--variants`' values: each `none` or +-joined slow-link settings of the allreduce
    transport (`Variant.parse`), comma-separated, each once."""
    found = []
    for term in text.split(","):
        try:
            found.append(Variant.parse(term))
        except ValueError as exc:
            raise SparknetError(
                f"--variants takes none or +-joined {', '.join(COMPRESS)}, overlap, fragN, "
                f"comma-separated (e.g. none,int8,int8+overlap+frag4), got {text!r}: {exc}"
            ) from None
    _once([v.name for v in found], "--variants")
    return found


def _once(values: Sequence[Any], what: str) -> None:
    twice = list(dict.fromkeys(str(v) for v in values if list(values).count(v) > 1))
    if twice:
        raise SparknetError(f"{what} lists {', '.join(twice)} more than once")


def run(plan: Plan, on_status: Status = lambda _t: None) -> BenchReport:
    """Every link in turn, each in a lab of its own; writes `peers.json`, `peers.csv` and a
    plot per dataset into `plan.out`."""
    notes: list[str] = []
    links = plan.links
    why = why_no_namespaces()
    if why is not None:
        notes.append(f"network namespaces cannot be made here ({why}): unshaped only, loopback")
        on_status(notes[-1])
        links = [Link(None, 0.0)]
    elif any(lk.delay_ms for lk in links) and (no_delay := why_no_delay()) is not None:
        links = list({lk.name: lk for lk in (Link(lk.rate_bit, 0.0) for lk in links)}.values())
        notes.append(
            f"delays cannot be emulated here ({no_delay}): every link runs at its rate with "
            f"0 ms ({', '.join(lk.name for lk in links)})"
        )
        on_status(notes[-1])
    notes.append(WAIT_NOTE)
    if plan.workers * plan.threads > (os.cpu_count() or 1):
        notes.append(
            f"K={plan.workers} ranks of {plan.threads} threads share {os.cpu_count()} cores: "
            "every contender but plain PyTorch is slowed by that"
        )
    outcomes: list[dict[str, Any]] = []
    with _only_run(plan.out):
        for i, link in enumerate(links, 1):
            on_status(f"link {i}/{len(links)}: {link.name}")
            try:
                outcomes += _one_link(plan, link, why is None, on_status)
            except SparknetError as exc:  # the other links' figures still count
                if len(links) == 1:
                    raise
                notes.append(f"{link.name}: not measured: {exc}")
                on_status(f"  {notes[-1]}")
        if not outcomes:
            raise SparknetError(f"no link was measured: {'; '.join(notes[-len(links) :])}")
    rows = table(outcomes, plan)
    notes += goal_notes(rows, links, plan)
    notes += [
        f"{r['link']}, {r['dataset']}: {r['contender']} ended at tau={r['tau_last']:g}"
        for r in rows
        if r.get("tau_last") is not None
    ]
    report = BenchReport(
        name="peers",
        title=f"sparknet, TorchDistributor and plain PyTorch, K={plan.workers}, "
        f"{plan.budget_s:g} s of training each",
        columns=COLUMNS,
        rows=rows,
        notes=notes,
        extra={"plan": _plan_doc(plan), "runs": outcomes},
    )
    report.write(plan.out)
    for dataset in plan.datasets:
        report.files.append(plot(outcomes, dataset, links, plan.out / f"peers-{dataset}.png"))
    return report


@contextlib.contextmanager
def _only_run(out: Path) -> Iterator[None]:
    """This run alone writes into `out`: two would share their runs' specs and results."""
    with (out / ".peers.lock").open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SparknetError(
                f"another `sparknet bench peers` writes into {out}: wait for it, or pass "
                "another --out"
            ) from None
        yield


def _plan_doc(plan: Plan) -> dict[str, Any]:
    return {
        "datasets": plan.datasets, "links": [lk.name for lk in plan.links],
        "contenders": [c.label for c in plan.contenders], "workers": plan.workers,
        "threads": plan.threads, "batch_size": plan.batch_size, "budget_s": plan.budget_s,
        "reps": plan.reps, "seed": plan.seed,
        "targets": {d: RECIPES[d].target for d in plan.datasets},
        "recipes": {d: dataclasses.asdict(RECIPES[d]) for d in plan.datasets},
        "eval_s": EVAL_S,
    }  # fmt: skip


def _one_link(plan: Plan, link: Link, lab: bool, on_status: Status) -> list[dict[str, Any]]:
    """One link's runs, in a child process: inside a fresh lab's first namespace (driver and
    master there, a worker in each other), or on loopback without namespaces."""
    work = plan.out / "runs" / link.name
    work.mkdir(parents=True, exist_ok=True)
    results = work / "results.jsonl"
    results.unlink(missing_ok=True)
    spec_path = work / "spec.json"
    log = work / "driver.log"
    common = dict(link=link.name, runs_dir=str(work), **plan.settings())
    argv = [sys.executable, "-m", "sparknet.bench.peers_run", str(spec_path), str(results)]
    if not lab:
        master = f"local-cluster[{plan.workers},{plan.threads},2048]"
        PeersSpec(master=master, counters=None, **common).dump(spec_path)
        with log.open("w") as out:
            child = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )  # fmt: skip  (its own session: Ctrl-C reaches this process only, which ends it)
        try:
            _follow(child, results, log, plan, on_status)
        finally:
            _end_group(child)
        return _read(results)
    with NetLab(plan.workers + 1, link) as net:
        on_status(f"  lab up ({net.nodes[0].address}/24): starting Spark's master and workers")
        driver, workers = net.nodes[0], net.nodes[1:]
        master = net.standalone(workers, driver, cores=plan.threads)
        counters = (net.root_pid, [n.host_veth for n in net.nodes])
        PeersSpec(master=master, counters=counters, **common).dump(spec_path)
        with log.open("w") as out:
            child = net.popen(driver, argv, stdout=out, stderr=subprocess.STDOUT)
        _follow(child, results, log, plan, on_status)
    return _read(results)


def _follow(
    child: subprocess.Popen, results: Path, log: Path, plan: Plan, on_status: Status
) -> None:
    """Wait for the child, saying each run's outcome as its line lands; a failed child is one
    error line with the last line of its log."""
    runs = len(plan.datasets) * plan.reps * len(plan.contenders)
    deadline = time.monotonic() + runs * (plan.budget_s * 2 + RUN_SLACK_S) + SLACK_S
    said = 0
    while True:
        code = child.poll()
        done = _read(results)
        for o in done[said:]:
            on_status(f"  {o['dataset']}: {o['contender']}: {_summary(o, plan)}")
        said = len(done)
        if code is not None:
            break
        if time.monotonic() > deadline:
            raise SparknetError(f"the benchmark's driver ran past its time; see {log}")
        time.sleep(0.5)
    if code != 0:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        last = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "")
        raise SparknetError(
            f"the benchmark's driver failed (exit {code}): {last.strip()}; see {log}"
        )


def _end_group(child: subprocess.Popen) -> None:
    if child.poll() is None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(child.pid, sig)
                child.wait(timeout=10)
                return
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue


def _read(results: Path) -> list[dict[str, Any]]:
    if not results.exists():
        return []
    return [json.loads(ln) for ln in results.read_text().splitlines() if ln.endswith("}")]


def _summary(o: dict[str, Any], plan: Plan) -> str:
    to = seconds_to(o["curve"], RECIPES[o["dataset"]].target)
    reached = f"target in {to:.1f} s" if to is not None else "target not reached"
    return f"{o['samples'] / max(o['train_s'], 1e-9):.0f} samples/s, {reached}"


# ---- figures -----------------------------------------------------------------------------------


def seconds_to(curve: Sequence[Sequence[float]], target: float) -> float | None:
    """Training seconds at the first evaluation at or above `target`; None if none was."""
    return next((float(t) for t, _n, acc in curve if acc >= target), None)


def accuracy_at(curve: Sequence[Sequence[float]], budget_s: float) -> float | None:
    """Test accuracy at the last evaluation within `budget_s` seconds of training."""
    within = [acc for t, _n, acc in curve if t <= budget_s and not math.isnan(acc)]
    return within[-1] if within else None


def _median(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if len(got) == len(values) and got else None


def table(outcomes: list[dict[str, Any]], plan: Plan) -> list[dict[str, Any]]:
    """A row per link, dataset and contender: medians over the repetitions (seconds to the
    target only when every repetition reached it; the wait and rate shares over those that
    measured them)."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for o in outcomes:
        groups.setdefault((o["link"], o["dataset"], o["contender"]), []).append(o)
    rows = []
    for (link, dataset, contender), runs in groups.items():
        target = RECIPES[dataset].target
        rows.append({
            "link": link, "dataset": dataset, "contender": contender, "kind": runs[0]["kind"],
            "samples_per_s": _median([o["samples"] / o["train_s"] for o in runs]),
            "wire_bytes_per_sample": _median([o["wire_bytes"] / o["samples"] for o in runs]),
            "target": target,
            "seconds_to_target": _median([seconds_to(o["curve"], target) for o in runs]),
            "accuracy_at_budget": _median([accuracy_at(o["curve"], plan.budget_s) for o in runs]),
            "setup_s": _median([o["setup_s"] for o in runs]),
            "wait_share": _median_of([wait_share(o) for o in runs]),
            "wire_rate_share": _median_of([wire_rate_share(o, plan.workers) for o in runs]),
            "tau_last": _median_of([o.get("tau_last") for o in runs]),
            "busy_what": runs[0].get("busy_what", "exchange"),
        })  # fmt: skip
    return rows


def wait_share(run: dict[str, Any]) -> float | None:
    """The share of a run's seconds of training spent waiting on the network (`WAIT_NOTE`)."""
    wait = run.get("wait_s")
    return wait / run["train_s"] if wait is not None and run["train_s"] > 0 else None


def wire_rate_share(run: dict[str, Any], workers: int) -> float | None:
    """The bytes a worker put on its link a second of the exchange's time there, over the
    link's rate (`WAIT_NOTE`); None unshaped, for plain PyTorch, or without that time."""
    rate = _rate_of(run["link"])
    busy = run.get("busy_s")
    if rate is None or not busy or run["kind"] == "plain":
        return None
    carried = run.get("busy_bytes")
    return (run["wire_bytes"] if carried is None else carried) / workers * 8 / busy / rate


def _rate_of(link: str) -> int | None:
    """The rate of a link by its name (`Link.name`, which `parse_links` reads back)."""
    return parse_links(link)[0].rate_bit


def _median_of(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def goal_notes(rows: list[dict[str, Any]], links: list[Link], plan: Plan) -> list[str]:
    """Per link and dataset: sparknet's best seconds to the target over TorchDistributor's,
    against the goal for that rate, where each one's time went (waiting on the network, the
    link's use), and more of that when the goal is missed."""
    notes = []
    rate_of = {lk.name: lk.rate_bit for lk in links}
    for link in dict.fromkeys(r["link"] for r in rows):
        for dataset in plan.datasets:
            here = [r for r in rows if r["link"] == link and r["dataset"] == dataset]
            ours = [r for r in here if r["kind"] in ("allreduce", "spark")]
            theirs = next((r for r in here if r["kind"] == "distributor"), None)
            if not ours or theirs is None:
                continue
            reached = [r for r in ours if r["seconds_to_target"] is not None]
            best = min(reached, key=lambda r: r["seconds_to_target"]) if reached else None
            goal = GOALS.get(rate_of.get(link))
            head = f"{link}, {dataset}:"
            if best is None:
                notes.append(
                    f"{head} no sparknet setting reached the target in {plan.budget_s:g} s; "
                    f"no ratio{_network(ours, theirs)}"
                )
                continue
            ours_text = (
                f"{head} sparknet's best ({best['contender']}) {best['seconds_to_target']:.1f} s"
                f" to {best['target']:g}"
            )
            if theirs["seconds_to_target"] is None:  # theirs > budget: the ratio is a bound
                bound = best["seconds_to_target"] / plan.budget_s
                line = (
                    f"{ours_text}; TorchDistributor did not reach it in {plan.budget_s:g} s: "
                    f"< {bound:.2f}x"
                )
                if goal is not None:
                    line += f", goal <= {goal:g}x {'met' if bound <= goal else 'not decided'}"
                notes.append(line + _network([best], theirs))
                continue
            ratio = best["seconds_to_target"] / theirs["seconds_to_target"]
            line = (
                f"{ours_text} against TorchDistributor's {theirs['seconds_to_target']:.1f} s: "
                f"{ratio:.2f}x"
            )
            if goal is not None:
                met = ratio <= goal
                line += f", goal <= {goal:g}x {'met' if met else f'missed by {ratio / goal:.2f}x'}"
                if not met:
                    line += _where_time_goes(best, theirs, here, plan)
            notes.append(line + _network([best], theirs))
    return notes


def _network(ours: list[dict[str, Any]], theirs: dict[str, Any]) -> str:
    """`; network wait: ...` for sparknet's rows `ours` (the best one, or all when none reached
    the target) and TorchDistributor's, each with the link's use where the link is shaped."""

    def said(r: dict[str, Any], name: str) -> str | None:
        if r.get("wait_share") is None:
            return None
        use = r.get("wire_rate_share")
        link = ""
        if use is not None and r.get("busy_what") == "training":  # overlap: a lower bound
            link = f" (the link at {use:.0%} of its rate over training)"
        elif use is not None:
            link = f" (exchange at {use:.0%} of the link's rate)"
        return f"{name} {r['wait_share']:.0%}{link}"

    parts = [said(r, r["contender"] if len(ours) > 1 else "sparknet") for r in ours]
    parts.append(said(theirs, "TorchDistributor"))
    known = [p for p in parts if p is not None]
    return f"; network wait: {', '.join(known)} of training" if known else ""


def _where_time_goes(
    best: dict[str, Any], theirs: dict[str, Any], here: list[dict[str, Any]], plan: Plan
) -> str:
    plain = next((r for r in here if r["kind"] == "plain"), None)
    parts = [
        f"sparknet {best['samples_per_s']:.0f} samples/s against {theirs['samples_per_s']:.0f}"
    ]
    if plain is not None and plain["samples_per_s"]:
        ideal = plan.workers * plain["samples_per_s"]
        parts.append(
            f"TorchDistributor at {theirs['samples_per_s'] / ideal:.0%} of K x plain's rate"
        )
    return " (" + "; ".join(parts) + ")"


def plot(outcomes: list[dict[str, Any]], dataset: str, links: list[Link], path: Path) -> Path:
    """Test accuracy against seconds of training, a panel per link, a line per contender (the
    first repetition), the target as a dotted line."""
    plt = pyplot()
    names = [lk.name for lk in links]
    cols = min(4, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False, sharey=True
    )
    labels = list(dict.fromkeys(o["contender"] for o in outcomes))
    colors = {label: plt.get_cmap("tab20")(i % 20) for i, label in enumerate(labels)}
    for ax, name in zip(axes.flat, names, strict=False):
        for o in outcomes:
            if o["link"] == name and o["dataset"] == dataset and o["rep"] == 0 and o["curve"]:
                t, _n, acc = zip(*o["curve"], strict=True)
                style = "-" if o["kind"] in ("allreduce", "spark") else "--"
                ax.plot(t, acc, style, label=o["contender"], color=colors[o["contender"]], lw=1.2)
        ax.axhline(RECIPES[dataset].target, color="grey", linestyle=":", linewidth=1)
        ax.set_title(name)
        ax.set_xlabel("seconds of training")
        ax.set_ylim(0, 1)
    for ax in axes.flat[len(names) :]:
        ax.set_visible(False)
    axes[0][0].set_ylabel(f"test accuracy ({dataset})")
    handles, names_shown = axes.flat[0].get_legend_handles_labels()
    fig.tight_layout()
    fig.legend(handles, names_shown, loc="upper center", ncol=3, fontsize=8,
               bbox_to_anchor=(0.5, 0.0))  # fmt: skip
    return save_figure(fig, path)  # its bbox_inches="tight" takes the legend in
