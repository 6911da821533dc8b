"""The problem and initial model of each grid point, built chunk by chunk."""

from __future__ import annotations

import functools

import jax
import numpy as np

from .._checks import seed_keys
from ..engine import pad_depth, stack
from ..inits import gaussian, identity_family, orthogonal
from ..problem import bernoulli, block_diagonal


def build(point: dict, problem_kind: str, init_kind: str, pad_to: int | None = None):
    """The (problem, model) of one grid point; with `pad_to`, the model is padded with
    identity layers to that depth (`pad_depth`)."""
    problem = _build_problem(point, problem_kind)
    d_out, d_in = problem.shape
    model = _init(init_kind, d_in, d_out, int(point["depth"]), pad_to)(
        int(point["seed"]), point["alpha"], point["m"]
    )
    return problem, model


def build_chunk(points: list[dict], problem_kind: str, init_kind: str, pad_to=None):
    """`build` for a chunk of points, stacked: what `build` gives point by point, without its
    per-point cost (many small dispatches, as much as a small flow). Problems are built
    once per distinct problem (a seed grid over a noiseless diagonal problem shares one);
    models of one depth in one jitted, vmapped call."""
    by_key: dict = {}
    problems = []
    for p in points:
        key = tuple(p[k] for k in _PROBLEM_FIELDS[problem_kind])
        if problem_kind == "bernoulli" or p["noise"] > 0:
            key += (p["seed"],)
        if key not in by_key:
            by_key[key] = _build_problem(p, problem_kind)
        problems.append(by_key[key])
    d_out, d_in = problems[0].shape
    depths = {int(p["depth"]) for p in points}
    if len(depths) == 1:
        seeds = np.array([int(p["seed"]) for p in points])
        alphas = np.array([float(p["alpha"]) for p in points])
        ms = np.array([float(p["m"]) for p in points])
        init = _init(init_kind, d_in, d_out, depths.pop(), pad_to)
        models = _vmapped(init)(seeds, alphas, ms)
    else:
        models = stack([build(p, problem_kind, init_kind, pad_to)[1] for p in points])
    return stack(problems), models


_PROBLEM_FIELDS = {
    "diagonal": ("dim", "value", "noise"),
    "block-diagonal": ("blocks", "block_size", "value", "noise"),
    "bernoulli": ("dim", "density", "rank", "noise"),
}


@functools.cache
def _init(init_kind: str, d_in: int, d_out: int, depth: int, pad_to: int | None):
    """(seed, alpha, m) ↦ the initial model of a grid point; traceable in all three."""

    def init(seed, alpha, m):
        k_init = seed_keys(seed)[1]
        if init_kind == "identity":
            model = identity_family(d_in, depth, alpha, m)
        elif init_kind == "gaussian":
            model = gaussian([d_in] + [d_out] * depth, alpha, k_init)
        else:
            model = orthogonal([d_in] + [d_out] * depth, alpha, k_init)
        return model if pad_to is None else pad_depth(model, pad_to)

    return init


@functools.cache
def _vmapped(init):
    return jax.jit(jax.vmap(init))


def _build_problem(point: dict, problem_kind: str):
    k_problem = seed_keys(int(point["seed"]))[0]
    if problem_kind == "diagonal":
        problem = block_diagonal(
            int(point["dim"]), 1, point["value"], noise=point["noise"], key=k_problem
        )
    elif problem_kind == "block-diagonal":
        problem = block_diagonal(
            int(point["blocks"]),
            int(point["block_size"]),
            point["value"],
            noise=point["noise"],
            key=k_problem,
        )
    else:
        d = int(point["dim"])
        problem = bernoulli(
            d, d, point["density"], int(point["rank"]), k_problem, noise=point["noise"]
        )
    return problem
