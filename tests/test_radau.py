"""The Radau IIA stiff tail (`FlowOptions(tail_method="radau")`, gflow/engine/_radau.py): its
linear algebra against the dense Newton matrix, its pieces against their definitions, and its
flows against Rosenbrock references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gflow
from gflow.engine import _radau


def _dense_newton_matrix(g, r, h):
    blocks = [[_radau.A[i, j] * (g[j].T @ g[j] + r) for j in range(3)] for i in range(3)]
    return np.eye(3 * r.shape[0]) + h * np.block(blocks)


def _kept(r, kept):
    """R's `kept` eigenpairs largest in |e| (all where None), as the tail keeps them."""
    e, basis = np.linalg.eigh(r)
    order = np.argsort(-np.abs(e))[:kept]
    return e[order], basis[:, order]


@pytest.mark.parametrize("kept", [None, 5])
@pytest.mark.parametrize("h", [0.7, 1e3])
def test_the_stage_system_is_solved_as_the_dense_newton_matrix(h, kept):
    """Woodbury through R₀'s eigenbasis and A's eigenvalues against the 3P × 3P matrix, with
    all of R₀ and with its 5 eigenpairs largest in |e| (R₀ zero outside them)."""
    rng = np.random.default_rng(0)
    m, size = 5, 12
    g = rng.standard_normal((3, m, size))
    r = rng.standard_normal((size, size))
    r = 0.01 * (r + r.T)  # indefinite, as a residual's curvature is
    e, basis = _kept(r, kept)
    rhs = rng.standard_normal((3, size))
    system = _radau.stage_system(jnp.asarray(g), h, jnp.asarray(e), jnp.asarray(basis))
    x = np.asarray(_radau.stage_solve(system, h, jnp.asarray(basis), jnp.asarray(rhs)))
    matrix = _dense_newton_matrix(g, basis @ np.diag(e) @ basis.T, h)
    expected = np.linalg.solve(matrix, rhs.reshape(-1)).reshape(3, size)
    residual = np.linalg.norm(matrix @ x.reshape(-1) - rhs.reshape(-1))
    assert residual <= 1e-10 * np.linalg.norm(matrix, 2) * np.linalg.norm(x)
    np.testing.assert_allclose(x, expected, rtol=1e-8, atol=1e-10 * np.abs(expected).max())


@pytest.mark.parametrize("kept", [None, 5])
@pytest.mark.parametrize("h", [0.7, 1e3])
def test_the_error_filter_is_the_dense_one(h, kept):
    """RADAU5's (γ₀/h − J₀)⁻¹, −J₀ = G₀ᵀG₀ + R₀'s kept positive part, against a dense solve."""
    rng = np.random.default_rng(1)
    m, size = 5, 12
    g0 = rng.standard_normal((m, size))
    r = rng.standard_normal((size, size))
    e, basis = _kept(0.01 * (r + r.T), kept)
    rhs = rng.standard_normal(size)
    system = _radau.estimate_system(jnp.asarray(g0), h, jnp.asarray(e), jnp.asarray(basis))
    x = np.asarray(_radau.estimate_solve(system, h, jnp.asarray(basis), jnp.asarray(rhs)))
    positive = basis @ np.diag(np.maximum(e, 0.0)) @ basis.T
    matrix = _radau.GAMMA0 / h * np.eye(size) + positive + g0.T @ g0
    np.testing.assert_allclose(x, np.linalg.solve(matrix, rhs), rtol=1e-10, atol=0)


@pytest.mark.parametrize("h", [1e3, 1e5])
def test_a_truncated_stage_system_is_backward_stable_where_g_lies_along_stiff_directions(h):
    """Gauss–Newton rows 100× larger along R₀'s kept (stiff) eigenvectors than outside, as on
    a run-off flow: the solve is backward stable to a few ε. Projecting G and the right-hand
    side off span(E) once leaves rounding of their size along it, taken at weight 1 where
    N₀⁻¹ is ~1/(h|e|): a backward error ~1e-14 (measured 8e-15 against 4e-17 twice)."""
    rng = np.random.default_rng(0)
    m, size, kept = 5, 40, 8
    q, _ = np.linalg.qr(rng.standard_normal((size, size)))
    stiff = np.array([1e3, -2e3, 5e2, 1e3, 3e2, 8e2, -1e3, 2e3])
    e_all = np.concatenate([stiff, 1e-4 * rng.standard_normal(size - kept)])
    e, basis = e_all[:kept], q[:, :kept]
    g = rng.standard_normal((3, m, size)) + 100 * rng.standard_normal((3, m, kept)) @ basis.T
    rhs = rng.standard_normal((3, size))
    system = _radau.stage_system(jnp.asarray(g), h, jnp.asarray(e), jnp.asarray(basis))
    x = np.asarray(_radau.stage_solve(system, h, jnp.asarray(basis), jnp.asarray(rhs)))
    matrix = _dense_newton_matrix(g, basis @ np.diag(e) @ basis.T, h)
    residual = np.linalg.norm(matrix @ x.reshape(-1) - rhs.reshape(-1))
    assert residual <= 1e-15 * np.linalg.norm(matrix, 2) * np.linalg.norm(x)


def test_ritz_pairs_from_an_earlier_basis_are_the_nearby_residual_s_largest_eigenpairs():
    """Rayleigh–Ritz on span(E, R₀E), E an earlier R₀'s kept eigenvectors: the new R₀'s
    eigenpairs largest in |e| where it has moved by 1e-9 of its size, an orthonormal basis in
    which R₀ is diagonal; and R₀E's directions are reached where E misses one of them."""
    rng = np.random.default_rng(1)
    size, kept = 60, 8
    q, _ = np.linalg.qr(rng.standard_normal((size, size)))
    stiff = np.array([1e8, -3e6, 2e5, 5e4, -1e4, 3e3, 1e3, 2e2])
    e_all = np.concatenate([stiff, rng.uniform(-1, 1, size - kept)])
    earlier = q @ np.diag(e_all) @ q.T
    bump = rng.standard_normal((size, size))
    r0 = earlier + 1e-9 * np.abs(stiff).max() * (bump + bump.T) / np.sqrt(size)
    e, basis = (np.asarray(x) for x in _radau.ritz_pairs(jnp.asarray(r0), jnp.asarray(q[:, :kept])))
    exact, vectors = _kept(r0, kept)
    np.testing.assert_allclose(e, exact, rtol=0, atol=1e-14 * stiff[0])
    np.testing.assert_allclose(basis.T @ basis, np.eye(kept), rtol=0, atol=1e-14)
    np.testing.assert_allclose(np.abs(basis.T @ vectors), np.eye(kept), rtol=0, atol=1e-9)
    np.testing.assert_allclose(basis.T @ r0 @ basis, np.diag(e), atol=1e-14 * stiff[0])
    # E without the 2e2 direction: R₀E reaches it through R₀'s coupling of the two
    missing = q[:, :kept].copy()
    missing[:, -1] = (q[:, kept - 1] + q[:, kept]) / np.sqrt(2)
    e, _ = _radau.ritz_pairs(jnp.asarray(earlier), jnp.asarray(missing))
    np.testing.assert_allclose(np.asarray(e), stiff, rtol=0, atol=1e-14 * stiff[0])


def test_the_observed_jacobian_is_that_of_the_observed_entries_padded_and_masked():
    problem = gflow.bernoulli(5, 4, 0.5, 2, key=0)
    model = gflow.gaussian([4, 3, 3, 5], 0.7, key=1)
    flat, unravel = jax.flatten_util.ravel_pytree(model)
    observed = np.flatnonzero(np.asarray(problem.mask).reshape(-1) == 1)
    expected = jax.jacfwd(lambda v: unravel(v).product().reshape(-1)[observed])(flat)
    entries = observed.size + 7  # a bound, as for a batch: rows past the count are zero
    g = _radau.observed_jacobian(model, problem, None, entries)
    np.testing.assert_allclose(g[: observed.size], expected, rtol=1e-13, atol=1e-14)
    assert not np.any(np.asarray(g[observed.size :]))
    frozen = _radau.observed_jacobian(model, problem, jnp.asarray([1.0, 0.0, 1.0]), entries)
    middle = slice(model.layers[0].size, model.layers[0].size + model.layers[1].size)
    assert not np.any(np.asarray(frozen[:, middle]))
    np.testing.assert_array_equal(frozen[:, middle.stop :], g[:, middle.stop :])


def test_the_dense_output_is_the_collocation_polynomial():
    """Stage increments of a cubic with p(0) = 0, read back between and beyond the nodes."""
    p = lambda theta: theta + 2 * theta**2 - 3 * theta**3
    stages = {"x": jnp.asarray(p(_radau.NODES))[:, None] * jnp.asarray([[1.0, -2.0]])}
    y0 = {"x": jnp.asarray([0.5, 1.5])}
    dense = _radau.RadauInterpolation(t0=2.0, t1=4.0, y0=y0, stages=stages)
    for theta in (0.0, 0.3, 0.9, 1.0):
        got = dense.evaluate(2.0 + 2.0 * theta)["x"]
        np.testing.assert_allclose(got, [0.5 + p(theta), 1.5 - 2 * p(theta)], atol=1e-14)


def test_tail_method_is_checked():
    with pytest.raises(ValueError, match="tail_method"):
        gflow.FlowOptions(tail_method="radau5")
    with pytest.raises(ValueError, match="has no tail"):
        gflow.FlowOptions(solver="tsit5", tail_method="radau")
    with pytest.raises(ValueError, match="rounding_allowance"):
        gflow.FlowOptions(tail_method="radau", rounding_allowance=True)
    with pytest.raises(ValueError, match="tail_scale='entry'"):
        gflow.FlowOptions(tail_method="radau", tail_scale="entry")
    solver = _radau.RadauIIA(entries=4, jacobian=None, step_tolerance=(1e-10, 1e-12))
    too_large = {"model": gflow.gaussian([65, 65], 0.1, key=0), "energy": jnp.zeros(())}
    with pytest.raises(ValueError, match="P = 4225 > 4096"):
        solver.init(None, 0.0, 1.0, too_large, None)


@pytest.fixture(scope="module")
def radau_case():
    """tests/test_stiff.py's stiff d = 8 case (a random mask, depth 3, α = 0.05), its flow
    with the Radau tail, and the rtol-1e-12 Rosenbrock reference."""
    problem = gflow.bernoulli(8, 8, 0.4, 1, key=0)
    init = gflow.gaussian([8] * 4, 0.05, key=1)
    radau = gflow.flow(problem, init, tail_method="radau")
    reference = gflow.flow(problem, init, solver="rodas4", rtol=1e-12)
    return problem, init, radau, reference


def test_the_radau_tail_lands_on_the_reference_and_counts_its_work(radau_case):
    problem, init, radau, reference = radau_case
    assert radau.status_label == "converged" and reference.status_label == "converged"
    assert radau.end_phase == gflow.Phase.STIFF_TAIL
    assert float(radau.loss) <= 1e-20 * float(radau.loss_init)
    s = np.asarray(gflow.singular_values(reference.model))
    top = int(np.sum(s >= 1e-5 * s[0]))
    distance = gflow.endpoint_distance(radau, reference, problem, top=top)
    assert distance["singular_values"] <= 1e-8, distance
    assert distance["unobserved"] <= 1e-8, distance
    tail = radau.work()["stiff tail"]
    # Newton iterations, Newton matrices and evaluations of the rates, all counted: three a
    # Newton iteration, f(y0) and at most one refinement an attempt (no passive rows here)
    assert tail["linear_iters"] >= tail["steps"] > 0
    assert tail["factorizations"] >= tail["steps"]
    assert tail["rhs_evals"] >= 3 * tail["linear_iters"] + tail["steps"]
    assert tail["rhs_evals"] < 3 * tail["linear_iters"] + 4 * tail["steps"]
    assert int(radau.num_rhs_evals) == sum(p["rhs_evals"] for p in radau.work().values())


def test_a_radau_flow_that_saves_samples_is_the_flow_that_saves_none(radau_case):
    problem, init, radau, _ = radau_case
    saved = gflow.flow(problem, init, tail_method="radau", save=6)
    np.testing.assert_array_equal(saved.model.product(), radau.model.product())
    trajectory = saved.trajectory.compress()
    t = np.asarray(trajectory.t)
    assert np.all(np.diff(t) >= 0) and t[-1] > 0.5 * float(radau.t_end)
    assert np.all(np.isfinite(np.asarray(trajectory.loss)))


def test_the_energy_integral_rides_through_the_radau_tail(radau_case):
    """The energy ∫‖∇loss‖² dt, a passive state whose stages follow the model's, closes the
    energy balance (docs/theory.md's certificate) through the tail."""
    problem, init, radau, _ = radau_case
    certified = gflow.flow(problem, init, tail_method="radau", certificates=True)
    assert certified.status_label == "converged"
    assert gflow.energy_residual(certified) <= 1e-9
    np.testing.assert_allclose(certified.model.product(), radau.model.product(), atol=1e-9)
    # the energy's stages take the rates at the three converged stages of each attempt
    tail = certified.work()["stiff tail"]
    assert tail["rhs_evals"] >= 3 * tail["linear_iters"] + 4 * tail["steps"]


def test_radau_tails_are_not_batched():
    """Radau tails are not batched under vmap (a batched one hung): `tails="batch"` is
    refused with a message that names the way out."""
    problem = gflow.bernoulli(4, 4, 0.6, 1, key=0)
    models = gflow.stack([gflow.gaussian([4] * 3, 0.1, key=k) for k in (1, 2)])
    options = gflow.FlowOptions(tail_method="radau")
    with pytest.raises(ValueError, match="tails='apart'"):
        gflow.flow_batch(problem, models, options, tails="batch")
    with pytest.raises(ValueError, match="tails='apart'"):
        gflow.SweepSpec(axes={"alpha": [0.1]}, options=options, tails="batch")


def test_the_auto_tail_hands_a_long_rosenbrock_tail_over_to_radau(radau_case):
    """`tail_method="auto"`: the Rosenbrock tail for `radau_after` steps, then Radau IIA from
    where it stands, to the reference; a batch's tails (run side by side on threads, each
    compiling or finding the Radau stage's program) end where the flow alone does."""
    problem, init, _, reference = radau_case
    options = gflow.FlowOptions(tail_method="auto", radau_after=20)
    models = gflow.stack([init, gflow.gaussian([8] * 4, 0.05, key=2)])
    batch = gflow.flow_batch(problem, models, options)
    assert batch.status_label == ["converged", "converged"]
    auto = batch.member(0)
    assert auto.end_phase == gflow.Phase.RADAU_TAIL
    work = auto.work()
    assert work["stiff tail"]["steps"] == 20 and work["radau tail"]["steps"] > 0
    assert int(auto.num_steps) == sum(phase["steps"] for phase in work.values())
    assert int(auto.num_rhs_evals) == sum(phase["rhs_evals"] for phase in work.values())
    s = np.asarray(gflow.singular_values(reference.model))
    top = int(np.sum(s >= 1e-5 * s[0]))
    distance = gflow.endpoint_distance(auto, reference, problem, top=top)
    assert distance["singular_values"] <= 1e-8, distance
    assert distance["unobserved"] <= 1e-8, distance
    alone = gflow.flow(problem, init, options)
    np.testing.assert_array_equal(alone.model.product(), auto.model.product())
    assert alone.work() == work


def test_the_auto_tail_is_the_rosenbrock_tail_where_that_finishes_in_time(radau_case):
    problem, init, _, _ = radau_case
    rosenbrock = gflow.flow(problem, init, tail_method="rosenbrock")
    auto = gflow.flow(problem, init)
    assert rosenbrock.work()["stiff tail"]["steps"] < gflow.FlowOptions().radau_after
    assert auto.end_phase == gflow.Phase.STIFF_TAIL and "radau tail" not in auto.work()
    np.testing.assert_array_equal(auto.model.product(), rosenbrock.model.product())


def test_the_auto_tail_has_a_radau_stage_only_where_one_can_go_on(monkeypatch):
    """`_solve.tail_stages`: a tail batched under vmap, a model past Radau's dense limit, a
    Radau step's Newton matrix work past `RADAU_MAX_WORK` (none by default), a budget within
    `radau_after`, the Rosenbrock tableau's rounding allowance or a per-entry step error keep
    the Rosenbrock method for the whole budget."""
    from gflow.engine import _solve
    from gflow.engine._flow import stages_of_tail
    from gflow.engine._solve import RADAU_STEP_COST, radau_work, tail_stages

    small = gflow.gaussian([8] * 4, 0.05, key=1)
    options = gflow.FlowOptions(tail_method="auto", radau_after=500, max_steps=10_500)
    radau_steps = 10_000 // RADAU_STEP_COST
    assert tail_stages(options, small) == (("rosenbrock", 500), ("radau", radau_steps))
    assert tail_stages(options, small, continued=False) == (("rosenbrock", 10_500),)
    large = gflow.gaussian([65, 65], 0.1, key=0)
    assert tail_stages(options, large) == (("rosenbrock", 10_500),)
    # the Newton matrix's work, where bounded: with a bound of 1e7 the d = 8 sweep's 40 rows
    # at depth 3 hand over, 30% of a 16 × 16 target's at depth 4 (72 rows, P = 1,024) do
    # not; the programs of one tail take the rows Radau's would (a multiple of 8), whatever
    # their own stage's bound
    deep = gflow.gaussian([16] * 5, 0.01, key=1)
    sparse = gflow.bernoulli(16, 16, 0.05, 2, key=0)  # ≤ 16 rows: work ≤ 2.4e6
    dense = gflow.bernoulli(16, 16, 0.3, 5, key=0)
    assert len(stages_of_tail(dense, deep, options)) == 2  # no bound by default
    monkeypatch.setattr(_solve, "RADAU_MAX_WORK", 1e7)
    assert radau_work(40, 192) <= 1e7 < radau_work(72, 1024)
    assert tail_stages(options, small, observed=40) == tail_stages(options, small)
    assert tail_stages(options, deep, observed=72) == (("rosenbrock", 10_500),)
    assert len(stages_of_tail(sparse, deep, options)) == 2
    assert stages_of_tail(dense, deep, options) == (("rosenbrock", 10_500),)
    assert stages_of_tail(dense, deep, options, continued=False) == (("rosenbrock", 10_500),)
    short = gflow.FlowOptions(tail_method="auto", radau_after=500, max_steps=500)
    assert tail_stages(short, small) == (("rosenbrock", 500),)
    for method in ("rosenbrock", "radau"):
        assert tail_stages(gflow.FlowOptions(tail_method=method), small) == ((method, 100_000),)
    with pytest.raises(ValueError, match="radau_after"):
        gflow.FlowOptions(tail_method="auto", radau_after=0)
    for rosenbrock_only in (dict(rounding_allowance=True), dict(tail_scale="entry")):
        kept = gflow.FlowOptions(radau_after=500, max_steps=10_500, **rosenbrock_only)
        assert tail_stages(kept, small) == (("rosenbrock", 10_500),)


@pytest.mark.slow
def test_the_radau_tail_finishes_a_run_off_flow_on_the_rtol_1e_12_reference():
    """A d = 8 sweep point whose σ₁ runs off to 743 before σ₃ escapes (depth 4, α = 1e-2,
    seed 2 of the `scale` benchmark's sweep): the top two singular values against RODAS5P at
    rtol 1e-12, Rosenbrock throughout (measured at 89ad362: 1.1e-10 and 2.9e-10; σ₃, which
    escapes last, 1.2e-8: benchmarks/README, "A Radau IIA tail", "twenty-seventh session")."""
    from benchmarks.runoff import sweep_point

    problem, init = sweep_point(4, 1e-2, 2)
    radau = gflow.flow(problem, init, tail_method="radau")
    reference = gflow.flow(
        problem,
        init,
        rtol=1e-12,
        rosenbrock="rodas5p",
        tail_method="rosenbrock",
        max_steps=400_000,
    )
    assert radau.status_label == "converged" and reference.status_label == "converged"
    s, r = (np.asarray(gflow.singular_values(x.model))[:2] for x in (radau, reference))
    np.testing.assert_allclose(s, r, rtol=1e-8)
