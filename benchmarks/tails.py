"""`python -m benchmarks.tails`: two ways of running the stiff tail side by side, flow by flow.

For each d = 8 point of the `scale` benchmark's 112-flow sweep named on the command line
(depth, α, seed), it runs `gflow.flow` at the sweep's options once each way, one after the
other in this process: `--vary tail` (default) the two stiff tails throughout,
`tail_method="rosenbrock"` and `"radau"`; `--vary handover` the Rosenbrock tail throughout
against the default, `"auto"` (Radau IIA from where the Rosenbrock tail still runs after
`radau_after` steps); `--vary gradient` the tail's gradient in float64
(`compensated_gradient=False`) and compensated where rounding matters (`"auto"`, the default).
It prints a row per run: status, solve time, the stiff tail's steps and rejections (both of
its stages with `auto`), its linear work (CG or Newton iterations, factorisations) and the
top three singular values,
then how far apart the two runs' singular values end where both converged. The sweep itself
runs its tails concurrently; here each flow has the machine to itself, so that the times
compare.

    python -m benchmarks.tails 4:1e-2:2 4:1e-4:2 5:3e-3:2 --max-steps 100000
    python -m benchmarks.tails 5:1e-4:1 5:3e-4:0 4:1e-3:0 --vary gradient
    python -m benchmarks.tails 5:1e-2:0 5:1e-3:2 4:1e-2:2 --vary handover
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

jax.config.update("jax_enable_x64", True)

import gflow  # noqa: E402

from .runoff import SWEEP_MAX_STEPS, SWEEP_RTOL, sweep_point  # noqa: E402

WAYS = {
    "tail": {"rosenbrock": {"tail_method": "rosenbrock"}, "radau": {"tail_method": "radau"}},
    "handover": {"rosenbrock": {"tail_method": "rosenbrock"}, "auto": {"tail_method": "auto"}},
    "gradient": {
        "float64": {"compensated_gradient": False},
        "compensated": {"compensated_gradient": "auto"},
    },
}


def parse_point(text):
    depth, alpha, seed = text.split(":")
    return int(depth), float(alpha), int(seed)


def run(point, way, rtol, max_steps):
    problem, init = sweep_point(*point)
    options = gflow.FlowOptions(rtol=rtol, max_steps=max_steps, **way)
    result = gflow.flow(problem, init, options)
    stages = [result.work().get(phase, {}) for phase in ("stiff tail", "radau tail")]
    tail = {k: sum(stage.get(k, 0) for stage in stages) for k in set().union(*stages)}
    sigma = np.asarray(gflow.singular_values(result.model))[:3]
    return result, tail, sigma


def compare(points, rtol=SWEEP_RTOL, max_steps=SWEEP_MAX_STEPS, vary="tail"):
    """For each point, one row per way of `vary` (a dict: point, method (the way's name),
    result, tail work, top-3 σ), then, where both converged, the relative difference of their
    top-3 σ (`apart`, on the second row)."""
    for point in points:
        rows = []
        for method, way in WAYS[vary].items():
            result, tail, sigma = run(point, way, rtol, max_steps)
            rows.append(dict(point=point, method=method, result=result, tail=tail, sigma=sigma))
        if all(row["result"].status_label == "converged" for row in rows):
            rows[-1]["apart"] = np.abs(rows[1]["sigma"] / rows[0]["sigma"] - 1)
        yield from rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "points", nargs="+", type=parse_point, help="sweep points DEPTH:ALPHA:SEED, e.g. 4:1e-2:2"
    )
    parser.add_argument("--rtol", type=float, default=SWEEP_RTOL, help="the sweep's rtol")
    parser.add_argument(
        "--max-steps", type=int, default=SWEEP_MAX_STEPS, help="the sweep's step budget per phase"
    )
    parser.add_argument(
        "--vary", choices=sorted(WAYS), default="tail", help="what differs between the runs"
    )
    args = parser.parse_args(argv)
    ways = WAYS[args.vary]

    # compile both ways' programs outside the clock, on a flow that reaches its tail quickly
    for way in ways.values():
        run((3, 1e-2, 1), way, args.rtol, args.max_steps)

    print(
        f"{'point':>16} {'way':>11} {'status':>10} {'solve s':>8} {'tail steps':>10} "
        f"{'rejected':>8} {'lin. iters':>10} {'factoriz.':>9}  top-3 σ",
        flush=True,
    )
    for row in compare(args.points, args.rtol, args.max_steps, args.vary):
        result, tail = row["result"], row["tail"]
        print(
            f"{str(row['point']):>16} {row['method']:>11} {result.status_label:>10} "
            f"{result.wall_time_s:8.1f} {tail.get('steps', 0):10d} "
            f"{tail.get('rejected_steps', 0):8d} {tail.get('linear_iters', 0):10d} "
            f"{tail.get('factorizations', 0):9d}  "
            f"{np.array2string(row['sigma'], precision=12)}",
            flush=True,
        )
        if "apart" in row:
            second, first = list(ways)[::-1]
            print(f"{'':>16} σ relative difference ({second} vs {first}): {row['apart']}")


if __name__ == "__main__":
    main()
