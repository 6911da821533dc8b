"""Argument checks shared by the builders, and the one seed → key scheme of gflow."""

from __future__ import annotations

import math

import jax
import numpy as np


def check_positive_int(x, name: str) -> None:
    if not isinstance(x, int | np.integer) or isinstance(x, bool) or x < 1:
        raise ValueError(f"{name} must be a positive integer, got {x!r}")


def check_finite(x, name: str) -> None:
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x!r}")


def as_key(key) -> jax.Array:
    """A PRNG key from a key or an integer seed (`jax.random.key(seed)`); None is an error."""
    if key is None:
        raise ValueError("a PRNG key (or integer seed) is required")
    if isinstance(key, int | np.integer):
        return jax.random.key(int(key))
    return key


def seed_keys(seed: int) -> tuple[jax.Array, jax.Array]:
    """The keys a seed stands for everywhere in gflow (API examples, `gflow run --seed`, sweeps'
    `seed` axis): `(problem_key, init_key) = jax.random.split(jax.random.key(seed))`. The same
    seed gives the same random problem (mask, target, noise) and the same random init."""
    if not isinstance(seed, jax.core.Tracer):  # sweeps build their inits traced over seeds
        if not isinstance(seed, int | np.integer) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        seed = int(seed)
    problem_key, init_key = jax.random.split(jax.random.key(seed))
    return problem_key, init_key
