"""Matrix-completion problems: a target matrix and the 0/1 mask of its observed entries."""

from __future__ import annotations

import math
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ._checks import as_key, check_finite, check_positive_int
from ._precision import default_dtype


class Problem(eqx.Module):
    """A matrix-completion problem: fit `target` on the entries where `mask == 1`.

    The loss of a prediction X is ½ Σ_{(i,j)∈Ω} (X_ij − target_ij)².

    **Arguments:**

    - `target`: the ground-truth matrix, shape `(d_out, d_in)`. Unobserved entries are only
      used to measure the completion error, never by the flow: where they are unknown (real
      data), set them to nan.
    - `mask`: a 0/1 matrix of the same shape; 1 marks an observed entry.

    **Raises:** `ValueError` for unequal shapes, a non-2D target, non-finite observed targets,
    a mask that is not 0/1, or an empty mask.
    """

    target: Float[Array, "d_out d_in"]
    mask: Float[Array, "d_out d_in"]

    def __init__(self, target, mask, *, dtype=None):
        dtype = dtype or default_dtype()
        target = jnp.asarray(target, dtype=dtype)
        mask = jnp.asarray(mask, dtype=dtype)
        if target.ndim != 2:
            raise ValueError(f"target must be a 2-D matrix, got shape {target.shape}")
        if mask.shape != target.shape:
            raise ValueError(f"mask shape {mask.shape} does not match target shape {target.shape}")
        if not _is_tracer(mask):
            m = np.asarray(mask)
            if not np.all((m == 0) | (m == 1)):
                raise ValueError("mask must contain only 0 and 1")
            if not m.any():
                raise ValueError("mask is empty: at least one entry must be observed")
            if not np.all(np.isfinite(np.asarray(target)[m == 1])):
                raise ValueError("target has non-finite (nan/inf) values on observed entries")
        self.target = target
        self.mask = mask

    @property
    def shape(self) -> tuple[int, int]:
        return self.target.shape

    @property
    def num_observed(self) -> int:
        return int(np.asarray(self.mask).sum())

    @property
    def observed_target(self) -> Float[Array, "d_out d_in"]:
        """M ∘ X*: the target on the observed entries, 0 on the others (which may be nan)."""
        return jnp.where(self.mask == 1, self.target, 0.0)

    def residual(self, x: Float[Array, "d_out d_in"]) -> Float[Array, "d_out d_in"]:
        """R = M ∘ (X − X*), 0 off Ω whatever the target holds there."""
        return jnp.where(self.mask == 1, x - self.target, 0.0)

    def loss(self, x: Float[Array, "d_out d_in"]) -> Float[Array, ""]:
        """½ Σ_Ω (X − X*)²."""
        return 0.5 * jnp.sum(self.residual(x) ** 2)

    def with_mask(self, mask) -> Problem:
        """The same target observed on another mask."""
        return Problem(self.target, mask, dtype=self.target.dtype)


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def diagonal(d: int, value: float = 1.0, *, noise: float = 0.0, key=None, dtype=None) -> Problem:
    """Ground truth `value·J` (d×d, all entries equal), only the diagonal observed."""
    return block_diagonal(d, 1, value, noise=noise, key=key, dtype=dtype)


def block_diagonal(
    n: int, s: int, value: float = 1.0, *, noise: float = 0.0, key=None, dtype=None
) -> Problem:
    """Ground truth `value·J` (d×d with d = n·s); the n diagonal s×s blocks are observed.

    This is the setting of Shin & Yun (2026): observations disconnected into n blocks.
    """
    check_positive_int(n, "n (number of blocks)")
    check_positive_int(s, "s (block size)")
    check_finite(value, "value")
    d = n * s
    mask = np.kron(np.eye(n), np.ones((s, s)))
    target = np.full((d, d), float(value))
    return _with_noise(Problem(target, mask, dtype=dtype), noise, key)


def bernoulli(
    d_out: int,
    d_in: int,
    p: float,
    rank: int,
    key,
    *,
    noise: float = 0.0,
    dtype=None,
) -> Problem:
    """Random rank-`rank` ground truth U Vᵀ (Gaussian factors scaled so entries are O(1)),
    each entry observed independently with probability `p` (redrawn if nothing is observed)."""
    check_positive_int(d_out, "d_out")
    check_positive_int(d_in, "d_in")
    check_positive_int(rank, "rank")
    if not 0.0 < p <= 1.0:
        raise ValueError(f"density p must lie in (0, 1], got {p}")
    if rank > min(d_out, d_in):
        raise ValueError(f"rank {rank} exceeds min(d_out, d_in) = {min(d_out, d_in)}")
    key = as_key(key)
    ku, kv, km, kn = jax.random.split(key, 4)
    dtype = dtype or default_dtype()
    u = jax.random.normal(ku, (d_out, rank), dtype=dtype)
    v = jax.random.normal(kv, (d_in, rank), dtype=dtype)
    target = u @ v.T / math.sqrt(rank)
    for attempt in range(100):
        mask = jax.random.bernoulli(jax.random.fold_in(km, attempt), p, (d_out, d_in))
        if bool(mask.any()):
            break
    return _with_noise(Problem(target, mask, dtype=dtype), noise, kn)


def load_problem(target_path: str | os.PathLike, mask_path: str | os.PathLike, *, dtype=None):
    """Load a problem from two `.npy` files (target and 0/1 mask)."""
    target = np.load(target_path)
    mask = np.load(mask_path)
    return Problem(target, mask, dtype=dtype)


def _with_noise(problem: Problem, noise: float, key) -> Problem:
    if noise < 0 or not math.isfinite(noise):
        raise ValueError(f"noise must be a finite non-negative std, got {noise}")
    if noise == 0:
        return problem
    eps = noise * jax.random.normal(as_key(key), problem.shape, dtype=problem.target.dtype)
    return Problem(problem.target + problem.mask * eps, problem.mask, dtype=problem.target.dtype)
