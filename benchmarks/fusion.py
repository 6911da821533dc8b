"""`python -m benchmarks.fusion`: gflow's programs with and without XLA's YNNPACK fusion.

On the CPU gflow compiles its programs with `xla_cpu_experimental_ynn_fusion_type` empty
(`gflow.engine._compile.CPU_COMPILER_OPTIONS`): with the fusion, two programs running at once
on two threads, as a sweep's stiff tails do, grow the process without bound. This probe
measures both sides of that choice in one process, the two compilations alternated:

- `solves`: flows of the `scale` problem (`d20`, `d50`, `d100`) and of its 112-flow d = 8
  sweep (depth:α:seed), each solved once compiled each way (compilation outside the clock),
  `--repeats` rounds in alternation: solve seconds and how far apart the top-3 σ end;
- `pair`: two Radau tails of one d = 8 flow on two threads (`_threads.run_concurrently`, as
  sweeps run tails apart), each way: the process's growth in MB/s while they run.

    python -m benchmarks.fusion d50 d100 4:1e-3:0 4:1e-2:2 --repeats 2
"""

from __future__ import annotations

import argparse
import contextlib
import threading
import time

import jax
import numpy as np

jax.config.update("jax_enable_x64", True)

import gflow  # noqa: E402
from gflow.engine import _compile  # noqa: E402
from gflow.engine._threads import run_concurrently  # noqa: E402

from .runoff import SWEEP_MAX_STEPS, SWEEP_RTOL, sweep_point  # noqa: E402
from .scale import problem_and_init  # noqa: E402
from .tails import parse_point  # noqa: E402

WAYS = ("without fusion", "with fusion")  # gflow's default first


@contextlib.contextmanager
def compiled(way):
    """Within the block, gflow compiles its programs `way` (one of `WAYS`)."""
    before = _compile.CPU_COMPILER_OPTIONS
    if way == "with fusion":
        _compile.CPU_COMPILER_OPTIONS = {}
    try:
        yield
    finally:
        _compile.CPU_COMPILER_OPTIONS = before


def case(name):
    """(problem, init, options) of a `scale` size (`d50`) or a sweep point (`4:1e-2:2`)."""
    if name.startswith("d"):
        problem, init = problem_and_init(int(name[1:]))
        return problem, init, gflow.FlowOptions()
    problem, init = sweep_point(*parse_point(name))
    return problem, init, gflow.FlowOptions(rtol=SWEEP_RTOL, max_steps=SWEEP_MAX_STEPS)


def solves(names, repeats=1):
    """Rows (name, way, round, result, top-3 σ), the two ways alternated within each round;
    each program is compiled before its first timed solve."""
    for name in names:
        problem, init, options = case(name)
        for way in WAYS:
            with compiled(way):
                gflow.flow(problem, init, options)
        for k in range(repeats):
            for way in WAYS:
                with compiled(way):
                    result = gflow.flow(problem, init, options)
                sigma = np.asarray(gflow.singular_values(result.model))[:3]
                yield dict(name=name, way=way, round=k, result=result, sigma=sigma)


def _rss_mb():
    with open("/proc/self/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) / 1024


def _growth_while(call):
    """MB/s the process grows while `call()` runs (RSS sampled every second)."""
    samples, done = [(time.perf_counter(), _rss_mb())], threading.Event()

    def watch():
        while not done.wait(1.0):
            samples.append((time.perf_counter(), _rss_mb()))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    call()
    done.set()
    watcher.join()
    samples.append((time.perf_counter(), _rss_mb()))
    (t0, m0), (t1, m1) = samples[0], samples[-1]
    return (m1 - m0) / (t1 - t0)


def pair_growth(point=(5, 1e-2, 0), t_max=1e12):
    """{way: MB/s} the process grows while two Radau tails of `point` (up to `t_max`) run on
    two threads, after one run alone (which compiles)."""
    problem, init = sweep_point(*point)
    options = gflow.FlowOptions(tail_method="radau", t_max=t_max)
    one = lambda: gflow.flow(problem, init, options)
    growth = {}
    for way in WAYS:
        with compiled(way):
            one()
            growth[way] = _growth_while(lambda: run_concurrently([one, one], threads=2))
    return growth


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "cases", nargs="*", default=["d20", "d50", "d100", "4:1e-3:0", "5:1e-3:1", "4:1e-2:2"]
    )
    parser.add_argument("--repeats", type=int, default=2, help="alternated rounds per case")
    parser.add_argument("--no-pair", action="store_true", help="skip the Radau pair")
    args = parser.parse_args(argv)

    if not _compile.compiler_options():
        print("gflow compiles without options here (not the CPU, or XLA does not know them)")
        return
    print(f"{'case':>10} {'compiled':>15} {'round':>5} {'status':>10} {'solve s':>8}  top-3 σ")
    times = {}
    for row in solves(args.cases, args.repeats):
        result = row["result"]
        times.setdefault(row["name"], {}).setdefault(row["way"], []).append(result.wall_time_s)
        print(
            f"{row['name']:>10} {row['way']:>15} {row['round']:5d} {result.status_label:>10} "
            f"{result.wall_time_s:8.2f}  {np.array2string(row['sigma'], precision=12)}",
            flush=True,
        )
    for name, by_way in times.items():
        ratio = sum(by_way[WAYS[1]]) / sum(by_way[WAYS[0]])
        print(f"{name:>10}: solve with fusion / without = {ratio:.2f}")
    if not args.no_pair:
        for way, rate in pair_growth().items():
            print(f"two Radau tails of (5, 1e-2, 0) on two threads, {way}: {rate:+.1f} MB/s")


if __name__ == "__main__":
    main()
