"""`python -m benchmarks.tail_compile`: the stiff tail's program with its stages as one loop
(gflow's) and unrolled, side by side in one process.

A Rosenbrock step (`gflow.engine._rosenbrock.Rodas4.step`) runs its six or eight stages
after the first as one loop since the twenty-fourth session: the program holds the vector
field, whose compensated gradient is most of a tail program, and each linear solve once for
them, where the stages unrolled held them once a stage. This probe compiles the tail
program of d = 8 sweep points both ways (`_rosenbrock.stage_loop`, and each stage traced on
its own as before), without the persistent cache, `--rounds` rounds in alternation, and
runs each `--runs` times:

- per way: compile seconds, the best ms a tail step over the runs, the tail's steps;
- the ratios (unrolled / loop) of both, and how far apart the two ways' top-3 σ end.

The tail here is the Rosenbrock method throughout (`tail_method="rosenbrock"`), so that the
whole solve is the program compared.

    python -m benchmarks.tail_compile 5:1e-1:2 4:1e-2:0 --rounds 2 --runs 3
"""

from __future__ import annotations

import argparse
import contextlib
import time

import jax
import numpy as np

jax.config.update("jax_enable_x64", True)

import gflow  # noqa: E402
from gflow.engine import _compile, _flow, _rosenbrock  # noqa: E402

from .runoff import SWEEP_MAX_STEPS, SWEEP_RTOL, sweep_point  # noqa: E402
from .tails import parse_point  # noqa: E402

WAYS = ("loop", "unrolled")  # gflow's first


def unrolled_stages(stage, start, first, count):
    """The stage loop as the step ran it before: each stage traced on its own."""
    for i in range(first, count):
        start = stage(i, start)
    return start


@contextlib.contextmanager
def stages(way):
    """Within the block, Rosenbrock programs are traced with their stages `way`; the tail
    programs in memory are dropped on the way in and out (their key does not say which)."""
    before = _rosenbrock.stage_loop
    if way == "unrolled":
        _rosenbrock.stage_loop = unrolled_stages
    _drop_tail_programs()
    try:
        yield
    finally:
        _rosenbrock.stage_loop = before
        _drop_tail_programs()


def _drop_tail_programs():
    for key in [k for k in _compile._PROGRAMS if k[0] == "flow-tail"]:
        del _compile._PROGRAMS[key]


def compare(point, rounds=2, runs=3):
    """Rows (way, round, compile s, best ms a step, steps, top-3 σ) for the sweep point
    `point` (depth, α, seed), the two ways alternated within each round."""
    problem, init = sweep_point(*point)
    options = gflow.FlowOptions(
        rtol=SWEEP_RTOL, max_steps=SWEEP_MAX_STEPS, tail_method="rosenbrock"
    )
    compiled, _ = _flow._compiled_solver(problem, init, options, defer_tail=True)
    head = jax.tree_util.tree_map(np.asarray, compiled(problem, init))
    rows = []
    for k in range(rounds):
        for way in WAYS:
            with stages(way):
                tail, start, compile_time = _flow._tail_program(problem, init, head, options)
                best = np.inf
                for _ in range(runs):
                    clock = time.perf_counter()
                    result = jax.block_until_ready(tail(problem, init, start))
                    best = min(best, time.perf_counter() - clock)
            steps = result.work()["stiff tail"]["steps"]
            sigma = np.asarray(gflow.singular_values(result.model))[:3]
            rows.append((way, k, compile_time.seconds, 1e3 * best / steps, steps, sigma))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("points", nargs="*", type=parse_point, default=[(5, 0.1, 2), (4, 0.01, 0)])
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds per point")
    parser.add_argument("--runs", type=int, default=3, help="runs of each compiled program")
    args = parser.parse_args(argv)
    _compile.disable()  # a program from the cache would not say how its stages were traced
    for point in args.points:
        rows = compare(point, args.rounds, args.runs)
        print(f"{point}:")
        for way, k, seconds, ms, steps, _ in rows:
            print(
                f"  {way:>9} round {k}: compile {seconds:5.1f} s, {ms:.3f} ms a step, {steps} steps"
            )
        mean = lambda i, w, rows=rows: np.mean([r[i] for r in rows if r[0] == w])
        sigma = {r[0]: r[5] for r in rows}
        apart = np.max(np.abs(sigma["unrolled"] - sigma["loop"]) / np.abs(sigma["loop"]))
        print(
            f"  unrolled / loop: compile {mean(2, 'unrolled') / mean(2, 'loop'):.2f}, "
            f"a step {mean(3, 'unrolled') / mean(3, 'loop'):.2f} (means over rounds); "
            f"top-3 σ apart {apart:.1e} (relative)"
        )


if __name__ == "__main__":
    main()
