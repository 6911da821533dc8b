"""`python -m benchmarks.handover`: where the Radau handover pays, by problem.

`tail_method="auto"` (the default) hands a Rosenbrock tail still running after `radau_after`
steps over to Radau IIA. A Radau step forms G⊥G⊥ᵀ for its 3|Ω| × 3|Ω| Newton system,
(3·|Ω|)²·P work (`_solve.radau_work`), which the Rosenbrock tail's Gram preconditioner does
not pay; `_solve.RADAU_MAX_WORK` can bound it (none by default). This probe measures the
choice side by side, in one process, each way compiled before its first timed solve and the
ways alternated in `--repeats` rounds:

- `auto`: gflow's default as it stands;
- `limited`: `auto` with the work bounded by `--limit` (the Rosenbrock tail throughout
  where the problem's work is past it);
- `rosenbrock` and `radau`: one method throughout (`--ways` picks).

Cases: `d:depth:α`, `gflow.bernoulli(d, d, 0.3, 5)` from `gflow.gaussian((d,) * (depth + 1),
α)` (the `scale` problem's family), or `sweep:d:depth:α:seed`, a point of the 112-flow
sweep's family (density 0.5, rank 2) at dimension d. Per case and way: status, solve
seconds, tail steps by method and how far the top-3 σ end from the first way's (the largest
difference, relative to σ₁: a σ that decays to zero has no relative digits); then each way's
solve time over the first way's.

    python -m benchmarks.handover 16:4:1e-2 sweep:12:4:1e-3:3 --ways auto limited --repeats 1
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses

import jax
import numpy as np

jax.config.update("jax_enable_x64", True)

import gflow  # noqa: E402
from gflow.engine import _solve  # noqa: E402
from gflow.engine._flow import RADAU_MULTIPLE, observed_bound, stages_of_tail  # noqa: E402

from .runoff import SWEEP_MAX_STEPS, SWEEP_RTOL, sweep_point  # noqa: E402

WAYS = ("auto", "limited", "rosenbrock", "radau")


@contextlib.contextmanager
def way_options(way, base: gflow.FlowOptions, limit=1e7):
    """Within the block, `base` for `way` (one of `WAYS`); `limited` bounds the Radau step's
    work (`_solve.RADAU_MAX_WORK`) by `limit` while the block runs."""
    if way != "limited":
        yield dataclasses.replace(base, tail_method=way)
        return
    before = _solve.RADAU_MAX_WORK
    _solve.RADAU_MAX_WORK = limit
    try:
        yield dataclasses.replace(base, tail_method="auto")
    finally:
        _solve.RADAU_MAX_WORK = before


def case(text):
    """(problem, init, options) of a case `d:depth:α` or `sweep:d:depth:α:seed`."""
    if text.startswith("sweep:"):
        d, depth, alpha, seed = text.split(":")[1:]
        problem, init = sweep_point(int(depth), float(alpha), int(seed), dim=int(d))
        return problem, init, gflow.FlowOptions(rtol=SWEEP_RTOL, max_steps=SWEEP_MAX_STEPS)
    d, depth, alpha = text.split(":")
    d, depth = int(d), int(depth)
    problem = gflow.bernoulli(d, d, 0.3, 5, key=jax.random.key(0))
    init = gflow.gaussian((d,) * (depth + 1), float(alpha), key=jax.random.key(1))
    return problem, init, gflow.FlowOptions()


def work_of(problem, init, options):
    """(rows a Radau stage takes, (3·rows)²·P, whether `options` hand over)."""
    rows = observed_bound(problem, RADAU_MULTIPLE)
    size = sum(int(np.prod(w.shape)) for w in init.layers)
    hands_over = len(stages_of_tail(problem, init, options)) > 1
    return rows, _solve.radau_work(rows, size), hands_over


def tail_steps(result):
    work = result.work()
    return {k: work[k]["steps"] for k in ("stiff tail", "radau tail") if k in work}


def solves(cases, ways=WAYS, repeats=1, limit=1e7):
    """Rows (case, way, round, result, top-3 σ), the ways alternated within each round; each
    way's program is compiled (and run once) before its first timed solve."""
    for name in cases:
        problem, init, base = case(name)
        for way in ways:
            with way_options(way, base, limit) as options:
                gflow.flow(problem, init, options)
        for k in range(repeats):
            for way in ways:
                with way_options(way, base, limit) as options:
                    result = gflow.flow(problem, init, options)
                sigma = np.asarray(gflow.singular_values(result.model))[:3]
                yield dict(case=name, way=way, round=k, result=result, sigma=sigma)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", default=["16:4:1e-2", "sweep:12:4:1e-3:3"])
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--limit", type=float, default=1e7, help="the `limited` way's bound")
    parser.add_argument("--repeats", type=int, default=2, help="alternated rounds per case")
    args = parser.parse_args(argv)

    for name in args.cases:
        problem, init, base = case(name)
        rows, work, _ = work_of(problem, init, base)
        verdicts = []
        for way in ("auto", "limited"):
            with way_options(way, base, args.limit) as options:
                verdicts.append(
                    f"{way} {'hands over' if work_of(problem, init, options)[2] else 'does not'}"
                )
        print(f"{name}: {rows} rows a Radau stage, (3|Ω|)²·P = {work:.2e}: {', '.join(verdicts)}")
    print(f"{'case':>10} {'way':>10} {'round':>5} {'status':>10} {'solve s':>8}  tail steps")
    first, times = {}, {}
    for row in solves(args.cases, args.ways, args.repeats, args.limit):
        result, name = row["result"], row["case"]
        first.setdefault(name, row["sigma"])
        times.setdefault(name, {}).setdefault(row["way"], []).append(result.wall_time_s)
        off = np.max(np.abs(row["sigma"] - first[name])) / first[name][0]
        print(
            f"{name:>10} {row['way']:>10} {row['round']:5d} {result.status_label:>10} "
            f"{result.wall_time_s:8.2f}  {tail_steps(result)}  "
            f"top-3 σ off the first way's: {off:.1e} of σ₁",
            flush=True,
        )
    for name, by_way in times.items():
        base = sum(by_way[args.ways[0]])
        ratios = ", ".join(f"{way} {sum(t) / base:.2f}" for way, t in by_way.items())
        print(f"{name:>10}: solve / {args.ways[0]}'s: {ratios}")


if __name__ == "__main__":
    main()
