"""The stiff tail: Rodas4 (dense and matrix-free) against known solutions and the explicit path."""

import diffrax
import jax.numpy as jnp
import numpy as np
import pytest

import gflow
from gflow._rosenbrock import Rodas4


@pytest.mark.parametrize("linear_solver", ["dense", "cg"])
def test_rodas4_on_a_stiff_linear_system(linear_solver):
    """y' = −A y with eigenvalues 1e-3 … 1e4: exact solution Q e^{−Λt} Qᵀ y0."""
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.normal(size=(20, 20)))
    lam = np.geomspace(1e-3, 1e4, 20)
    a = jnp.asarray(q @ np.diag(lam) @ q.T)
    y0 = jnp.asarray(rng.normal(size=20))
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(lambda t, y, args: -a @ y),
        Rodas4(linear_solver=linear_solver),
        0.0,
        1.0,
        None,
        y0,
        stepsize_controller=diffrax.PIDController(rtol=1e-8, atol=1e-10),
        saveat=diffrax.SaveAt(t1=True, solver_state=True),
        max_steps=10_000,
    )
    exact = q @ (np.exp(-lam) * (q.T @ np.asarray(y0)))
    np.testing.assert_allclose(np.asarray(sol.ys[-1]), exact, atol=1e-8)
    iters = int(sol.solver_state["iters"])
    assert (iters > 0) == (linear_solver == "cg")


def test_rodas4_is_fourth_order():
    """Fixed steps on y' = −y²: the error falls like h⁴."""
    errors = []
    for n in (8, 16, 32):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(lambda t, y, args: -(y**2)),
            Rodas4(linear_solver="dense"),
            0.0,
            2.0,
            2.0 / n,
            jnp.asarray([1.0]),
            stepsize_controller=diffrax.ConstantStepSize(),
        )
        errors.append(abs(float(sol.ys[-1, 0]) - 1.0 / 3.0))
    orders = np.log2(np.array(errors[:-1]) / np.array(errors[1:]))
    assert np.all(orders > 3.7), orders


def test_auto_strategy_finishes_a_stiff_tail_that_stalls_tsit5():
    problem = gflow.bernoulli(8, 8, 0.4, 1, key=0)
    init = gflow.gaussian([8] * 4, 0.05, key=1)
    explicit = gflow.flow(problem, init, solver="tsit5", max_steps=20_000)
    assert explicit.status_label == "max_steps"
    auto = gflow.flow(problem, init)
    assert auto.status_label == "converged"
    assert float(auto.loss) <= 1e-20 * float(auto.loss_init)
    reference = gflow.flow(problem, init, solver="rodas4", rtol=1e-12)
    assert reference.status_label == "converged"
    err = gflow.endpoint_distance(auto, reference, problem)
    s = gflow.singular_values(reference.model)
    top = int(np.sum(s >= 1e-5 * s[0]))
    assert gflow.endpoint_distance(auto, reference, problem, top=top)["singular_values"] <= 1e-6
    assert err["unobserved"] <= 1e-6


# Random-mask flows against diffrax's Kvaerno5 (dense Jacobian) at rtol 1e-11: an independent
# stiff integrator, about a minute per case, hence slow. (d, L, α, p) span issue 4's ranges.
# All take the dense path (P ≤ 2,000). Forcing CG here ("cg") is not a case yet: on (8, 3, 0.05,
# 0.4) it ran > 10 minutes (saddle directions make CG meet negative curvature; see issue 4).
KVAERNO_CASES = [
    (8, 2, 0.5, 0.3, "auto"),
    (8, 3, 0.05, 0.4, "auto"),
    (10, 3, 0.2, 0.5, "auto"),
    (8, 4, 0.1, 0.6, "auto"),
]


@pytest.mark.slow
@pytest.mark.parametrize("d,depth,alpha,density,linear_solver", KVAERNO_CASES)
def test_auto_matches_kvaerno5_reference(d, depth, alpha, density, linear_solver):
    problem = gflow.bernoulli(d, d, density, 1, key=0)
    init = gflow.gaussian([d] * (depth + 1), alpha, key=1)
    reference = gflow.flow(problem, init, solver="kvaerno5", rtol=1e-11)
    assert reference.status_label == "converged"
    # The loss left when the stopping rule fires is about rtol² of the initial loss, so the
    # issue's 1e-20 needs the reference's rtol (at the default 1e-10 it is ~1e-20 ± a factor).
    auto = gflow.flow(problem, init, rtol=1e-11, linear_solver=linear_solver)
    assert auto.status_label == "converged"
    assert float(auto.loss) <= 1e-20 * float(auto.loss_init)
    if linear_solver == "cg":
        assert int(auto.num_linear_iters) > 0
    s = gflow.singular_values(reference.model)
    top = int(np.sum(s >= 1e-5 * s[0]))
    default = gflow.flow(problem, init, linear_solver=linear_solver)  # default rtol
    for run in (auto, default):
        err = gflow.endpoint_distance(run, reference, problem, top=top)["singular_values"]
        assert err <= 1e-6, err
