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
