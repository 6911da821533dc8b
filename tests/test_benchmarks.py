"""The benchmark harness runs (cheap benchmarks at --quick sizes) so it cannot rot unnoticed."""

import json

import numpy as np
import pytest

from benchmarks.__main__ import main
from benchmarks.suite import BENCHMARKS


def test_quick_benchmarks_write_json_and_plots(tmp_path, capsys):
    assert (
        main(
            [
                "run",
                "--quick",
                "--only",
                "rhs_efficiency",
                "small_alpha_reach",
                "other_integrators",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "rhs_efficiency" in out and "small_alpha_reach" in out
    record = json.loads((tmp_path / "rhs_efficiency.json").read_text())
    assert record["dtype"] == "float64" and record["device"].startswith("cpu")
    assert all(r["fraction_of_matmul_rate"] > 0 for r in record["result"]["rows"])
    reach = json.loads((tmp_path / "small_alpha_reach.json").read_text())["result"]["rows"]
    assert all(r["status"] == "converged" for r in reach)
    assert (tmp_path / "small_alpha_reach.png").stat().st_size > 5000
    other = json.loads((tmp_path / "other_integrators.json").read_text())["result"]
    assert other["sweep"]["converged"] == other["sweep"]["flows"]
    assert all(b["wall_s"] > 0 for b in other["baselines"].values())


@pytest.mark.slow
def test_the_whole_quick_suite(tmp_path, capsys):
    """`python -m benchmarks run --quick` end to end (about 2–3 minutes on 2 cores)."""
    assert main(["run", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in BENCHMARKS:
        assert name in out
        assert json.loads((tmp_path / f"{name}.json").read_text())["result"]
        assert (tmp_path / f"{name}.png").stat().st_size > 5000
    tail = json.loads((tmp_path / "stiff_tail.json").read_text())["result"]["8x8"]["rows"]
    assert tail["gflow auto"]["status"] == "converged"
    assert tail["tsit5 (explicit only)"]["status"] == "max_steps"


def test_both_tails_side_by_side_agree_on_a_short_tail(capsys):
    """`python -m benchmarks.tails`: both stiff tails run on a sweep point and end on the same
    singular values; the command prints a row per tail."""
    from benchmarks.tails import compare, main, parse_point

    rows = list(compare([parse_point("3:1e-2:1")]))
    assert [row["method"] for row in rows] == ["rosenbrock", "radau"]
    assert all(row["result"].status_label == "converged" for row in rows)
    assert all(row["tail"]["steps"] > 0 for row in rows)
    assert rows[1]["apart"][:2].max() < 1e-9
    main(["3:1e-2:1"])
    out = capsys.readouterr().out
    assert out.count("converged") == 2 and "σ relative difference" in out


def test_the_tail_with_and_without_the_compensated_gradient_side_by_side():
    """`python -m benchmarks.tails --vary gradient`: the tail's float64 and compensated
    gradients on a sweep point end on the same singular values (test_stiff's rounding-floor
    test has a plateau only the compensated one leaves)."""
    from benchmarks.tails import compare, parse_point

    rows = list(compare([parse_point("3:1e-2:1")], vary="gradient"))
    assert [row["method"] for row in rows] == ["float64", "compensated"]
    assert all(row["result"].status_label == "converged" for row in rows)
    assert rows[1]["apart"][:2].max() < 1e-9


def test_the_newton_probe_steps_gflows_radau_tail_and_separates_the_floor():
    """`python -m benchmarks.newton`: Radau steps from where a flow stopped (here inside its
    tail, at `--t-max`), sized by the tail's own controller; the embedded estimate recovered
    from what the controller saw lies below it by exactly the Newton-aware floor of the
    attempt's iterations."""
    from benchmarks.newton import crawl, summary
    from gflow.engine._radau import NEWTON_ERROR

    result, runs = crawl((3, 1e-2, 1), attempts=12, t_max=500.0)
    assert result.status_label == "t_max" and runs["t"][0] == 500.0
    assert runs["accepted"].size == runs["iterations"].size == 12
    assert runs["accepted"].any() and runs["t"][1] > runs["t"][0]
    converged = ~runs["newton_failed"]
    iterations = runs["iterations"][converged]
    assert np.all((iterations >= 1) & (iterations <= 7))
    floors = np.asarray(NEWTON_ERROR)[np.minimum(iterations, len(NEWTON_ERROR) - 1)]
    reported, estimate = runs["reported"][converged], runs["estimate"][converged]
    assert np.all(reported >= floors * (1 - 1e-12))
    assert np.all(estimate <= reported)
    spectrum = runs["hessian"]  # ∇²loss where the flow stopped, ascending
    assert spectrum.size == sum(w.size for w in result.model.layers)
    assert np.all(np.diff(spectrum) >= 0) and np.all(np.isfinite(spectrum))
    assert runs["h"].size == 12 and np.all(runs["h"] > 0)
    lines = summary(result, runs)
    assert "12 attempts" in lines[1] and "Newton failures" in lines[1]
    assert "‖∇²loss‖" in lines[-1] and "h·ε·‖∇²loss‖" in lines[-1]


def test_the_fusion_probe_compiles_both_ways_and_restores_gflows_options():
    """`python -m benchmarks.fusion`: a sweep point solved compiled without XLA's YNNPACK
    fusion (gflow's default) and with it, alternated; the probe leaves gflow's options as they
    were, and the two solves end on the same top singular values."""
    from benchmarks.fusion import WAYS, compiled, solves
    from gflow.engine import _compile

    before = _compile.compiler_options()
    with compiled("with fusion"):
        assert _compile.compiler_options() == {}
    assert _compile.compiler_options() == before
    rows = list(solves(["3:1e-2:1"]))
    assert [row["way"] for row in rows] == list(WAYS)
    assert all(row["result"].status_label == "converged" for row in rows)
    np.testing.assert_allclose(rows[0]["sigma"][:2], rows[1]["sigma"][:2], rtol=1e-9)
    assert _compile.compiler_options() == before


def test_the_radau_step_probe_keeps_the_previous_stage_solve_and_restores_the_engines():
    """`python -m benchmarks.radau_step`: the earlier formulation it times the engine's
    against (complex N₀ solves in the original basis) solves the same system, tracing with it
    leaves the engine's functions in place, the ways before the kept basis take all of R₀'s
    eigenpairs, and "eigh" keeps the engine's but refreshes them by a full
    eigendecomposition."""
    import jax.numpy as jnp

    from benchmarks.radau_step import (
        previous_stage_solve,
        previous_stage_system,
        solver_for,
        traced,
    )
    from gflow.engine import _radau

    engine = _radau.RadauIIA(entries=8, jacobian=None, step_tolerance=(1e-10, 1e-10))
    assert solver_for("kept", engine) is engine and engine.basis_size == _radau.NEWTON_BASIS
    assert engine.ritz and not solver_for("eigh", engine).ritz
    assert solver_for("eigh", engine).basis_size == _radau.NEWTON_BASIS
    for way in ("all", "previous"):
        assert solver_for(way, engine).basis_size is None

    rng = np.random.default_rng(1)
    g = jnp.asarray(rng.standard_normal((3, 4, 10)))
    r = rng.standard_normal((10, 10))
    e, basis = map(jnp.asarray, np.linalg.eigh(0.1 * (r + r.T)))
    rhs = jnp.asarray(rng.standard_normal((3, 10)))
    for h in (0.3, 50.0):
        engine = _radau.stage_solve(_radau.stage_system(g, h, e, basis), h, basis, rhs)
        previous = previous_stage_solve(previous_stage_system(g, h, e, basis), h, basis, rhs)
        np.testing.assert_allclose(previous, engine, rtol=1e-10, atol=1e-12)
    engine_pair = (_radau.stage_system, _radau.stage_solve)
    with traced("previous"):
        assert (_radau.stage_system, _radau.stage_solve) == (
            previous_stage_system,
            previous_stage_solve,
        )
    assert (_radau.stage_system, _radau.stage_solve) == engine_pair


def test_the_tail_compile_probe_unrolls_the_same_stages_and_restores_the_loop():
    """`python -m benchmarks.tail_compile`: the unrolled stages it compiles against gflow's
    loop carry the same state through the same stages, and leave the loop in place."""
    import jax
    import jax.numpy as jnp

    from benchmarks.tail_compile import stages, unrolled_stages
    from gflow.engine import _rosenbrock

    def stage(i, carry):
        rows, total = carry
        return rows.at[i].set(total + i), total + rows[i - 1] * 2.0

    start = (jnp.arange(6.0) + 1.0, jnp.asarray(0.5))
    looped = jax.jit(lambda s: _rosenbrock.stage_loop(stage, s, 1, 6))(start)
    unrolled = jax.jit(lambda s: unrolled_stages(stage, s, 1, 6))(start)
    for a, b in zip(looped, unrolled, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    loop = _rosenbrock.stage_loop
    with stages("unrolled"):
        assert _rosenbrock.stage_loop is unrolled_stages
    assert _rosenbrock.stage_loop is loop


def test_the_handover_probe_bounds_the_radau_work_only_in_its_block():
    """`python -m benchmarks.handover`: its `limited` way keeps a 16 × 16, 30%-observed,
    depth-4 tail on the Rosenbrock method, which gflow's default hands over to Radau, and
    restores the default after the block; its sweep-family case is the sweep's point."""
    from benchmarks.handover import case, way_options, work_of
    from benchmarks.runoff import sweep_point
    from gflow.engine import _solve

    before = _solve.RADAU_MAX_WORK
    problem, init, base = case("16:4:1e-2")
    rows, work, hands_over = work_of(problem, init, base)
    assert rows == 72 and work > 1e7 and hands_over
    with way_options("limited", base, limit=1e7) as options:
        assert options.tail_method == "auto" and not work_of(problem, init, options)[2]
    assert _solve.RADAU_MAX_WORK == before and work_of(problem, init, base)[2]
    with way_options("radau", base) as options:
        assert options.tail_method == "radau" and options.rtol == base.rtol
    problem, init, base = case("sweep:8:4:1e-2:2")
    expected = sweep_point(4, 1e-2, 2)
    np.testing.assert_array_equal(problem.mask, expected[0].mask)
    np.testing.assert_array_equal(init.layers[0], expected[1].layers[0])
