"""Discrete optimizers against the flow and against docs/theory.md §8–9."""

import math
import os
import runpy
from pathlib import Path

import numpy as np
import optax
import pytest

import gflow

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def random_case():
    problem = gflow.bernoulli(5, 5, 0.6, 1, key=3)
    init = gflow.gaussian([5] * 4, 0.7, key=4)
    return problem, init, gflow.flow(problem, init)


def test_sgd_equals_euler_flow_to_roundoff():
    problem = gflow.bernoulli(6, 6, 0.6, 1, key=1)
    init = gflow.gaussian([6] * 4, 0.5, key=2)
    lr, k = 0.01, 300
    gd = gflow.descend(problem, init, lr=lr, t_max=k * lr)
    euler = gflow.flow(problem, init, solver="euler", dt=lr, t_max=k * lr)
    assert int(gd.num_steps) == k and gd.status_label == "t_max"
    assert euler.status_label == "t_max"
    for a, b in zip(gd.model.layers, euler.model.layers, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-14)


def test_custom_optax_transformation_matches_preset():
    problem, init = gflow.diagonal(3), gflow.identity_family(3, 3, 0.3, 4.0)
    a = gflow.descend(problem, init, lr=0.02, t_max=2.0)
    b = gflow.descend(problem, init, optimizer=optax.sgd(0.02), lr=0.02, t_max=2.0)
    np.testing.assert_array_equal(np.asarray(a.model.layers[0]), np.asarray(b.model.layers[0]))


def test_gd_bias_on_identity_family_matches_theory():
    """docs/theory.md §8: L = 3, n = s = 2, α = 0.1, η = 0.05 → σ_B = 1.875e-3 (flow 1.781e-3)."""
    problem, init = gflow.block_diagonal(2, 2), gflow.identity_family(4, 3, 0.1, 4.0)
    gd = gflow.descend(problem, init, lr=0.05, t_max=2000.0)
    assert gd.status_label == "t_max"  # the C modes decay only algebraically
    np.testing.assert_allclose(
        gflow.family_spectrum(gd.model, 2, 2)["sigma_b"], 1.875e-3, rtol=1e-3
    )
    flow_limit = gflow.family_limit(3, 2, 2, 0.1, 4.0)
    np.testing.assert_allclose(float(flow_limit.sigma_b), 1.781e-3, rtol=1e-3)


def test_depth2_gd_limit_is_independent_of_the_step():
    problem = gflow.diagonal(4)
    init = gflow.identity_family(4, 2, 0.1, 4.0)
    limit = gflow.family_limit(2, 4, 1, 0.1, 4.0)
    for lr in (0.01, 0.05, 0.1):
        gd = gflow.descend(problem, init, lr=lr, rtol=1e-12)
        assert gd.status_label == "converged"
        spec = gflow.family_spectrum(gd.model, 4, 1)
        np.testing.assert_allclose(spec["sigma_b"], limit.sigma_b, rtol=1e-9)


def test_endpoint_error_and_balancedness_drift_scale_like_lr(random_case):
    problem, init, flow = random_case
    lrs = [0.04, 0.02, 0.01]
    errors, drifts = [], []
    for lr in lrs:
        gd = gflow.descend(problem, init, lr=lr)
        assert gd.status_label == "converged"
        errors.append(gflow.endpoint_distance(gd, flow, problem)["singular_values"])
        drifts.append(gflow.balancedness_drift(init, gd.model))
    assert 0.9 <= gflow.loglog_slope(lrs, errors) <= 1.1
    assert 0.9 <= gflow.loglog_slope(lrs, drifts) <= 1.1


def test_balancedness_changes_by_exactly_eta_squared_term_per_step():
    """D^{k+1} − D^k = η²(G_{l+1}ᵀG_{l+1} − G_l G_lᵀ) (docs/theory.md §9)."""
    problem = gflow.bernoulli(4, 4, 0.7, 1, key=5)
    init = gflow.gaussian([4, 4, 4, 4], 0.6, key=6)
    lr = 0.03
    one = gflow.descend(problem, init, lr=lr, t_max=lr)
    g = [np.asarray(x) for x in init.gradient(problem).layers]
    d0, d1 = gflow.balancedness(init), gflow.balancedness(one.model)
    for i in range(len(d0)):
        predicted = lr**2 * (g[i + 1].T @ g[i + 1] - g[i] @ g[i].T)
        np.testing.assert_allclose(d1[i] - d0[i], predicted, rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("name", sorted(gflow.OPTIMIZERS))
def test_every_preset_runs_and_reports_a_status(name):
    problem, init = gflow.diagonal(3), gflow.identity_family(3, 3, 0.3, 4.0)
    r = gflow.descend(problem, init, optimizer=name, lr=1e-3, max_steps=500, save_every=100)
    assert r.status_label in ("converged", "max_steps")
    assert float(r.loss) < float(r.loss_init)
    traj = r.trajectory.compress()
    np.testing.assert_allclose(traj.t, 1e-3 * np.arange(0, int(r.num_steps) + 1, 100))


def test_diverging_learning_rate_is_a_status():
    problem, init = gflow.diagonal(3), gflow.identity_family(3, 3, 0.5, 4.0)
    r = gflow.descend(problem, init, lr=5.0)
    assert r.status_label == "diverged"


def test_descent_options_validation():
    with pytest.raises(ValueError, match="optimizer"):
        gflow.DescentOptions(optimizer="lion")
    with pytest.raises(ValueError, match="lr"):
        gflow.DescentOptions(lr=-1.0)
    with pytest.raises(ValueError, match="lr"):
        gflow.DescentOptions(lr=math.inf)


def test_flow_vs_gd_notebook_runs_small(tmp_path, monkeypatch):
    monkeypatch.setenv("GFLOW_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("GFLOW_NOTEBOOK_OUT", str(tmp_path))
    runpy.run_path(os.fspath(ROOT / "notebooks" / "flow_vs_gd.py"), run_name="__main__")
    assert (tmp_path / "flow_vs_gd_error.png").stat().st_size > 10_000
    assert (tmp_path / "flow_vs_gd_rank.png").stat().st_size > 10_000
