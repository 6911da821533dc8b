"""The stiff tail's compensated (double-double) gradient: exact where float64 computes rounding,
the float64 derivative, the `auto` switch, and a flow that float64 cannot finish."""

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gflow
from gflow.engine import _compensated
from gflow.engine._compensated import compensated_loss_and_gradient
from gflow.model import Factorization, loss_and_gradient


def _exact_gradient(layers, target, mask):
    """∇loss in rational arithmetic from the float64 layers and target."""

    def rational(m):
        return [[Fraction(float(v)) for v in row] for row in np.asarray(m)]

    def matmul(a, b):
        return [
            [sum(a[i][k] * b[k][j] for k in range(len(b))) for j in range(len(b[0]))]
            for i in range(len(a))
        ]

    def transpose(a):
        return [list(row) for row in zip(*a, strict=True)]

    def identity(n):
        return [[Fraction(int(i == j)) for j in range(n)] for i in range(n)]

    ws = [rational(w) for w in layers]
    x = identity(len(ws[0][0]))
    for w in ws:
        x = matmul(w, x)
    y, m = rational(target), np.asarray(mask)
    r = [
        [x[i][j] - y[i][j] if m[i, j] else Fraction(0) for j in range(len(x[0]))]
        for i in range(len(x))
    ]
    gradient = []
    for j in range(len(ws)):
        below = identity(len(ws[0][0]))
        for w in ws[:j]:
            below = matmul(w, below)
        above = identity(len(ws[-1]))
        for w in reversed(ws[j + 1 :]):
            above = matmul(above, w)
        g = matmul(matmul(transpose(above), r), transpose(below))
        gradient.append(np.array([[float(v) for v in row] for row in g]))
    return gradient


def _rounding_state(depth=3, d=4, scale=3.0, seed=0, widths=None):
    """Layers (square d × d, or of `widths` from input to output), and a target equal on Ω to
    their float64 product: the float64 residual is 0 and so is its gradient, while the exact
    residual is the product's rounding."""
    rng = np.random.default_rng(seed)
    widths = widths or [d] * (depth + 1)
    layers = [
        jnp.asarray(scale * rng.normal(size=(n_out, n_in)))
        for n_in, n_out in zip(widths[:-1], widths[1:], strict=True)
    ]
    mask = jnp.asarray((rng.random((widths[-1], widths[0])) < 0.6).astype(np.float64))
    target = Factorization(layers).product()
    return layers, gflow.Problem(target, mask)


_exact = jax.jit(lambda m, p: compensated_loss_and_gradient(m, p, "always"))
_auto = jax.jit(lambda m, p: compensated_loss_and_gradient(m, p, "auto"))
_float = jax.jit(loss_and_gradient)


@pytest.mark.parametrize("widths", [None, [4, 6, 5, 3]], ids=["square", "rectangular"])
def test_the_compensated_gradient_is_exact_where_float64_computes_only_rounding(widths):
    layers, problem = _rounding_state(widths=widths)
    exact = _exact_gradient(layers, problem.target, problem.mask)
    _, plain = _float(Factorization(layers), problem)
    _, compensated = _exact(Factorization(layers), problem)
    for e, p, c in zip(exact, plain.layers, compensated.layers, strict=True):
        size = np.linalg.norm(e)
        assert size > 0
        assert np.linalg.norm(np.asarray(p) - e) > 0.5 * size  # float64: rounding only
        np.testing.assert_allclose(np.asarray(c), e, rtol=1e-15, atol=1e-15 * size)


def test_the_compensated_gradient_agrees_with_float64_on_an_ordinary_state():
    rng = np.random.default_rng(1)
    layers = [jnp.asarray(rng.normal(size=s)) for s in [(5, 4), (6, 5), (3, 6)]]
    problem = gflow.Problem(
        jnp.asarray(rng.normal(size=(3, 4))), jnp.asarray(rng.random((3, 4)) < 0.7)
    )
    model = Factorization(layers)
    loss, plain = _float(model, problem)
    loss_c, compensated = _exact(model, problem)
    np.testing.assert_allclose(float(loss_c), float(loss), rtol=1e-14)
    for p, c in zip(plain.layers, compensated.layers, strict=True):
        np.testing.assert_allclose(np.asarray(c), np.asarray(p), rtol=1e-12, atol=1e-13)


def test_auto_compensates_only_where_rounding_may_be_a_share_of_the_gradient():
    layers, problem = _rounding_state()
    _, auto = _auto(Factorization(layers), problem)
    _, compensated = _exact(Factorization(layers), problem)
    for a, c in zip(auto.layers, compensated.layers, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    # one unit of residual on every observed entry: the gradient is far above its rounding
    shifted = gflow.Problem(problem.target + 1.0, problem.mask)
    _, auto = _auto(Factorization(layers), shifted)
    _, plain = _float(Factorization(layers), shifted)
    for a, p in zip(auto.layers, plain.layers, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(p))


def test_auto_leaves_wide_factorisations_to_float64():
    wide = Factorization([jnp.ones((_compensated.MAX_WIDTH + 1, 2)), jnp.ones((2, 33))])
    assert not _compensated.applies("auto", wide)
    assert _compensated.applies("always", wide)
    assert not _compensated.applies("never", Factorization([jnp.ones((2, 2))]))


def test_the_compensated_gradients_derivative_is_the_float64_hessian():
    layers, problem = _rounding_state(seed=2)
    model = Factorization(layers)
    rng = np.random.default_rng(3)
    v = Factorization([jnp.asarray(rng.normal(size=w.shape)) for w in layers])

    def hvp(mode):
        field = lambda m: compensated_loss_and_gradient(m, problem, mode)[1]  # noqa: E731
        return jax.jvp(field, (model,), (v,))[1]

    plain = jax.jvp(lambda m: loss_and_gradient(m, problem)[1], (model,), (v,))[1]
    for mode in ("always", "auto"):
        for a, b in zip(hvp(mode).layers, plain.layers, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-13, atol=1e-12)


def test_compensated_gradient_option_is_checked_and_read_by_the_tail_only():
    with pytest.raises(ValueError, match="compensated_gradient"):
        gflow.FlowOptions(compensated_gradient="yes")
    with pytest.raises(ValueError, match="compensated_gradient"):
        gflow.FlowOptions(compensated_gradient=1)
    with pytest.raises(ValueError, match="no tail"):
        gflow.FlowOptions(solver="dopri5", compensated_gradient=True)
    assert gflow.FlowOptions(compensated_gradient=True).compensated_mode == "always"
    assert gflow.FlowOptions(compensated_gradient=False).compensated_mode == "never"
    assert gflow.FlowOptions(compensated_gradient=False).head() == gflow.FlowOptions()


@pytest.mark.slow
@pytest.mark.parametrize("point", [(5, 1e-4, 1), (5, 3e-4, 0)])
def test_auto_ends_where_a_gradient_compensated_at_every_evaluation_ends(point):
    """Two of the 112-flow sweep's saddle plateaus that float64 leaves only by rounding (out of
    100k tail steps, or 95k): compensated where the bound says so, or everywhere, the flow
    converges to the same rank-2 endpoint (test_stiff's rounding-floor test has a plateau
    float64 does not leave)."""
    from benchmarks.runoff import sweep_point

    problem, init = sweep_point(*point)
    ends = []
    for mode in ("auto", True):
        options = gflow.FlowOptions(rtol=1e-10, max_steps=100_000, compensated_gradient=mode)
        result = gflow.flow(problem, init, options)
        assert result.status == gflow.Status.CONVERGED
        assert result.work()["stiff tail"]["steps"] < 5_000
        ends.append(np.asarray(gflow.singular_values(result.model)))
    assert ends[0][1] > 1.0 and ends[0][2] < 1e-12  # the second direction escaped
    np.testing.assert_allclose(ends[0][:2], ends[1][:2], rtol=1e-9)
