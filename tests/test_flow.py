"""The flow engine against closed forms, an independent integrator and conservation laws."""

import itertools
import json
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import reference_flow

import gflow
import gflow.cli

ALPHAS = [1e-4, 1e-3, 1e-2, 0.1, 0.3]
MS = [1.5, 2.0, 4.0, 16.0, math.inf]
VALUES = [1.0, 2.5]
# Every n in 2..6 appears at two depths in the default run; the full product is marked slow.
DEFAULT_PAIRS = [(2, 2), (2, 6), (3, 3), (3, 4), (4, 5), (4, 2), (5, 4), (5, 6), (6, 3), (6, 5)]
ALL_PAIRS = [p for p in itertools.product(range(2, 7), range(2, 7)) if p not in DEFAULT_PAIRS]


def family_grid_errors(depth, n):
    grid = list(itertools.product(ALPHAS, MS, VALUES))
    configs = [gflow.FamilyConfig(depth, n, 1, a, m, w) for a, m, w in grid]
    problems = gflow.stack([gflow.diagonal(n, c.w) for c in configs])
    models = gflow.stack([gflow.identity_family(n, depth, c.alpha, c.m) for c in configs])
    result = gflow.flow_batch(problems, models)
    assert np.all(np.asarray(result.status) == gflow.Status.CONVERGED), result.status_label
    rows = gflow.compare_family_batch(result, configs)
    worst = {
        "sigma_a": max(r["sigma_a_relerr"] for r in rows),
        "sigma_b (layers)": max(r["sigma_b_relerr"] for r in rows),
        "svd": 0.0,
    }
    for i, row in enumerate(rows):
        predicted = np.sort(np.r_[row["sigma_a_pred"], np.full(n - 1, row["sigma_b_pred"])])[::-1]
        sigma = gflow.singular_values(result.member(i).model)
        resolved = predicted >= 1e-6 * predicted[0]
        err = np.max(np.abs(sigma[resolved] / predicted[resolved] - 1))
        worst["svd"] = max(worst["svd"], err)
    return worst


@pytest.mark.parametrize("depth, n", DEFAULT_PAIRS)
def test_identity_family_matches_implicit_equations(depth, n):
    worst = family_grid_errors(depth, n)
    # σ_B is measured from the layers: at L = 6, α = 1e-4 it is ~1e-25, below SVD resolution.
    assert max(worst.values()) <= 1e-8, worst


@pytest.mark.slow
@pytest.mark.parametrize("depth, n", ALL_PAIRS)
def test_identity_family_matches_implicit_equations_full_grid(depth, n):
    test_identity_family_matches_implicit_equations(depth, n)


def test_block_problem_at_finite_time_matches_exact_modes():
    """s > 1: σ_A, σ_B reach their limits while σ_C(T) follows its exact algebraic law."""
    depth, n, s, alpha, m, t_max = 3, 2, 2, 0.1, 4.0, 50.0
    r = gflow.flow(
        gflow.block_diagonal(n, s), gflow.identity_family(n * s, depth, alpha, m), t_max=t_max
    )
    assert r.status_label == "t_max"
    np.testing.assert_allclose(float(r.t_end), t_max, rtol=1e-12)
    spec = gflow.family_spectrum(r.model, n, s)
    limit = gflow.family_limit(depth, n, s, alpha, m)
    np.testing.assert_allclose(spec["sigma_a"], limit.sigma_a, rtol=1e-8)
    np.testing.assert_allclose(spec["sigma_b"], limit.sigma_b, rtol=1e-7)
    np.testing.assert_allclose(
        spec["sigma_c"], gflow.sigma_c_at(depth, n, s, alpha, m, t_max), rtol=1e-8
    )


def test_trajectory_checkpoints_of_theory_table_t5():
    """Reference table T5 (shared theory notes): (L, n, s, m, α) = (3, 4, 1, 4, 0.1), t = 1, 5."""
    problem = gflow.diagonal(4)
    model = gflow.identity_family(4, 3, 0.1, 4.0)
    for t, lam_a, lam_b, loss in [
        (1.0, 2.1202447241996e-01, 8.1066942755577e-02, 1.9888857766e00),
        (5.0, 1.1147512060946e00, 1.1742452180966e-01, 8.5143061835e-01),
    ]:
        r = gflow.flow(problem, model, t_max=t, rtol=1e-12, clock="physical")
        lam = gflow.family_eigenvalues(r.model, 4, 1)
        np.testing.assert_allclose(lam["A"], lam_a, rtol=1e-9)
        np.testing.assert_allclose(lam["B"], lam_b, rtol=1e-9)
        np.testing.assert_allclose(float(r.loss), loss, rtol=1e-9)


def test_small_alpha_never_stops_at_t0_and_large_alpha_terminates():
    problem = gflow.diagonal(3)
    small = gflow.flow(problem, gflow.identity_family(3, 4, 1e-3, 4.0))
    assert small.status_label == "converged"
    escape = gflow.escape_time(4, 3, 1, 1e-3, 4.0)
    assert float(small.t_end) > 0.5 * escape
    assert float(small.loss) < 1e-18
    large = gflow.flow(problem, gflow.identity_family(3, 4, 10.0, 4.0), max_steps=20_000)
    assert large.status_label in ("converged", "diverged")
    if large.status_label == "converged":
        assert float(large.loss) < 1e-15 * float(large.loss_init)


def test_overflowing_init_reports_diverged_not_exception():
    r = gflow.flow(gflow.diagonal(3), gflow.identity_family(3, 3, 1e40, 4.0), max_steps=2000)
    assert r.status_label == "diverged"


def test_stopping_rule_is_scale_aware():
    """The remaining-distance ratio is huge on the plateau of a small init and ≤ 1 at the end."""
    problem = gflow.diagonal(3)
    init = gflow.identity_family(3, 5, 1e-3, 4.0)
    ratio0 = gflow.engine.remaining_distance_ratio(init, problem, 1e-10, 1e-15)
    assert float(ratio0) > 1e10
    r = gflow.flow(problem, init)
    assert float(gflow.engine.remaining_distance_ratio(r.model, problem, 1e-10, 1e-15)) < 1e3


@pytest.mark.parametrize("solver", ["dopri5", "dopri8"])
def test_other_explicit_solvers_agree(solver):
    problem, model = gflow.diagonal(3, 1.3), gflow.identity_family(3, 3, 1e-2, 2.0)
    r = gflow.flow(problem, model, solver=solver)
    limit = gflow.family_limit(3, 3, 1, 1e-2, 2.0, 1.3)
    spec = gflow.family_spectrum(r.model, 3, 1)
    assert r.status_label == "converged"
    np.testing.assert_allclose(spec["sigma_a"], limit.sigma_a, rtol=1e-8)
    np.testing.assert_allclose(spec["log_sigma_b"], limit.log_sigma_b, atol=1e-8)


def test_stiff_solver_runs():
    problem, model = gflow.diagonal(2), gflow.identity_family(2, 2, 0.1, 4.0)
    r = gflow.flow(problem, model, solver="kvaerno5", rtol=1e-9)
    assert r.status_label == "converged"
    np.testing.assert_allclose(
        float(r.model.product()[0, 1]), 2 * 4 / 17, rtol=1e-7
    )  # docs/theory.md §2: X₁₂ = 2m/(m²+1)


def test_balancedness_conserved_along_trajectory():
    problem = gflow.bernoulli(6, 6, 0.6, 1, key=1)
    init = gflow.gaussian([6, 5, 7, 6], 0.5, key=4)
    r = gflow.flow(problem, init, save=24, save_layers=True, certificates=True)
    traj = r.trajectory.compress()
    assert len(traj.t) >= 10 and np.all(np.diff(traj.t) >= 0)
    d0 = gflow.balancedness(init)
    for k in range(len(traj.t)):
        layers = gflow.Factorization([w[k] for w in traj.layers.layers])
        for a, b in zip(d0, gflow.balancedness(layers), strict=True):
            # samples inside a stiff-tail step come from the Rosenbrock dense output (linear
            # interpolation there drifted 8e-9 to 1.3e-8)
            assert np.linalg.norm(b - a) <= 1e-10 * max(np.linalg.norm(b), 1.0)
    assert gflow.balancedness_drift(init, r.model) <= 1e-9
    assert gflow.energy_residual(r) <= 1e-8
    # the sampled loss decreases, as it must along a gradient flow
    assert np.all(np.diff(traj.loss) <= 1e-12 * traj.loss[0])


def test_runge_kutta_loop_on_a_linear_system():
    """gflow's own loop against the exact solution e^{tA}y0, and its three outcomes."""
    import diffrax
    import jax.scipy.linalg as jsl

    from gflow.engine._runge_kutta import MAX_STEPS, REACHED_END, STOPPED, integrate

    a = jnp.array([[-1.0, 2.0], [-2.0, -1.0]])  # a decaying rotation
    y0 = {"y": jnp.array([1.0, 0.5])}

    def run(t1, max_steps, stop_below):
        field = lambda y: ({"y": a @ y["y"]}, jnp.linalg.norm(y["y"]) < stop_below)
        return integrate(
            field,
            y0,
            t1,
            tableau=diffrax.Tsit5.tableau,
            order=5,
            rtol=1e-10,
            atol=1e-12,
            norm=lambda tree: jnp.sqrt(jnp.mean(tree["y"] ** 2)),
            max_steps=max_steps,
        )

    end = run(3.0, 10_000, 0.0)
    assert int(end.outcome) == REACHED_END and float(end.t) == 3.0
    exact = jsl.expm(3.0 * a) @ y0["y"]
    np.testing.assert_allclose(end.y["y"], exact, rtol=0, atol=1e-9)
    stopped = run(3.0, 10_000, 0.1)  # |y| = e^{-t}|y0|: below 0.1 from t ≈ 2.1
    assert int(stopped.outcome) == STOPPED and 2.0 < float(stopped.t) < 3.0
    assert float(jnp.linalg.norm(stopped.y["y"])) < 0.1
    capped = run(3.0, 5, 0.0)
    assert int(capped.outcome) == MAX_STEPS and int(capped.num_steps) == 5


def test_a_step_size_that_finds_no_step_ends_as_out_of_steps_after_its_stall_rejections():
    """With `stall_rejections`, that many rejected steps in a row end gflow's loop and the
    diffrax controller as out of steps, at the last accepted state. A zero tolerance rejects
    every step, as a loss clock on a saddle does (its rates outgrow any step)."""
    import diffrax

    from gflow.engine._phases import FiniteErrorPID
    from gflow.engine._runge_kutta import MAX_STEPS, integrate

    a = jnp.array([[-1.0, 2.0], [-2.0, -1.0]])
    y0 = {"y": jnp.array([1.0, 0.5])}
    norm = lambda tree: jnp.sqrt(jnp.mean(tree["y"] ** 2))
    for stall, steps in ((25, 25), (0, 400)):
        controller = FiniteErrorPID(rtol=0.0, atol=0.0, norm=norm, stall_rejections=stall)
        end = integrate(
            lambda y: ({"y": a @ y["y"]}, jnp.asarray(False)),
            y0,
            3.0,
            tableau=diffrax.Tsit5.tableau,
            order=5,
            rtol=0.0,
            atol=0.0,
            norm=norm,
            max_steps=400,
            stall_rejections=stall,
        )
        assert int(end.outcome) == MAX_STEPS and int(end.num_steps) == steps
        assert int(end.num_accepted_steps) == 0 and float(end.t) == 0.0
        np.testing.assert_array_equal(end.y["y"], y0["y"])
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(lambda t, y, args: {"y": a @ y["y"]}),
            diffrax.Tsit5(),
            0.0,
            3.0,
            None,
            y0,
            stepsize_controller=controller,
            max_steps=400,
            throw=False,
        )
        assert sol.result == diffrax.RESULTS.max_steps_reached
        assert int(sol.stats["num_steps"]) == steps and int(sol.stats["num_accepted_steps"]) == 0


def test_a_flow_that_saves_samples_is_the_flow_that_saves_none():
    """The explicit phases run in gflow's own Runge–Kutta loop, samples or not (the samples
    from each accepted step's dense output): the same steps and the same endpoint, bit for
    bit, plus the one gradient that spaces the physical-time samples."""
    problem = gflow.diagonal(5)
    init = gflow.gaussian([5, 4, 6, 5], 0.05, key=3)  # "auto": the loss clock, then physical
    # Tsit5 alone: the explicit phases are what differs (and no stiff phase to compile)
    options = {"solver": "tsit5", "rtol": 1e-9, "certificates": True}
    unsaved = gflow.flow(problem, init, **options)
    saved = gflow.flow(problem, init, **options, save=6)
    assert unsaved.status_label == saved.status_label == "converged"
    for field in ("num_steps", "num_accepted_steps", "num_rejected_steps", "t_end", "energy"):
        assert float(getattr(saved, field)) == float(getattr(unsaved, field)), field
    assert int(saved.num_rhs_evals) == int(unsaved.num_rhs_evals) + 1
    for a, b in zip(saved.model.layers, unsaved.model.layers, strict=True):
        np.testing.assert_array_equal(a, b)
    t = np.asarray(saved.trajectory.t)
    assert 8 <= np.isfinite(t).sum() < t.size  # both clocks sampled; rows after convergence not
    assert np.all(np.diff(t[np.isfinite(t)]) >= 0)
    # rows that are not samples read inf, not the state a phase left there
    samples = saved.trajectory
    for values in (samples.loss, samples.singular_values):
        values = np.asarray(values)
        assert np.all(np.isinf(values[~np.isfinite(t)]))
        assert np.all(np.isfinite(values[np.isfinite(t)]))


@pytest.mark.parametrize("clock", ["loss", "physical"])
def test_lean_loop_takes_the_steps_and_samples_of_diffeqsolve(clock):
    """One explicit phase in gflow's own loop and in `diffeqsolve`, samples saved: the same
    controller and first step give the same steps, the same endpoint, and samples from the
    same dense output (Tsit5's); the lean loop reads the stopping test off the
    first-same-as-last stage instead of evaluating it apart."""
    from gflow.engine import _phases, _solve

    problem = gflow.diagonal(5)
    if clock == "loss":  # the plateau of a small init
        init = gflow.gaussian([5, 4, 6, 5], 0.05, key=3)
        options = gflow.FlowOptions(solver="tsit5", rtol=1e-9, save=6)
    else:  # a flow of order-one time, sampled at given times (the last ones never reached)
        init = gflow.gaussian([5, 4, 6, 5], 0.5, key=3)
        times = (0.0, 0.3, 1.0, 3.0, 10.0, 30.0, 1e6, 1e9)
        options = gflow.FlowOptions(solver="tsit5", rtol=1e-9, save_ts=times)
    setup = _solve._setup(problem, init, options, None)
    solver = _solve._solvers(options, setup, None, None)["explicit"]
    y0 = {"model": init}

    def phase(lean):
        def run(y):
            if clock == "loss":
                y = y | {"t": jnp.zeros(())}
                return _phases.loss_clock_phase(setup, solver, y, 3.0, None, 10**5, 7, lean)
            return _phases.physical_phase(setup, solver, y, 0.0, jnp.inf, None, 10**5, lean)

        return jax.jit(run)(y0)

    lean, full = phase(True), phase(False)
    assert int(lean.stats.num_steps) == int(full.stats.num_steps) > 50
    assert int(lean.stats.num_rejected_steps) == int(full.stats.num_rejected_steps)
    assert int(lean.stats.rhs_evals) == int(full.stats.rhs_evals) - int(full.stats.num_steps) - 1
    assert int(lean.status) == int(full.status)
    for a, b in zip(lean.y["model"].layers, full.y["model"].layers, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)
    t, t_ref = np.asarray(lean.samples["t"]), np.asarray(full.samples["t"])
    valid = np.isfinite(t_ref)
    np.testing.assert_array_equal(np.isfinite(t), valid)
    assert valid.sum() >= 4
    np.testing.assert_allclose(t[valid], t_ref[valid], rtol=1e-12)
    for key in ("loss", "sv"):
        a, b = np.asarray(lean.samples[key])[valid], np.asarray(full.samples[key])[valid]
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-10 * np.max(np.abs(b)))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_end_floor_is_a_hundred_chained_nextafter(dtype):
    """The loops' "t1 − 100 ulp" bit for bit as 100 `nextafter` steps toward −∞ give it
    (nan for nan), over random bit patterns and the edges: ±0, subnormals, ±max, ±∞, nan."""
    from gflow.engine._runge_kutta import end_floor

    def chained(t1):
        for _ in range(100):
            t1 = jnp.nextafter(t1, jnp.asarray(-jnp.inf, t1.dtype))
        return t1

    ints = np.int64 if dtype == np.float64 else np.int32
    info, rng = np.finfo(dtype), np.random.default_rng(0)
    bits = rng.integers(np.iinfo(ints).min, np.iinfo(ints).max, 20_000, dtype=ints)
    tiny = info.smallest_subnormal
    edges = [0.0, -0.0, tiny, -tiny, 50 * tiny, 150 * tiny, -50 * tiny, info.tiny, -info.tiny]
    edges += [1.0, -1.0, 2.0, info.max, -info.max, np.nextafter(-info.max, 0), np.inf]
    edges += [-np.inf, np.nan]
    t1 = jnp.asarray(np.concatenate([bits.view(dtype), np.asarray(edges, dtype)]))
    expected = np.asarray(jax.jit(jax.vmap(chained))(t1))
    floor = np.asarray(jax.jit(jax.vmap(end_floor))(t1))
    nan = np.isnan(expected)  # nan payloads aside
    np.testing.assert_array_equal(np.isnan(floor), nan)
    np.testing.assert_array_equal(floor[~nan].view(ints), expected[~nan].view(ints))


def test_a_batched_flow_compiles_without_xla_error_logs():
    """Compiled afresh in a process of its own, a batch of depth-2 flows logs no XLA error,
    with samples or without. Its algebraic simplifier used to cycle on the loops' chain of 100
    `nextafter` and log "E… Algebraic simplifier is likely stuck" seven times a program, 35
    times in a `gflow reproduce` run; and on diffrax's own chain (`prevbefore`) 11 times for
    a batch that saved samples, until samples moved into gflow's loops."""
    code = (
        "import jax, gflow\n"
        "problem = gflow.bernoulli(6, 6, 0.5, 2, key=jax.random.key(0))\n"
        "keys = [jax.random.key(k) for k in (0, 1)]\n"
        "inits = gflow.stack([gflow.gaussian((6, 6, 6), 0.01, key=k) for k in keys])\n"
        "print(gflow.flow_batch(problem, inits).status_label)\n"
        "print(gflow.flow_batch(problem, inits, save=3).status_label)\n"
    )
    env = dict(os.environ, GFLOW_NO_CACHE="1")
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("converged") == 4
    assert not re.findall(r"^E\d{4} .*$", done.stderr, re.MULTILINE)


@pytest.fixture
def gradient_evaluations(monkeypatch):
    """Counts the gradient evaluations that flows compiled from here on run (a host callback
    in every loss-and-gradient and in the rounding floor's second gradient), with programs
    compiled afresh and not stored."""
    from collections import OrderedDict

    import gflow.descent
    from gflow.engine import _compensated, _compile, _phases, _stopping

    count = {"n": 0}

    def counting(fn):
        def counted(*args, **kwargs):
            # a token from the arguments, so that under vmap (Radau's stages) the callback
            # runs once a member: without a batched argument it runs once a batch
            leaves = jax.tree_util.tree_leaves(args)
            token = sum(jnp.ravel(jnp.asarray(x))[:1].sum() for x in leaves)
            jax.debug.callback(lambda _: count.__setitem__("n", count["n"] + 1), token)
            return fn(*args, **kwargs)

        return counted

    monkeypatch.setattr(_compile, "_PROGRAMS", OrderedDict())
    monkeypatch.setattr(_compile, "_program_path", lambda key, args: None)
    # (the stiff tail's `compensated_gradient="auto"` takes one float64 gradient an
    # evaluation, compensated or not, through `_compensated.loss_and_gradient`)
    for module in (_compensated, _stopping, gflow.descent):
        monkeypatch.setattr(module, "loss_and_gradient", counting(module.loss_and_gradient))
    monkeypatch.setattr(_phases, "rounding_ratio", counting(_phases.rounding_ratio))
    return count


WORK_COUNT_CASES = {
    # diffrax's first-same-as-last Tsit5 on both clocks, samples spaced by a gradient
    "samples": ("family", {"solver": "tsit5", "save": 3}),
    # Euler: no first-same-as-last stage, one evaluation a step
    "euler": ("family", {"solver": "euler", "dt": 0.05, "clock": "physical"}),
    # the lean loops, then the stiff tail in its own loop (CG with dense fallbacks, whose
    # stages are evaluated again) and the rounding floor's second gradient at every test
    "stiff tail": ("random", {"rounding_floor": True}),
    # Radau IIA: three rates a Newton iteration, f(y0) and its refinements, nothing for the
    # energy's stages (no certificates)
    "radau": ("random", {"tail_method": "radau"}),
}


@pytest.mark.parametrize("case", list(WORK_COUNT_CASES))
def test_rhs_evals_count_every_gradient_evaluation(gradient_evaluations, tail_stages, case):
    kind, options = WORK_COUNT_CASES[case]
    if kind == "family":
        problem, init = gflow.diagonal(3, 1.3), gflow.identity_family(3, 3, 1e-2, 2.0)
    else:
        problem = gflow.bernoulli(8, 8, 0.5, 2, key=jax.random.key(2))
        init = gflow.gaussian((8,) * 5, 1e-2, key=jax.random.key(1))
    result = gflow.flow(problem, init, **options)
    jax.effects_barrier()
    assert result.status_label == "converged"
    work = result.work()
    assert int(result.num_rhs_evals) == gradient_evaluations["n"] > 0
    assert sum(w["rhs_evals"] for w in work.values()) == gradient_evaluations["n"]
    if case == "stiff tail":
        # beyond every stage of every step, two gradients at each stopping test (the start and
        # each accepted point) and three for the status: stages solved again after failed CGs
        tail = work["stiff tail"]
        accepted = tail["steps"] - tail["rejected_steps"]
        plain = tail_stages(problem) * tail["steps"] + 2 * (accepted + 1) + 3
        assert tail["rhs_evals"] > plain


def test_descent_counts_one_gradient_a_step(gradient_evaluations):
    """Its stopping rule and divergence test read the step's own gradient."""
    problem, init = gflow.diagonal(3, 1.3), gflow.identity_family(3, 3, 0.1, 2.0)
    result = gflow.descend(problem, init, lr=0.05, max_steps=500)
    jax.effects_barrier()
    assert int(result.num_steps) > 0
    assert int(result.num_rhs_evals) == int(result.num_steps) + 1 == gradient_evaluations["n"]


def test_implicit_diffrax_solvers_report_uncounted_evaluations():
    """Kvaerno5's Newton iterations stay inside diffrax: −1 (not counted), not its stages."""
    problem, model = gflow.diagonal(2), gflow.identity_family(2, 2, 0.1, 4.0)
    result = gflow.flow(problem, model, solver="kvaerno5", rtol=1e-9)
    assert int(result.num_rhs_evals) == -1
    assert result.work()["explicit"]["rhs_evals"] == -1


def test_batch_members_are_independent_and_equal_single_runs():
    problem = gflow.diagonal(3)
    inits = [gflow.identity_family(3, 3, a, 4.0) for a in (0.05, 0.2, 1e40)]
    batch = gflow.flow_batch(problem, gflow.stack(inits), max_steps=5000)
    assert batch.status_label == ["converged", "converged", "diverged"]
    single = gflow.flow(problem, inits[1], max_steps=5000)
    np.testing.assert_allclose(
        np.asarray(batch.member(1).model.product()),
        np.asarray(single.model.product()),
        rtol=1e-12,
        atol=1e-14,
    )


@pytest.mark.parametrize("depth, alpha, seed, unknown", [(2, 0.3, 1, False), (3, 0.5, 2, True)])
def test_cli_file_inputs_match_independent_reference(tmp_path, capsys, depth, alpha, seed, unknown):
    """`unknown`: the target file holds nan off the mask, as real data does."""
    d = 6
    problem = gflow.bernoulli(d, d, 0.6, 1, key=seed)
    init = gflow.gaussian([d] * (depth + 1), alpha, key=seed + 10)
    target = np.asarray(problem.target)
    np.save(
        tmp_path / "target.npy", np.where(problem.mask == 1, target, np.nan) if unknown else target
    )
    np.save(tmp_path / "mask.npy", np.asarray(problem.mask))
    np.save(tmp_path / "init.npy", np.stack([np.asarray(w) for w in init.layers]))
    argv = ["run", "--problem", "file", "--target", str(tmp_path / "target.npy")]
    argv += ["--mask", str(tmp_path / "mask.npy"), "--init", "file"]
    argv += ["--init-file", str(tmp_path / "init.npy"), "--json"]
    assert gflow.cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == "converged"
    ref_layers, ref_loss = reference_flow(
        [np.asarray(w) for w in init.layers],
        np.asarray(problem.target),
        np.asarray(problem.mask),
        1.5 * report["t_end"],
    )
    assert ref_loss <= 1e-20
    x_ref = ref_layers[0]
    for w in ref_layers[1:]:
        x_ref = w @ x_ref
    s_ref = np.linalg.svd(x_ref, compute_uv=False)
    s = np.asarray(report["singular_values"])
    big = s_ref >= 1e-3 * s_ref[0]
    np.testing.assert_allclose(s[big], s_ref[big], rtol=1e-7)
    assert report["loss"] <= 1e-18
    for key in [
        "stable_rank",
        "effective_rank",
        "num_steps",
        "num_rhs_evals",
        "wall_time_s",
        "compile_time_s",
        "config",
    ]:
        assert key in report


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "--alpha", "0"], "alpha"),
        (["run", "--depth", "0"], "depth"),
        (["run", "--m", "1"], "m must be > 1"),
        (["run", "--solver", "rk4"], "invalid choice"),
        (["run", "--rosenbrock", "rodas3"], "invalid choice"),
        (["run", "--problem", "file"], "--target"),
        (["run", "--problem", "file", "--target", "nope.npy", "--mask", "x.npy"], "no such file"),
        (["run", "--rtol", "2"], "rtol"),
        (["run", "--bogus"], "unrecognized"),
    ],
)
def test_cli_bad_options_exit_2_with_one_line(capsys, argv, message):
    assert gflow.cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_float64_is_the_default():
    assert jnp.zeros(1).dtype == jnp.float64
    assert gflow.diagonal(2).target.dtype == jnp.float64
    assert jax.config.jax_enable_x64


def test_a_horizon_reached_on_the_loss_clock_is_t_max_not_failed():
    """Locating t = t_max on the loss clock is a root find on t(τ); with t − t_max it asked for
    an absolute 1e-12 at t = 1e4 (one ulp: 1.8e-12), never converged, and said `failed`."""
    from gflow.sweeps._build import build
    from gflow.sweeps._spec import DEFAULTS

    point = DEFAULTS | dict(blocks=3, block_size=2, depth=5, alpha=0.003, seed=0)
    problem, model = build(point, "block-diagonal", "gaussian")  # failed in `gflow reproduce`
    result = gflow.flow(problem, model, t_max=1e4)
    assert result.status_label == "t_max"
    assert result.end_phase == gflow.Phase.LOSS_CLOCK  # still on the plateau at t_max
    assert abs(float(result.t_end) / 1e4 - 1) < 1e-12
    assert result.status_message == (
        "t_max in the loss clock phase: the time horizon t_max was reached before convergence"
    )


def test_status_messages_name_the_phase_and_the_integrators_reason():
    from gflow.engine._result import status_message

    failed = status_message(gflow.Status.FAILED, gflow.Phase.STIFF_TAIL, 7)
    assert failed.startswith("failed in the stiff tail phase: the integrator reported: ")
    assert "nonlinear solver" in failed
    assert status_message(-1, 0, 0) == "pending: not computed yet"
    result = gflow.flow(gflow.diagonal(3), gflow.identity_family(3, 2, 0.1, 4.0))
    assert result.status_message.startswith("converged in the explicit phase")


def test_a_deferred_head_is_the_same_program_whatever_the_tail_options():
    """`FlowOptions.head` may drop the tail's options from a deferred head's program key
    only because that program never reads them: lowered with every one of them changed, the
    head is the same program, text for text (its jaxpr traces the tail's tolerances, which
    nothing uses and lowering drops)."""
    from gflow.engine._options import TAIL_ONLY
    from gflow.engine._solve import solve

    changed = dict(
        tail_rtol=1e-8,
        tail_scale="entry",
        rounding_floor=True,
        rounding_allowance=True,
        compensated_gradient=False,
        linear_solver="dense",
        rosenbrock="rodas5p",
        preconditioner="spectral",
        gauss_newton="eigh",
        radau_after=50,
    )
    radau = dict(tail_method="radau")  # with the Rosenbrock's options but rounding_allowance
    assert sorted([*changed, *radau]) == sorted(TAIL_ONLY)
    options = gflow.FlowOptions(rtol=1e-9, save=3, **changed)
    head = options.head()
    assert head == gflow.FlowOptions(rtol=1e-9, save=3)
    problem = gflow.bernoulli(4, 4, 0.6, 1, key=0)
    model = gflow.gaussian([4] * 3, 0.1, key=1)
    lowered = lambda o, defer: (
        jax.jit(lambda p, m: solve(p, m, o, observed=16, defer_tail=defer))
        .lower(problem, model)
        .as_text()
    )
    assert lowered(options, True) == lowered(head, True)
    assert lowered(options, False) != lowered(head, False)  # the whole solve reads them
    other = gflow.FlowOptions(rtol=1e-9, save=3, **radau, tail_rtol=1e-8)
    assert other.head() == head
    assert lowered(other, True) == lowered(head, True)


def test_options_are_checked_not_rewritten_and_take_a_diffrax_solver():
    import diffrax

    options = gflow.FlowOptions(save_ts=[0, 1.5, 3])
    assert options.clock == "auto" and options.clock_in_use == "physical"
    assert options.save_ts == (0.0, 1.5, 3.0)
    with pytest.raises(ValueError, match="save_ts"):
        gflow.FlowOptions(save_ts=[2.0, 1.0])
    with pytest.raises(ValueError, match="solver must be a name or a diffrax solver"):
        gflow.FlowOptions(solver=3)
    for bad in (0.0, 1.0, -1e-8):
        with pytest.raises(ValueError, match="tail_rtol must lie in"):
            gflow.FlowOptions(tail_rtol=bad)
    with pytest.raises(ValueError, match="tail_rtol is the stiff tail's tolerance"):
        gflow.FlowOptions(solver="tsit5", tail_rtol=1e-8)
    with pytest.raises(ValueError, match="rounding_floor stops the stiff tail"):
        gflow.FlowOptions(solver="rodas4", rounding_floor=True)
    with pytest.raises(ValueError, match="rounding_floor must be True or False"):
        gflow.FlowOptions(rounding_floor="yes")
    with pytest.raises(ValueError, match="unknown tail_scale 'rms'"):
        gflow.FlowOptions(tail_scale="rms")
    with pytest.raises(ValueError, match="tail_scale='entry' sets the stiff tail's step error"):
        gflow.FlowOptions(solver="tsit5", tail_scale="entry")
    with pytest.raises(ValueError, match="rounding_allowance widens the stiff tail"):
        gflow.FlowOptions(solver="tsit5", rounding_allowance=True)
    with pytest.raises(ValueError, match="rounding_allowance must be True or False"):
        gflow.FlowOptions(rounding_allowance=1)
    problem, model = gflow.diagonal(3), gflow.identity_family(3, 2, 0.1, 4.0)
    named = gflow.flow(problem, model, solver="euler", dt=0.05)
    given = gflow.flow(problem, model, solver=diffrax.Euler(), dt=0.05)
    assert named.status_label == given.status_label == "converged"
    assert int(named.num_steps) == int(given.num_steps)
    np.testing.assert_array_equal(named.model.layers[0], given.model.layers[0])
