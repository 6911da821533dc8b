"""The loss and gradient in double-double arithmetic (docs/theory.md §5, "the compensated
gradient"), for the stiff tail where float64 rounding in the gradient decides the flow; and
bounds on that rounding.

Each layer gradient is a product of partial products, A_lᵀ R B_lᵀ, whose terms are of size
~|A_l||R||B_l| while the gradient itself can be 1e-12 of that (a flow on a saddle plateau, or one
whose top singular value runs off): float64 then computes rounding instead of the gradient.
Here every product and the residual are carried as unevaluated sums hi + lo of two floats
(Dekker's and Knuth's error-free transformations: ~32 significant digits), and only the result
is rounded to float64. The layers themselves stay float64: they are the state.

Only the vector field's value is compensated: its derivative (the Hessian-vector products and
closed-form Hessians of the stiff solvers) is the float64 one, which is accurate to rounding
relative to the Hessian's own size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..model import Factorization, loss_and_gradient

ROUNDING_SHARE = 1e-3
"""`auto` compensates where a bound on the float64 gradient's rounding
(`rounding_share_exceeds`) is at least this share of the gradient."""

MAX_WIDTH = 32
"""`auto` compensates only where every width of the factorisation is at most this: a
double-double product costs ~40 float operations per multiply-add, without BLAS."""


def gradient_rounding(model: Factorization, problem, layer_mask) -> Factorization:
    """A bound, per parameter, on the float rounding in the computed gradient: the unit roundoff
    times the gradient formula evaluated on absolute values, ε·|A_l|ᵀ ρ |B_l|ᵀ with A_l, B_l
    the products of |W| above and below layer l and ρ = |R| + M∘(|X*| + 2·|W_L|⋯|W_1|) (the
    residual and what rounding in X and in X − X* adds to it). Where the true gradient is a
    cancellation of such terms (directions the flow has converged in, or the symmetries of the
    factorisation) the computed one is this rounding and nothing else."""
    absolute = tuple(jnp.abs(w) for w in model.layers)
    envelope = Factorization(absolute).product()
    rho = jnp.abs(problem.residual(model.product())) + problem.mask * (
        jnp.abs(problem.observed_target) + 2.0 * envelope
    )
    _, pullback = jax.vjp(lambda layers: Factorization(layers).product(), absolute)
    (bound,) = pullback(rho.astype(envelope.dtype))
    eps = jnp.finfo(envelope.dtype).eps
    weights = [1.0] * model.depth if layer_mask is None else list(layer_mask)
    return Factorization(tuple(eps * w * b for w, b in zip(weights, bound, strict=True)))


_SPLITTER = 134217729.0  # 2**27 + 1: Dekker's split of a float64 into two 26-bit halves


def _two_sum(a, b):
    s = a + b
    v = s - a
    return s, (a - (s - v)) + (b - v)


def _fast_two_sum(a, b):  # |a| ≥ |b|
    s = a + b
    return s, b - (s - a)


def _split(a):
    t = _SPLITTER * a
    hi = t - (t - a)
    return hi, a - hi


def _two_product(a, b):
    p = a * b
    a_hi, a_lo = _split(a)
    b_hi, b_lo = _split(b)
    return p, ((a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo


def dd_add(a, b):
    """(hi, lo) + (hi, lo), to ~2⁻¹⁰⁴ relative."""
    s, e = _two_sum(a[0], b[0])
    t, f = _two_sum(a[1], b[1])
    s, e = _fast_two_sum(s, e + t)
    return _fast_two_sum(s, e + f)


def _sum_pairs(a, b):
    """(hi, lo) + (hi, lo) with the lows added in float: as accurate as `dd_add` for a sum
    (Ogita, Rump and Oishi's Sum2), and cheaper."""
    s, e = _two_sum(a[0], b[0])
    return s, e + (a[1] + b[1])


def _product_pairs(a, b):
    """The elementwise products a·b of a float or (hi, lo) `a` (m × k) and a (hi, lo) `b`
    (k × n), as (m × k × n) pairs."""
    a_hi, a_lo = a if isinstance(a, tuple) else (a, None)
    x, y = a_hi[:, :, None], b[0][None]
    xh, xl = (part[:, :, None] for part in _split(a_hi))
    yh, yl = (part[None] for part in _split(b[0]))
    p = x * y
    low = ((xh * yh - p) + xh * yl + xl * yh) + xl * yl + x * b[1][None]
    if a_lo is not None:
        low = low + a_lo[:, :, None] * y
    return p, low


def dd_matmul(a, b):
    """(m × k)·(k × n), `a` a float or (hi, lo) matrix, `b` a (hi, lo) one: the k products
    error-free, summed by one variadic reduction (any order XLA picks is as accurate)."""
    zero = jnp.zeros((), b[0].dtype)
    hi, lo = jax.lax.reduce(_product_pairs(a, b), (zero, zero), _sum_pairs, (1,))
    return _fast_two_sum(hi, lo)


def _pair(x):
    return x, jnp.zeros_like(x)


def _compensated(layers, problem):
    if len(layers) > 2 and len({w.shape for w in layers}) == 1:
        return _compensated_square(layers, problem)
    depth = len(layers)
    below = [None] * depth  # W_{k-1}⋯W_1 (None: the identity)
    product = None
    for k in range(depth):
        below[k] = product
        product = _pair(layers[k]) if product is None else dd_matmul(layers[k], product)
    gradient = [None] * depth
    loss, above = _residual(product, problem)  # then (W_L⋯W_{k+1})ᵀ R
    for k in reversed(range(depth)):
        if k < depth - 1:
            above = dd_matmul(layers[k + 1].T, above)
        g = above if below[k] is None else dd_matmul(above, (below[k][0].T, below[k][1].T))
        gradient[k] = g[0] + g[1]
    return loss, tuple(gradient)


def _residual(product, problem):
    residual = dd_add(product, _pair(-problem.observed_target))
    residual = tuple(jnp.where(problem.mask == 1, part, 0.0) for part in residual)
    return 0.5 * jnp.sum((residual[0] + residual[1]) ** 2), residual


def _compensated_square(layers, problem):
    """The same for layers of one square shape, the chains as `lax.scan`s: one product's code
    each, however deep (a tail program holds this at every evaluation of its field)."""
    stack = jnp.stack(layers)

    def down(product, w):  # W_k ⋯ W_1 from W_{k-1} ⋯ W_1
        product = dd_matmul(w, product)
        return product, product

    product, below = jax.lax.scan(down, _pair(stack[0]), stack[1:])
    loss, residual = _residual(product, problem)

    def up(above, w):  # (W_L ⋯ W_k)ᵀ R from (W_L ⋯ W_{k+1})ᵀ R
        above = dd_matmul(w.T, above)
        return above, above

    _, above = jax.lax.scan(up, residual, stack[1:], reverse=True)
    # gradient k = (W_L⋯W_{k+1})ᵀ R (W_{k−1}⋯W_1)ᵀ: the first factors are `above` (k < L)
    # and R; the second, W_1 and `below` but its last (k > 1)
    firsts = tuple(jnp.concatenate([a, r[None]]) for a, r in zip(above, residual, strict=True))
    seconds = tuple(
        jnp.concatenate([w[None], b[:-1]]) for w, b in zip(_pair(stack[0]), below, strict=True)
    )
    seconds = jax.vmap(lambda ah, al, bh, bl: dd_matmul((ah, al), (bh.T, bl.T)))(
        firsts[0][1:], firsts[1][1:], seconds[0], seconds[1]
    )
    gradient = [firsts[0][0] + firsts[1][0]]
    gradient += list(seconds[0] + seconds[1])
    return loss, tuple(gradient)


def _float(layers, problem):
    value, gradient = loss_and_gradient(Factorization(list(layers)), problem)
    return value, tuple(gradient.layers)


def rounding_share_exceeds(layers, loss, gradient, problem, layer_mask, share):
    """Whether the float64 gradient's rounding may be `share` of it: a bound like
    `gradient_rounding`'s in Frobenius norms, ε·∏_{k≠l}‖W_k‖·(‖R‖ + ‖M∘X*‖ + 2∏_k‖W_k‖) for
    layer l (‖R‖ = √(2·loss)), against `share`·‖∇loss‖ over the trainable layers. It costs
    the layers' norms only; it can overstate the rounding by about a width."""
    weights = [1.0] * len(layers) if layer_mask is None else list(layer_mask)
    norms = [jnp.sqrt(jnp.sum(w**2)) for w in layers]
    whole = functools.reduce(jnp.multiply, norms)
    rho = jnp.sqrt(2.0 * loss) + jnp.sqrt(jnp.sum(problem.observed_target**2)) + 2.0 * whole
    eps = jnp.finfo(layers[0].dtype).eps
    noise, size = 0.0, 0.0
    for k, (w, g) in enumerate(zip(weights, gradient, strict=True)):
        others = functools.reduce(jnp.multiply, norms[:k] + norms[k + 1 :], jnp.ones(()))
        noise = noise + w * (eps * others * rho) ** 2
        size = size + w * jnp.sum(g**2)
    return noise >= share**2 * size


def _choose(layers, problem, layer_mask, share, value, gradient):
    if share is None:
        return _compensated(layers, problem)
    return jax.lax.cond(
        rounding_share_exceeds(layers, value, gradient, problem, layer_mask, share),
        lambda: _compensated(layers, problem),
        lambda: (value, gradient),
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _loss_and_gradient(layers, problem, layer_mask, share):
    if share is None:
        return _compensated(layers, problem)
    value, gradient = _float(layers, problem)
    return _choose(layers, problem, layer_mask, share, value, gradient)


@_loss_and_gradient.defjvp
def _loss_and_gradient_jvp(share, primals, tangents):
    layers, problem, layer_mask = primals
    (value, gradient), tangent = jax.jvp(lambda ls: _float(ls, problem), (layers,), (tangents[0],))
    return _choose(layers, problem, layer_mask, share, value, gradient), tangent


def applies(mode: str, model: Factorization) -> bool:
    """Whether `mode` may compensate on this model: `always`, or `auto` on a small one."""
    return mode == "always" or (mode == "auto" and max(model.widths) <= MAX_WIDTH)


def compensated_loss_and_gradient(model: Factorization, problem, mode="always", layer_mask=None):
    """(loss, ∇loss) with the products in double-double arithmetic: `always`, or (`auto`) where
    the float64 gradient's rounding bound is at least `ROUNDING_SHARE` of it (over trainable
    layers: `layer_mask`) on a model whose widths are all ≤ `MAX_WIDTH`; else, and with
    `never`, the float64 gradient. Its derivative is the float64 gradient's. Frozen layers'
    gradients are not masked here."""
    if not applies(mode, model):
        return loss_and_gradient(model, problem)
    share = None if mode == "always" else ROUNDING_SHARE
    value, gradient = _loss_and_gradient(tuple(model.layers), problem, layer_mask, share)
    return value, Factorization(list(gradient))
