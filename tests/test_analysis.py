"""Engine endpoints held against theory: closed forms, coupling verdicts, certificates."""

import itertools
import math

import numpy as np
import pytest

import gflow


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_depth2_diagonal_closed_form_on_random_inits(seed):
    """docs/theory.md §6: any init, unequal and negative targets."""
    d = 4
    rng = np.random.default_rng(seed)
    targets = np.array([1.0, -0.7, 2.5, 0.4]) * rng.uniform(0.8, 1.2, d)
    problem = gflow.Problem(np.diag(targets), np.eye(d))
    init = gflow.gaussian([d, d, d], 0.8, key=seed)
    r = gflow.flow(problem, init, rtol=1e-12)
    assert r.status_label == "converged"
    w1, w2 = (np.asarray(w) for w in init.layers)
    predicted = gflow.diagonal_l2_limit(w2, w1, targets)
    np.testing.assert_allclose(np.asarray(r.model.product()), predicted, rtol=0, atol=1e-9)


def test_depth2_symmetric_closed_form():
    """Symmetric W₁ = W₂ = W₀: X_ij(∞) = √(w_i w_j)(W₀²)_ij / √((W₀²)_ii (W₀²)_jj)."""
    w0 = 0.3 * np.array([[1.0, 0.2, 0.1], [0.2, 1.0, 0.3], [0.1, 0.3, 1.0]])
    targets = np.array([1.0, 2.0, 0.5])
    got = gflow.diagonal_l2_limit(w0, w0, targets)
    s = w0 @ w0
    want = np.sqrt(np.outer(targets, targets)) * s / np.sqrt(np.outer(np.diag(s), np.diag(s)))
    np.testing.assert_allclose(got, want, rtol=1e-13)


S_GT_1 = list(itertools.product([2, 3, 4], [0.1, 0.05], [2.0, 4.0, math.inf]))
HORIZON = {2: 200.0, 3: 500.0, 4: 2000.0}  # ≥ 10× the slowest escape time in each batch


def test_block_problems_sigma_c_follows_exact_finite_time_law():
    """s > 1: σ_A, σ_B at their limits, σ_C(T) equal to its exact algebraic law."""
    n, s = 2, 2
    by_depth = {}
    for depth, alpha, m in S_GT_1:
        by_depth.setdefault(depth, []).append(gflow.FamilyConfig(depth, n, s, alpha, m))
    for depth, configs in by_depth.items():
        t_max = HORIZON[depth]
        assert t_max >= 10 * max(gflow.escape_time(depth, n, s, c.alpha, c.m) for c in configs)
        models = gflow.stack([gflow.identity_family(4, depth, c.alpha, c.m) for c in configs])
        result = gflow.flow_batch(gflow.block_diagonal(n, s), models, t_max=t_max, rtol=1e-11)
        rows = gflow.compare_family_batch(result, configs)
        for row in rows:
            assert row["status"] == "t_max"
            assert row["sigma_a_relerr"] <= 1e-8, row
            assert row["sigma_c_relerr"] <= 1e-8, row
            # σ_B is at its limit once the A/B modes have converged; for small α the
            # exponential tail is still visible at T for L = 2 (slow escape), so allow 1e-7.
            assert row["sigma_b_relerr"] <= 1e-8, row


def test_comparison_table_and_figure(tmp_path):
    configs = [gflow.FamilyConfig(depth, 3, 1, a, 4.0) for depth in (2, 3) for a in (0.1, 0.01)]
    rows = []
    for depth in (2, 3):
        cs = [c for c in configs if c.depth == depth]
        models = gflow.stack([gflow.identity_family(3, depth, c.alpha, c.m) for c in cs])
        rows += gflow.compare_family_batch(gflow.flow_batch(gflow.diagonal(3), models), cs)
    assert all(r["max_relerr"] <= 1e-8 for r in rows)
    assert all(r["status"] == "converged" for r in rows)
    table = gflow.format_table(rows)
    assert "sigma_b_relerr" in table and len(table.splitlines()) == 2 + len(rows)
    fig = gflow.plot_rank_vs_alpha(rows, n=3, m=4.0)
    path = tmp_path / "rank.png"
    fig.savefig(path)
    assert path.stat().st_size > 10_000
    assert fig.axes[0].get_xscale() == "log" and fig.axes[0].get_xlabel()


# ---- coupling verdicts (docs/theory.md §10) ----------------------------------------------------


@pytest.mark.parametrize("depth, expected_groups", [(2, 5), (3, 1), (4, 1)])
def test_random_init_on_diagonal(depth, expected_groups):
    init = gflow.gaussian([5] * (depth + 1), 1.0, key=11)
    report = gflow.coupling(init, gflow.diagonal(5))
    assert len(report.groups) == expected_groups


@pytest.mark.parametrize("depth", [2, 3, 4, 5])
def test_identity_m_inf_is_decoupled_for_every_depth(depth):
    report = gflow.coupling(gflow.identity_family(4, depth, 0.1, math.inf), gflow.diagonal(4))
    assert not report.coupled and len(report.groups) == 4


def test_identity_m4_depth3_is_coupled_and_depth2_is_not():
    p = gflow.diagonal(4)
    deep = gflow.coupling(gflow.identity_family(4, 3, 0.1, 4.0), p, reference=lambda i, j: i)
    assert deep.coupled
    np.testing.assert_allclose(deep.max_cross_cosine, 1 / 17, rtol=0.02)  # O(1/m), theory: 0.059
    shallow = gflow.coupling(gflow.identity_family(4, 2, 0.1, 4.0), p)
    assert len(shallow.groups) == 4  # L = 2, diagonal Ω: disconnected bipartite graph


def test_depth2_on_two_disjoint_blocks_has_two_groups():
    problem = gflow.block_diagonal(2, 2)
    init = gflow.gaussian([4, 4, 4], 1.0, key=3)
    report = gflow.coupling(init, problem, reference=lambda i, j: i // 2)
    assert len(report.groups) == 2
    assert report.max_cross_cosine == 0.0
    assert sorted(map(sorted, report.groups)) == sorted(
        map(sorted, gflow.bipartite_components(problem))
    )
    assert gflow.coupling(gflow.gaussian([4, 4, 4, 4], 1.0, key=3), problem).coupled


def test_warm_start_from_identity_is_judged_by_the_trajectory():
    """L = 2 from W = I on Ω' = {(1,1), (1,2), (2,2)}: Θ is diagonal at t = 0, but the flow
    that follows couples every observation."""
    target = np.ones((2, 2))
    mask = np.array([[1.0, 1.0], [0.0, 1.0]])
    problem = gflow.Problem(target, mask)
    init = gflow.identity_family(2, 2, 1.0, math.inf)
    snapshot = gflow.coupling(init, problem)
    assert len(snapshot.groups) == 3
    r = gflow.flow(problem, init, save=16, save_layers=True)
    along = gflow.trajectory_coupling(gflow.trajectory_models(r.trajectory), problem)
    assert along.coupled


def test_gram_matches_autodiff():
    import jax
    import jax.numpy as jnp

    problem = gflow.bernoulli(5, 4, 0.5, 1, key=2)
    model = gflow.gaussian([4, 3, 6, 5], 1.0, key=5)
    obs = gflow.analysis._coupling.observations(problem)
    jac = jax.jacrev(lambda f: f.product())(model)
    flat = jnp.concatenate([j.reshape(5, 4, -1) for j in jax.tree_util.tree_leaves(jac)], axis=-1)
    rows = flat[obs[:, 0], obs[:, 1]]
    np.testing.assert_allclose(gflow.gram(model, problem), rows @ rows.T, rtol=1e-12, atol=1e-13)


def test_zero_weights_are_flagged_as_singletons():
    model = gflow.Factorization([np.zeros((3, 3)), np.zeros((3, 3))])
    report = gflow.coupling(model, gflow.diagonal(3))
    assert len(report.flagged) == 3 and len(report.groups) == 3


# ---- certificates ------------------------------------------------------------------------


def test_energy_identity_and_balancedness_on_random_problem():
    problem = gflow.bernoulli(6, 6, 0.5, 2, key=4)
    init = gflow.gaussian([6, 6, 6, 6], 0.4, key=9)
    for clock in ("physical", "loss"):
        r = gflow.flow(problem, init, certificates=True, t_max=50.0, clock=clock)
        cert = gflow.certificates(r, init, problem)
        assert cert["energy_residual"] <= 1e-8, (clock, cert)
        assert cert["balancedness_drift"] <= 1e-9, (clock, cert)


def test_family_invariant_is_conserved_by_the_engine():
    problem = gflow.diagonal(3)
    init = gflow.identity_family(3, 4, 0.05, 4.0)
    r = gflow.flow(problem, init, t_max=1e3)
    before = gflow.family_eigenvalues(init, 3, 1)
    after = gflow.family_eigenvalues(r.model, 3, 1)
    i0 = gflow.family_invariant(4, before["A"][0], before["B"][0])
    i1 = gflow.family_invariant(4, after["A"][0], after["B"][0])
    np.testing.assert_allclose(i1, i0, rtol=1e-9)
