"""`python -m benchmarks.handover`: where the Radau handover pays, by problem size.

`tail_method="auto"` (the default) hands a Rosenbrock tail still running after `radau_after`
steps over to Radau IIA, but only where the work of a Radau step's Newton matrix,
(3·|Ω|)²·P (`_solve.radau_work`), is within `_solve.RADAU_MAX_WORK`: forming G⊥G⊥ᵀ for its
3|Ω| × 3|Ω| system is what a Radau step pays and a Rosenbrock step does not. This probe
measures that choice side by side, in one process, on `gflow.bernoulli(d, d, 0.3, 5)` from
`gflow.gaussian((d,) * (depth + 1), α)` (cases `d:depth:α`), each way compiled before its
first timed solve and the ways alternated in `--repeats` rounds:

- `auto`: gflow's default as it stands;
- `handover`: `auto` with the work limit lifted (the handover wherever a tail runs long, as
  before 2026-12-08);
- `rosenbrock` and `radau`: one method throughout (`--ways` picks).

Per case and way: status, solve seconds, tail steps by method and the top-3 σ against the
first way's; then each way's solve time over the first way's.

    python -m benchmarks.handover 12:4:1e-2 16:4:1e-2 20:4:1e-2 --repeats 2
"""

from __future__ import annotations

import argparse
import contextlib

import jax
import numpy as np

jax.config.update("jax_enable_x64", True)

import gflow  # noqa: E402
from gflow.engine import _solve  # noqa: E402
from gflow.engine._flow import RADAU_MULTIPLE, observed_bound, stages_of_tail  # noqa: E402

WAYS = ("auto", "handover", "rosenbrock", "radau")


@contextlib.contextmanager
def way_options(way):
    """Within the block, `FlowOptions` for `way` (one of `WAYS`); `handover` lifts the Radau
    step's work limit (`_solve.RADAU_MAX_WORK`) while the block runs."""
    if way != "handover":
        yield gflow.FlowOptions(tail_method=way)
        return
    before = _solve.RADAU_MAX_WORK
    _solve.RADAU_MAX_WORK = float("inf")
    try:
        yield gflow.FlowOptions(tail_method="auto")
    finally:
        _solve.RADAU_MAX_WORK = before


def case(text):
    """(problem, init) of a case `d:depth:α`."""
    d, depth, alpha = text.split(":")
    d, depth = int(d), int(depth)
    problem = gflow.bernoulli(d, d, 0.3, 5, key=jax.random.key(0))
    init = gflow.gaussian((d,) * (depth + 1), float(alpha), key=jax.random.key(1))
    return problem, init


def work_of(problem, init):
    """(rows a Radau stage takes, (3·rows)²·P, whether `auto` hands over)."""
    rows = observed_bound(problem, RADAU_MULTIPLE)
    size = sum(int(np.prod(w.shape)) for w in init.layers)
    hands_over = len(stages_of_tail(problem, init, gflow.FlowOptions())) > 1
    return rows, _solve.radau_work(rows, size), hands_over


def tail_steps(result):
    work = result.work()
    return {k: work[k]["steps"] for k in ("stiff tail", "radau tail") if k in work}


def solves(cases, ways=WAYS, repeats=1):
    """Rows (case, way, round, result, top-3 σ), the ways alternated within each round; each
    way's program is compiled (and run once) before its first timed solve."""
    for name in cases:
        problem, init = case(name)
        for way in ways:
            with way_options(way) as options:
                gflow.flow(problem, init, options)
        for k in range(repeats):
            for way in ways:
                with way_options(way) as options:
                    result = gflow.flow(problem, init, options)
                sigma = np.asarray(gflow.singular_values(result.model))[:3]
                yield dict(case=name, way=way, round=k, result=result, sigma=sigma)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", default=["12:4:1e-2", "16:4:1e-2", "20:4:1e-2"])
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--repeats", type=int, default=2, help="alternated rounds per case")
    args = parser.parse_args(argv)

    for name in args.cases:
        rows, work, hands_over = work_of(*case(name))
        verdict = "hands over" if hands_over else "keeps the Rosenbrock tail"
        print(
            f"{name}: {rows} rows a Radau stage, (3|Ω|)²·P = {work:.2e} "
            f"(limit {_solve.RADAU_MAX_WORK:.0e}): auto {verdict}"
        )
    print(f"{'case':>10} {'way':>10} {'round':>5} {'status':>10} {'solve s':>8}  tail steps")
    first, times = {}, {}
    for row in solves(args.cases, args.ways, args.repeats):
        result, name = row["result"], row["case"]
        first.setdefault(name, row["sigma"])
        times.setdefault(name, {}).setdefault(row["way"], []).append(result.wall_time_s)
        off = np.max(np.abs(row["sigma"] - first[name]) / first[name])
        print(
            f"{name:>10} {row['way']:>10} {row['round']:5d} {result.status_label:>10} "
            f"{result.wall_time_s:8.2f}  {tail_steps(result)}  top-3 σ off the first way {off:.1e}",
            flush=True,
        )
    for name, by_way in times.items():
        base = sum(by_way[args.ways[0]])
        ratios = ", ".join(f"{way} {sum(t) / base:.2f}" for way, t in by_way.items())
        print(f"{name:>10}: solve / {args.ways[0]}'s: {ratios}")


if __name__ == "__main__":
    main()
