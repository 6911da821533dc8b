"""The Gauss–Newton (NTK Gram) preconditioner of the stiff tail against dense linear algebra."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import gflow
from gflow.engine import _flow, _gram


@pytest.fixture(scope="module")
def case():
    """A 5×6 random mask, a depth-3 model padded to 4 layers (the last one frozen)."""
    problem = gflow.bernoulli(5, 6, 0.5, 2, key=0)
    model = gflow.pad_depth(gflow.gaussian([6, 4, 3, 5], 0.7, key=1), 4)
    layer_mask = jnp.asarray([1.0, 1.0, 1.0, 0.0])
    size = problem.num_observed + 3  # three padding entries
    return problem, model, layer_mask, size


def _dense_jacobian(model, problem, layer_mask):
    """J: observed entries of X by the flattened layers, frozen layers' columns zeroed."""
    rows, cols = np.nonzero(np.asarray(problem.mask))
    flat, unravel = ravel_pytree(model)
    observe = lambda v: unravel(v).product()[rows, cols]
    jac = np.asarray(jax.jacfwd(observe)(flat))
    weights = np.concatenate(
        [np.full(w.size, float(layer_mask[i])) for i, w in enumerate(model.layers)]
    )
    return jac * weights[None, :]


def test_observed_entries_pads_with_zero_weight(case):
    problem, _, _, size = case
    rows, cols, weight = _gram.observed_entries(problem.mask, size)
    n = problem.num_observed
    assert rows.shape == (size,)
    np.testing.assert_array_equal(np.asarray(weight), [1.0] * n + [0.0] * (size - n))
    np.testing.assert_array_equal(np.asarray(problem.mask)[rows[:n], cols[:n]], 1.0)
    pairs = zip(np.asarray(rows[:n]).tolist(), np.asarray(cols[:n]).tolist(), strict=True)
    assert len(set(pairs)) == n


def test_closed_form_gram_is_j_jt(case):
    problem, model, layer_mask, size = case
    rows, cols, weight = _gram.observed_entries(problem.mask, size)
    gram = np.asarray(_gram.gram(model.layers, rows, cols, weight, layer_mask))
    jac = _dense_jacobian(model, problem, layer_mask)
    n = problem.num_observed
    np.testing.assert_allclose(gram[:n, :n], jac @ jac.T, rtol=1e-12, atol=1e-12)
    assert np.all(gram[n:] == 0) and np.all(gram[:, n:] == 0)


# The factorisations of the whole Gram; `tangent` approximates it (its own tests below).
EXACT = [f for f in _gram.FACTORIZATIONS if f != "tangent"]


def _build(model, problem, layer_mask, size, shift, factorization):
    rank = 2 if factorization == "tangent" else 0
    return _gram.build(model, problem.mask, layer_mask, size, shift, factorization, rank)


@pytest.mark.parametrize("factorization", EXACT)
@pytest.mark.parametrize("shift", [1e-4, 1.0, 1e3])
def test_preconditioner_is_the_woodbury_inverse(case, shift, factorization):
    """apply(r) = (s·I + JᵀJ)⁻¹ r, J with frozen columns zeroed: `eigh` at every shift from
    one build, `inverse` and `cholesky` at the shift they were built for."""
    problem, model, layer_mask, size = case
    state = _gram.build(model, problem.mask, layer_mask, size, 0.5, "eigh")
    if factorization != "eigh":
        state = _gram.build(model, problem.mask, layer_mask, size, shift, factorization)
    jac = _dense_jacobian(model, problem, layer_mask)
    dense = shift * np.eye(jac.shape[1]) + jac.T @ jac
    flat, unravel = ravel_pytree(model)
    r = np.random.default_rng(0).normal(size=flat.shape)
    got = ravel_pytree(_gram.apply(state, shift, unravel(jnp.asarray(r))))[0]
    np.testing.assert_allclose(np.asarray(got), np.linalg.solve(dense, r), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("size, block", [(16, 4), (23, 5), (7, 3), (5, 8), (9, 9)])
def test_block_cholesky_solve_is_the_inverse(size, block, monkeypatch):
    """The `cholesky` factorization's block triangular solves, over even, uneven and single
    blocks, on an SPD matrix of condition 1e8: backward stable (the residual at rounding
    level, whatever the condition), hence the dense solve's answer to ~cond·ε."""
    monkeypatch.setattr(_gram, "CHOLESKY_BLOCK", block)
    rng = np.random.default_rng(size)
    q, _ = np.linalg.qr(rng.normal(size=(size, size)))
    matrix = (q * np.logspace(-6, 2, size)) @ q.T
    inverses, panels = _gram._block_cholesky(jnp.asarray(matrix))
    assert inverses.shape[0] == -(-size // block)
    r = rng.normal(size=size)
    got = np.asarray(_gram._block_cholesky_solve(inverses, panels, jnp.asarray(r)))
    residual = np.linalg.norm(matrix @ got - r)
    assert residual <= 1e-13 * np.linalg.norm(matrix, 2) * np.linalg.norm(got)
    want = np.linalg.solve(matrix, r)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-7 * np.abs(want).max())


@pytest.mark.parametrize("size, block", [(16, 4), (23, 5), (7, 2), (9, 3), (40, 7)])
def test_blocked_spd_inverse_is_the_inverse(size, block, monkeypatch):
    """The `inverse` factorization's blocked L⁻ᵀL⁻¹, over even and uneven blocks, on an SPD
    matrix of condition 1e8: exactly symmetric, and the dense inverse to ~cond·ε."""
    monkeypatch.setattr(_gram, "INVERSE_BLOCK", block)
    rng = np.random.default_rng(size)
    q, _ = np.linalg.qr(rng.normal(size=(size, size)))
    matrix = (q * np.logspace(-6, 2, size)) @ q.T
    got = np.asarray(_gram._spd_inverse(jnp.asarray(matrix)))
    assert np.array_equal(got, got.T)
    want = np.linalg.inv(matrix)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-7 * np.abs(want).max())
    residual = np.linalg.norm(matrix @ got - np.eye(size), 2)
    assert residual <= 1e-7
    # Not positive definite: not finite, so that `build` falls back to no preconditioner.
    assert not np.all(np.isfinite(np.asarray(_gram._spd_inverse(jnp.asarray(-matrix)))))


def test_cholesky_preconditioner_over_several_blocks_equals_the_inverse(case, monkeypatch):
    """The Woodbury preconditioner through a Gram factorised in blocks of 4 rows (the last one
    shorter, the observed entries' zero-weight padding inside) is the explicit inverse's,
    itself formed in blocks of 5 rows."""
    problem, model, layer_mask, size = case
    monkeypatch.setattr(_gram, "CHOLESKY_BLOCK", 4)
    monkeypatch.setattr(_gram, "INVERSE_BLOCK", 5)
    flat, unravel = ravel_pytree(model)
    r = unravel(jnp.asarray(np.random.default_rng(1).normal(size=flat.shape)))
    for shift in (1e-4, 1.0):
        states = [
            _gram.build(model, problem.mask, layer_mask, size, shift, f)
            for f in ("cholesky", "inverse")
        ]
        assert states[0].matrix.shape[0] == -(-size // 4) > 2
        got, want = (np.asarray(ravel_pytree(_gram.apply(s, shift, r))[0]) for s in states)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_an_inverse_preconditioner_at_another_shift_is_off_by_at_most_the_shift_ratio(case):
    """Built at s₀ and applied at s, M⁻¹ has eigenvalues s₀/(s(s₀ + μ)) on range(Jᵀ) and 1/s
    off it: M⁻¹(s·I + JᵀJ) has its spectrum between 1 and s₀/s."""
    problem, model, layer_mask, size = case
    jac = _dense_jacobian(model, problem, layer_mask)
    flat, unravel = ravel_pytree(model)
    s0 = 1.0
    state = _gram.build(model, problem.mask, layer_mask, size, s0, "inverse")
    apply = jax.jit(lambda s, v: ravel_pytree(_gram.apply(state, s, unravel(v)))[0])
    for shift in (0.1, 10.0):
        inverse = np.asarray(jax.vmap(lambda v, s=shift: apply(s, v))(jnp.eye(flat.size))).T
        product = inverse @ (shift * np.eye(flat.size) + jac.T @ jac)
        eig = np.sort(np.linalg.eigvals(product).real)
        low, high = sorted((1.0, s0 / shift))
        assert eig.min() > low * (1 - 1e-9) and eig.max() < high * (1 + 1e-9)
        assert high / low > 9  # both ends are reached: it is a real approximation


@pytest.mark.parametrize("factorization", _gram.FACTORIZATIONS)
def test_a_stale_preconditioner_is_still_symmetric_positive_definite(case, factorization):
    """Built at one point, applied with any shift: the map CG sees stays SPD."""
    problem, model, layer_mask, size = case
    stale = gflow.pad_depth(gflow.gaussian([6, 4, 3, 5], 0.3, key=7), 4)
    state = _build(stale, problem, layer_mask, size, 1e-2, factorization)
    flat, unravel = ravel_pytree(model)
    apply = jax.jit(lambda s, v: ravel_pytree(_gram.apply(state, s, unravel(v)))[0])
    for shift in (1e-6, 1e-2, 10.0):
        matrix = np.asarray(jax.vmap(lambda v, s=shift: apply(s, v))(jnp.eye(flat.size))).T
        np.testing.assert_allclose(matrix, matrix.T, atol=1e-10 * np.abs(matrix).max())
        assert np.linalg.eigvalsh(0.5 * (matrix + matrix.T)).min() > 0


def _tangent_basis(model, problem, rank):
    """Z dense: the observed entries (in `observed_entries` order) of U[:, a]·e_jᵀ, columns
    (a, j), then of e_i·V[:, a]ᵀ, columns (a, i)."""
    u, v = (np.asarray(x) for x in _gram._tangent_directions(model, rank))
    rows, cols = np.nonzero(np.asarray(problem.mask))
    d_out, d_in = problem.shape
    z = np.zeros((rows.size, rank * (d_in + d_out)))
    for p, (i, j) in enumerate(zip(rows, cols, strict=True)):
        for a in range(rank):
            z[p, a * d_in + j] = u[i, a]
            z[p, rank * d_in + a * d_out + i] = v[j, a]
    return z


@pytest.mark.parametrize("rank", [1, 2, 5])
def test_tangent_system_is_z_t_z_and_z_t_g_z(case, rank):
    """The closed forms never form the |Ω|² Gram, nor Z."""
    problem, model, layer_mask, size = case
    z = _tangent_basis(model, problem, rank)
    u, v = _gram._tangent_directions(model, rank)
    c, k = (
        np.asarray(x) for x in _gram._tangent_system(model.layers, problem.mask, layer_mask, u, v)
    )
    rows, cols, weight = _gram.observed_entries(problem.mask, size)
    n = problem.num_observed
    gram = np.asarray(_gram.gram(model.layers, rows, cols, weight, layer_mask))[:n, :n]
    np.testing.assert_allclose(c, z.T @ z, rtol=0, atol=1e-14)
    want = z.T @ gram @ z
    np.testing.assert_allclose(k, want, rtol=0, atol=1e-13 * np.abs(want).max())


@pytest.mark.parametrize("shift", [1e-4, 1.0, 1e3])
@pytest.mark.parametrize("rank", [1, 2, 5])
def test_tangent_preconditioner_is_the_woodbury_inverse_of_its_projection(case, shift, rank):
    """apply(r) = (s·I + JᵀZ(ZᵀZ + δ/s)⁻¹ZᵀJ)⁻¹ r: the Gauss–Newton matrix with J's rows
    projected onto the observed entries of X's rank-`rank` tangent space (δ: the jitter
    that keeps the system definite). At full rank (5 = min(5, 6)) Z spans every observed
    entry: the Woodbury inverse of the whole Gram, to the jitter."""
    problem, model, layer_mask, size = case
    state = _gram.build(model, problem.mask, layer_mask, size, shift, "tangent", rank)
    jac = _dense_jacobian(model, problem, layer_mask)
    z = _tangent_basis(model, problem, rank)
    rows, cols, weight = _gram.observed_entries(problem.mask, size)
    n = problem.num_observed
    gram = np.asarray(_gram.gram(model.layers, rows, cols, weight, layer_mask))[:n, :n]
    system = shift * z.T @ z + z.T @ gram @ z
    jitter = _gram.TANGENT_JITTER * np.max(np.diag(system))
    projection = z @ np.linalg.solve(z.T @ z + jitter / shift * np.eye(z.shape[1]), z.T)
    dense = shift * np.eye(jac.shape[1]) + jac.T @ projection @ jac
    flat, unravel = ravel_pytree(model)
    r = np.random.default_rng(0).normal(size=flat.shape)
    got = np.asarray(ravel_pytree(_gram.apply(state, shift, unravel(jnp.asarray(r))))[0])
    np.testing.assert_allclose(got, np.linalg.solve(dense, r), rtol=1e-9, atol=1e-12)
    if rank == 5:
        exact = np.linalg.solve(shift * np.eye(jac.shape[1]) + jac.T @ jac, r)
        np.testing.assert_allclose(got, exact, rtol=1e-6, atol=1e-9)


def test_tangent_directions_drop_singular_values_below_the_gap():
    """Directions of X whose singular values sit below TANGENT_GAP·σ₁ (the init's residue)
    are zero columns of U and V: Z spans nothing there."""
    x = np.diag([10.0, 3.0, 0.5 * _gram.TANGENT_GAP * 10.0, 1e-9])
    model = gflow.Factorization([jnp.asarray(x)])
    u, v = (np.asarray(a) for a in _gram._tangent_directions(model, 3))
    np.testing.assert_allclose(np.abs(u[:, :2]), np.eye(4)[:, :2], atol=1e-15)
    np.testing.assert_allclose(np.abs(v[:, :2]), np.eye(4)[:, :2], atol=1e-15)
    assert np.all(u[:, 2] == 0) and np.all(v[:, 2] == 0)


def test_auto_takes_the_tangent_factorization_where_its_system_is_small():
    """`gauss_newton="auto"`: `tangent` from TANGENT_MIN_OBSERVED observed entries where
    2·rank·(d_out + d_in) ≤ |Ω|; else the Gram's Cholesky factor or inverse, by size."""
    from gflow.engine import _solve

    auto = gflow.FlowOptions()
    choose = lambda entries, rank, shape: _solve.gauss_newton_factorization(
        auto, entries, rank, shape
    )
    assert choose(2945, 5, (100, 100)) == "tangent"  # the `scale` problem at d = 100
    assert choose(11941, 5, (200, 200)) == "tangent"
    assert choose(704, 5, (50, 50)) == "inverse"  # d = 50: below TANGENT_MIN_OBSERVED
    assert choose(2945, 8, (100, 100)) == "inverse"  # 2·8·200 > 2,945
    assert choose(11941, 20, (200, 200)) == "cholesky"
    assert choose(11941, None, (200, 200)) == "cholesky"
    forced = gflow.FlowOptions(gauss_newton="inverse")
    assert _solve.gauss_newton_factorization(forced, 2945, 5, (100, 100)) == "inverse"


def test_programs_are_keyed_on_the_tangent_rank_only_where_the_tangent_system_takes_it():
    """A sweep over target ranks at small sizes shares its programs; a deferred head, which
    runs no stiff solver, never takes a rank."""
    from gflow.engine._flow import tangent_rank

    small = gflow.bernoulli(6, 7, 0.5, 2, key=0)
    auto, forced = gflow.FlowOptions(), gflow.FlowOptions(gauss_newton="tangent")
    assert tangent_rank(small, auto, 64) is None
    assert tangent_rank(small, forced, 64) == 2
    assert tangent_rank(small, gflow.FlowOptions(preconditioner="spectral"), 64) is None
    large = gflow.bernoulli(64, 64, 0.3, 3, key=0)
    assert tangent_rank(large, auto, 1280) == 3
    assert tangent_rank(large, gflow.FlowOptions(gauss_newton="cholesky"), 1280) is None


def _head(layers, status):
    """What `tangent_rank` reads of a deferred head: its models and statuses."""
    return types.SimpleNamespace(model=gflow.Factorization(layers), status=np.asarray(status))


def test_a_tail_takes_the_rank_of_x_where_it_begins_not_the_targets():
    """Real data: unobserved entries unknown (nan) make the target read as full rank; the
    tail's rank is X's at the handover (singular values above TANGENT_GAP·σ₁), over the
    members whose tail is pending."""
    from gflow.engine._flow import learned_rank, tangent_rank, target_rank

    problem = gflow.bernoulli(64, 64, 0.3, 3, key=0)
    mask = np.asarray(problem.mask)
    unknown = gflow.Problem(np.where(mask == 1, np.asarray(problem.target), np.nan), mask)
    assert target_rank(unknown) == 64
    auto = gflow.FlowOptions()
    assert tangent_rank(unknown, auto, 1280) is None  # no head (solver="rodas4"): the target's
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.standard_normal((64, 64)))
    sigma = np.r_[[9.0, 4.0, 2.0], np.full(61, 0.5 * _gram.TANGENT_GAP * 9.0)]
    x = q @ np.diag(sigma) @ q.T
    layers = [np.eye(64), x, np.eye(64)]  # W₁, W₂, W₃: X = W₃W₂W₁
    pending = _head(layers, gflow.Status.PENDING)
    assert learned_rank(pending.model) == 3
    assert tangent_rank(unknown, auto, 1280, pending) == 3
    assert tangent_rank(problem, auto, 1280, pending) == 3
    # small singular values above the gap but well apart from the learned ones stay out
    spread = np.r_[[9.0, 8.0, 7.0, 0.4, 0.35, 0.3], sigma[6:]]
    assert learned_rank(gflow.Factorization([np.eye(64), q @ np.diag(spread) @ q.T])) == 3
    assert learned_rank(gflow.Factorization([np.eye(64), np.diag(np.r_[2.0, np.zeros(63)])])) == 1
    assert learned_rank(gflow.Factorization([np.zeros((64, 64))])) == 0
    # a batch: the largest rank among pending members; others, and non-finite X, do not count
    x6 = q @ np.diag(np.r_[np.full(6, 9.0), sigma[6:]]) @ q.T
    nan = np.full((64, 64), np.nan)
    batch = [np.stack([w, w, w]) for w in layers]
    batch[1] = np.stack([x, x6, nan])
    statuses = [gflow.Status.PENDING, gflow.Status.CONVERGED, gflow.Status.PENDING]
    assert tangent_rank(unknown, auto, 1280, _head(batch, statuses)) == 3
    statuses[1] = gflow.Status.PENDING
    assert tangent_rank(unknown, auto, 1536, _head(batch, statuses)) == 6
    # 2·r·(d_out + d_in) > |Ω|: the Gram's own factorisation
    assert tangent_rank(unknown, auto, 1280, _head(batch, statuses)) is None


def test_a_forced_tangent_preconditioner_that_cannot_fit_is_a_clear_error():
    """A program that runs the Rosenbrock method from the start takes the target's rank: zero,
    or so large (unknown entries off the mask) that the system outgrows the Gram, it refuses;
    so does a tail program at X's rank zero."""
    problem = gflow.Problem(np.zeros((6, 7)), np.ones((6, 7)))
    init = gflow.gaussian([7, 6, 6], 0.5, key=0)
    with pytest.raises(ValueError, match="the target is zero"):
        gflow.flow(problem, init, gauss_newton="tangent", solver="rodas4")
    unknown = gflow.Problem(np.where(np.eye(6, 7) == 1, 1.0, np.nan), np.eye(6, 7))
    with pytest.raises(
        ValueError, match="the target has rank 6 .unknown entries off the mask, nan, read as 0., so"
    ):
        gflow.flow(unknown, init, gauss_newton="tangent", solver="rodas4")
    with pytest.raises(ValueError, match="X where the stiff tail begins is zero"):
        head = _head([np.zeros((6, 7)), np.zeros((6, 6))], gflow.Status.PENDING)
        _flow.tangent_rank(problem, gflow.FlowOptions(gauss_newton="tangent"), 42, head)


def test_target_rank_is_the_largest_in_a_batch_and_ignores_unobserved_nans():
    from gflow.engine._flow import target_rank

    low = gflow.bernoulli(6, 7, 0.5, 2, key=0)
    high = gflow.bernoulli(6, 7, 0.5, 4, key=1)
    assert target_rank(low) == 2 and target_rank(gflow.stack([low, high])) == 4
    target = np.asarray(low.target).copy()
    mask = np.asarray(low.mask)
    target[mask == 0] = np.nan
    assert target_rank(gflow.Problem(np.where(mask == 1, target, np.nan), mask)) >= 1


@pytest.fixture(scope="module")
def cg_case():
    """An 8×8 random mask at depth 4 (256 parameters: the matrix-free CG path) with a stiff
    tail, and its flow with the Gauss–Newton preconditioner (the default)."""
    problem = gflow.bernoulli(8, 8, 0.5, 2, key=2)
    init = gflow.gaussian([8] * 5, 0.2, key=3)
    return problem, init, gflow.flow(problem, init)


def test_gauss_newton_tail_lands_on_the_dense_endpoint(cg_case):
    problem, init, flow = cg_case
    work = flow.work()
    assert flow.status_label == "converged" and "stiff tail" in work
    assert work["stiff tail"]["linear_iters"] > 0
    assert work["stiff tail"]["factorizations"] >= 1
    dense = gflow.flow(problem, init, linear_solver="dense")
    assert dense.work()["stiff tail"]["linear_iters"] == 0
    np.testing.assert_allclose(
        np.asarray(flow.model.product()), np.asarray(dense.model.product()), atol=1e-9
    )
    spectral = gflow.flow(problem, init, preconditioner="spectral")
    np.testing.assert_allclose(
        np.asarray(flow.model.product()), np.asarray(spectral.model.product()), atol=1e-9
    )
    # Never more Hessian-vector products than the spectral sketch (at d = 50 it takes 12× fewer:
    # benchmarks/README, `scale`); here both need about three per stage.
    assert work["stiff tail"]["linear_iters"] <= spectral.work()["stiff tail"]["linear_iters"]
    eigh = gflow.flow(problem, init, gauss_newton="eigh")
    np.testing.assert_allclose(
        np.asarray(flow.model.product()), np.asarray(eigh.model.product()), atol=1e-9
    )
    # The tangent space of X where the tail begins (rank 2, as the target's: 32 directions
    # for 32 observed entries).
    tangent = gflow.flow(problem, init, gauss_newton="tangent")
    assert tangent.work()["stiff tail"]["factorizations"] >= 1
    np.testing.assert_allclose(
        np.asarray(flow.model.product()), np.asarray(tangent.model.product()), atol=1e-9
    )
    # Unobserved entries unknown (nan): the same flow, to the last bit.
    mask = np.asarray(problem.mask)
    unknown = gflow.Problem(np.where(mask == 1, np.asarray(problem.target), np.nan), mask)
    blind = gflow.flow(unknown, init, gauss_newton="tangent")
    np.testing.assert_array_equal(np.asarray(blind.model.product()), tangent.model.product())
    assert blind.work() == tangent.work()


def test_work_table_adds_up(cg_case, tail_stages):
    _, _, flow = cg_case
    table = np.asarray(flow.phase_work)
    assert table.shape == (len(gflow.Phase), 5)
    assert table[:, 0].sum() == int(flow.num_steps)
    assert table[:, 1].sum() == int(flow.num_rejected_steps)
    assert table[:, 2].sum() == int(flow.num_rhs_evals) > 0
    assert table[:, 3].sum() == int(flow.num_linear_iters)
    assert table[:, 4].sum() == int(flow.num_factorizations)
    # The field once per stage, the stopping rule at the start and at each accepted point, and
    # the divergence test at the end (no CG failed here, so no stage was solved again).
    problem = cg_case[0]
    tail = flow.work()["stiff tail"]
    accepted = tail["steps"] - tail["rejected_steps"]
    stages = tail_stages(problem)
    assert tail["rhs_evals"] == stages * tail["steps"] + accepted + 2


def test_batched_gauss_newton_tail_equals_single_flows(cg_case):
    """The batch rebuilds its preconditioners together; each member is still its own flow,
    and does its own tail's work: `easy` converges before any tail, and its idle member's
    steps (h = 0: a failing CG, a build pending) once sent the other's tail dense at every
    step (336 factorisations instead of 90)."""
    problem, init, flow = cg_case
    easy = gflow.gaussian([8] * 5, 0.6, key=4)
    other = gflow.bernoulli(8, 8, 0.3, 2, key=5)  # another mask, another count
    problems = gflow.stack([problem, other])
    batch = gflow.flow_batch(problems, gflow.stack([init, easy]), tails="batch")
    single_other = gflow.flow(other, easy)
    members = (batch.member(0), batch.member(1))
    for member, single in zip(members, (flow, single_other), strict=True):
        assert member.status_label == single.status_label == "converged"
        np.testing.assert_allclose(
            np.asarray(member.model.product()), np.asarray(single.model.product()), atol=1e-9
        )
    assert "stiff tail" not in single_other.work()
    # (vmapped rounding can move a step: 332 / 90 against 331 / 89 on jax 0.12)
    tail, alone = members[0].work()["stiff tail"], flow.work()["stiff tail"]
    assert abs(tail["steps"] - alone["steps"]) <= 0.01 * alone["steps"]
    assert tail["factorizations"] <= 1.1 * alone["factorizations"]


def _tail_under_plain_jit(problem, init, options):
    """The flow of `init` at `options`, its stiff tail traced under a plain jit, so that a
    patched module constant takes effect (gflow's program caches key on options, which do
    not change), from the head program that flows of any tail options share."""
    from gflow.engine import _solve

    observed = _flow.observed_bound(problem)
    head_program, _ = _flow._compiled_solver(problem, init, options, defer_tail=True)
    head = head_program(problem, init)
    assert head.status_label == "pending"
    tail = lambda p, m, h: _solve.finish_tail(p, m, h, options, observed=observed)
    return jax.jit(tail)(problem, init, head)


def test_cg_started_from_the_previous_step_lands_on_the_same_endpoint(cg_case, monkeypatch):
    """Where the Gauss–Newton preconditioner is large, each stage's CG also starts from the
    previous step's stage solutions: forced here at |Ω| ≤ 64, the tail takes a different
    number of CG iterations and ends on the same endpoint."""
    from gflow.engine import _solve
    from gflow.engine._flow import observed_bound

    problem, init, _ = cg_case
    options = gflow.FlowOptions()
    observed = observed_bound(problem)
    run = lambda: _tail_under_plain_jit(problem, init, options)
    default = run()
    monkeypatch.setattr(_solve, "PREVIOUS_START_MIN_OBSERVED", 0)
    previous = run()
    for result in (default, previous):
        assert result.status_label == "converged" and "stiff tail" in result.work()
    iters = [r.work()["stiff tail"]["linear_iters"] for r in (default, previous)]
    assert iters[0] != iters[1]
    np.testing.assert_allclose(
        np.asarray(previous.model.product()), np.asarray(default.model.product()), atol=1e-9
    )
    setup = _solve._setup(problem, init, options, None)
    starts = lambda: [
        _solve._solvers(options, setup, None, n)["stiff"].stage_start
        for n in (observed, _solve.PREVIOUS_START_MIN_OBSERVED)
    ]
    assert starts() == ["previous", "previous"]
    monkeypatch.undo()
    assert starts() == ["stages", "previous"]


def test_cholesky_tail_over_several_blocks_lands_on_the_same_endpoint(cg_case, monkeypatch):
    """The tail preconditioned through the blocked Cholesky factor (forced here, in blocks of
    8 observed entries) ends on the default's endpoint; `gauss_newton="auto"` takes that
    factor from CHOLESKY_MIN_OBSERVED entries, the explicit inverse below."""
    from gflow.engine import _solve
    from gflow.engine._flow import observed_bound

    problem, init, flow = cg_case
    observed = observed_bound(problem)
    monkeypatch.setattr(_gram, "CHOLESKY_BLOCK", 8)
    result = _tail_under_plain_jit(problem, init, gflow.FlowOptions(gauss_newton="cholesky"))
    assert result.status_label == "converged"
    assert result.work()["stiff tail"]["factorizations"] >= 1
    np.testing.assert_allclose(
        np.asarray(result.model.product()), np.asarray(flow.model.product()), atol=1e-9
    )
    setup = _solve._setup(problem, init, gflow.FlowOptions(), None)
    chosen = [
        _solve._solvers(gflow.FlowOptions(), setup, None, n)["stiff"].preconditioner.factorization
        for n in (observed, _solve.CHOLESKY_MIN_OBSERVED - 1, _solve.CHOLESKY_MIN_OBSERVED)
    ]
    assert chosen == ["inverse", "inverse", "cholesky"]
