"""Initialisations of a Factorization, all seeded and validated."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import as_key, check_positive_int
from ._precision import default_dtype
from .model import Factorization


def identity_family(d: int, depth: int, alpha, m=math.inf, *, dtype=None) -> Factorization:
    """Every layer W_l(0) = α F_m with F_m = (1 − 1/m) I + (1/m) J (docs/theory.md §1).

    `m = inf` gives α I. `alpha` and `m` may be traced (for `vmap` over a grid); they are
    validated when concrete: α > 0, m > 1 (m = 1 gives a rank-1 J that stays rank 1).
    """
    _check_depth(depth)
    check_positive_int(d, "d")
    _check_alpha(alpha)
    if _concrete(m) and not (float(m) > 1):
        raise ValueError(f"m must be > 1 (m = inf allowed), got {m}")
    dtype = dtype or default_dtype()
    inv_m = 1.0 / jnp.asarray(m, dtype=dtype)
    f_m = (1.0 - inv_m) * jnp.eye(d, dtype=dtype) + inv_m * jnp.ones((d, d), dtype=dtype)
    w = jnp.asarray(alpha, dtype=dtype) * f_m
    return Factorization([w] * depth)


def gaussian(widths: Sequence[int], alpha, key, *, dtype=None) -> Factorization:
    """W_l = α · N(0, 1/d_in) entries, for widths d_0 … d_L (L = len(widths) − 1)."""
    widths = _check_widths(widths)
    _check_alpha(alpha)
    dtype = dtype or default_dtype()
    keys = jax.random.split(as_key(key), len(widths) - 1)
    # The same bits eagerly, jitted and vmapped (a sweep builds its inits vmapped): the scale
    # is rounded once, and the barrier keeps XLA from fusing (and so re-rounding) the normal
    # sampler into the product.
    layers = [
        jax.lax.optimization_barrier(jax.random.normal(k, (d_out, d_in), dtype=dtype))
        * (alpha * (1.0 / math.sqrt(d_in)))
        for k, d_in, d_out in zip(keys, widths[:-1], widths[1:], strict=True)
    ]
    return Factorization(layers)


def orthogonal(widths: Sequence[int], alpha, key, *, dtype=None) -> Factorization:
    """W_l = α Q_l with Q_l a Haar-random matrix with orthonormal rows or columns."""
    widths = _check_widths(widths)
    _check_alpha(alpha)
    dtype = dtype or default_dtype()
    keys = jax.random.split(as_key(key), len(widths) - 1)
    init = jax.nn.initializers.orthogonal()
    layers = [
        alpha * init(k, (d_out, d_in), dtype)
        for k, d_in, d_out in zip(keys, widths[:-1], widths[1:], strict=True)
    ]
    return Factorization(layers)


def load_init(path: str | os.PathLike, *, dtype=None) -> Factorization:
    """Load layers W_1 … W_L from `.npy` (a stack of L square matrices, shape (L, d, d)) or
    `.npz` (arrays named so that sorting their names orders them W_1 … W_L, e.g. `W1`, `W2`;
    natural order is used, so `W10` follows `W9`)."""
    dtype = dtype or default_dtype()
    path = os.fspath(path)
    if path.endswith(".npz"):
        with np.load(path) as data:
            names = sorted(data.files, key=_natural_key)
            layers = [np.asarray(data[k]) for k in names]
    else:
        stack = np.load(path)
        if stack.ndim != 3:
            raise ValueError(
                f"an .npy init must be a stack of L square matrices (L, d, d), got {stack.shape}"
            )
        layers = list(stack)
    for i, w in enumerate(layers):
        if not np.all(np.isfinite(w)):
            raise ValueError(f"layer {i + 1} in {path} has non-finite entries")
    return Factorization([jnp.asarray(w, dtype=dtype) for w in layers])


def _natural_key(name: str):
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_alpha(alpha):
    if _concrete(alpha):
        a = np.asarray(alpha)
        if not (np.all(np.isfinite(a)) and np.all(a > 0)):
            raise ValueError(f"alpha (init scale) must be finite and > 0, got {alpha}")


def _check_depth(depth):
    if not isinstance(depth, int | np.integer) or depth < 1:
        raise ValueError(f"depth L must be an integer >= 1, got {depth!r}")


def _check_widths(widths):
    widths = tuple(widths)
    if len(widths) < 2:
        raise ValueError(f"widths d_0 … d_L need at least 2 entries (depth >= 1), got {widths}")
    for w in widths:
        check_positive_int(w, "every width")
    return widths
