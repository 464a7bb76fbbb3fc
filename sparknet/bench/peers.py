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
budget; per link and dataset, sparknet's best against TorchDistributor and the issue's goal.
"""

from __future__ import annotations

import contextlib
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
from sparknet.bench.convergence import DATASETS, RECIPES
from sparknet.bench.links import Link, NetLab, die_with_parent, why_no_delay, why_no_namespaces
from sparknet.bench.peers_run import KINDS, Contender, PeersSpec, Settings
from sparknet.errors import SparknetError

Status = Callable[[str], None]
__all__ = ["DATASETS", "KINDS", "Plan", "contenders_of", "run"]

COLUMNS = [
    "link", "dataset", "contender", "samples_per_s", "wire_bytes_per_sample", "target",
    "seconds_to_target", "accuracy_at_budget", "setup_s", "exchange_share",
]  # fmt: skip

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


def contenders_of(kinds: Sequence[str], taus: Sequence[int], outers: Sequence[str]) -> list:
    """Every contender asked for: `allreduce` at each tau and outer optimizer, `spark` at each
    tau with plain averaging (its outer optimizers are `allreduce`'s), the others once."""
    out: list[Contender] = []
    for kind in kinds:
        if kind == "allreduce":
            out += [Contender(kind, t, o) for t in taus for o in outers]
        elif kind == "spark":
            out += [Contender(kind, t, "average") for t in taus]
        else:
            out.append(Contender(kind))
    return out


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
    target only when every repetition reached it)."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for o in outcomes:
        groups.setdefault((o["link"], o["dataset"], o["contender"]), []).append(o)
    rows = []
    for (link, dataset, contender), runs in groups.items():
        target = RECIPES[dataset].target
        exchange = [o["exchange_s"] / o["train_s"] for o in runs if o.get("exchange_s") is not None]
        rows.append({
            "link": link, "dataset": dataset, "contender": contender, "kind": runs[0]["kind"],
            "samples_per_s": _median([o["samples"] / o["train_s"] for o in runs]),
            "wire_bytes_per_sample": _median([o["wire_bytes"] / o["samples"] for o in runs]),
            "target": target,
            "seconds_to_target": _median([seconds_to(o["curve"], target) for o in runs]),
            "accuracy_at_budget": _median([accuracy_at(o["curve"], plan.budget_s) for o in runs]),
            "setup_s": _median([o["setup_s"] for o in runs]),
            "exchange_share": statistics.median(exchange) if exchange else None,
        })  # fmt: skip
    return rows


def goal_notes(rows: list[dict[str, Any]], links: list[Link], plan: Plan) -> list[str]:
    """Per link and dataset: sparknet's best seconds to the target over TorchDistributor's,
    against the goal for that rate, and where the time goes when it is missed."""
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
            if best is None or theirs["seconds_to_target"] is None:
                who = "no sparknet setting" if best is None else "TorchDistributor"
                notes.append(f"{head} {who} reached the target in {plan.budget_s:g} s; no ratio")
                continue
            ratio = best["seconds_to_target"] / theirs["seconds_to_target"]
            line = (
                f"{head} sparknet's best ({best['contender']}) {best['seconds_to_target']:.1f} s"
                f" to {best['target']:g} against TorchDistributor's "
                f"{theirs['seconds_to_target']:.1f} s: {ratio:.2f}x"
            )
            if goal is not None:
                met = ratio <= goal
                line += f", goal <= {goal:g}x {'met' if met else f'missed by {ratio / goal:.2f}x'}"
                if not met:
                    line += _where_time_goes(best, theirs, here, plan)
            notes.append(line)
    return notes


def _where_time_goes(
    best: dict[str, Any], theirs: dict[str, Any], here: list[dict[str, Any]], plan: Plan
) -> str:
    plain = next((r for r in here if r["kind"] == "plain"), None)
    parts = [
        f"sparknet {best['samples_per_s']:.0f} samples/s against {theirs['samples_per_s']:.0f}"
    ]
    if best.get("exchange_share") is not None:
        parts.append(f"{best['exchange_share']:.0%} of its training time in the exchange")
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
