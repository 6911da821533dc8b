"""How many digits of an endpoint are real: rerun the flow from slightly perturbed inits
(docs/theory.md §9).

Certificates bound the integration error along the computed path; they cannot see whether the
endpoint itself depends on rounding-sized changes of the state (a flow passing an unstable
invariant set, such as the identity family with s > 1 while mode C decays). Perturbing the
initialisation at relative size ε and integrating again can: the spread of each endpoint
quantity over the perturbed flows says how many of its digits are reproducible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ._measures import (
    effective_rank_of,
    family_spectrum,
    singular_values,
    stable_rank_excess_of,
    stable_rank_of,
    unobserved_error,
)

MAX_DIGITS = 15  # float64 carries 15–16 significant digits; no spread reads as this many


def reproducible_digits(values) -> int:
    """Significant digits shared by `values`: ⌊−log₁₀(spread / |median|)⌋, from 0 to 15."""
    values = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(values)):
        return 0
    scale = abs(float(np.median(values)))
    spread = float(values.max() - values.min())
    if spread == 0.0:
        return MAX_DIGITS
    if scale == 0.0:
        return 0
    return int(min(MAX_DIGITS, max(0, math.floor(-math.log10(spread / scale)))))


@dataclass(frozen=True)
class Sensitivity:
    """Endpoint quantities of one flow and of `k` flows from perturbed inits.

    - `values[name]`: one value per member, member 0 unperturbed (the flow `flow` returns);
    - `statuses`: each member's status label; a quantity is judged only when all converged;
    - `digits[name]`: reproducible significant digits (`reproducible_digits`), None where a
      member did not converge;
    - `below_svd_floor`: singular values under the SVD's 1e-15·σ₁ resolution (their digits
      are rounding, whatever the flow does; a family's σ's come from the layers instead);
    - `result`: the batched `FlowResult` (`result.member(0)` is the unperturbed flow).
    """

    eps: float
    statuses: list[str]
    values: dict[str, np.ndarray]
    digits: dict[str, int | None]
    below_svd_floor: list[str] = field(default_factory=list)
    result: object = field(default=None, repr=False, compare=False)

    @property
    def all_converged(self) -> bool:
        return all(s == "converged" for s in self.statuses)

    def spread(self, name: str) -> float:
        v = self.values[name]
        return float(v.max() - v.min())

    def rows(self) -> list[dict]:
        """One row per quantity: value (unperturbed), spread, relative spread, digits."""
        out = []
        for name, v in self.values.items():
            value = float(v[0])
            spread = self.spread(name)
            out.append(
                {
                    "quantity": name,
                    "value": value,
                    "spread": spread,
                    "relative_spread": spread / abs(value) if value else math.inf,
                    "digits": self.digits[name],
                    "below_svd_floor": name in self.below_svd_floor,
                }
            )
        return out

    def format(self) -> str:
        """A plain-text table of `rows()`."""
        lines = [
            f"endpoint sensitivity: {len(self.statuses) - 1} flows from inits perturbed at "
            f"relative size {self.eps:g} ({self._status_note()})",
            f"  {'quantity':<20}{'value':>22}{'spread':>12}  digits",
        ]
        for r in self.rows():
            digits = "—" if r["digits"] is None else str(r["digits"])
            note = "  (below the SVD floor)" if r["below_svd_floor"] else ""
            lines.append(
                f"  {r['quantity']:<20}{r['value']:>22.15g}{r['spread']:>12.2e}  {digits}{note}"
            )
        return "\n".join(lines)

    def _status_note(self) -> str:
        labels, counts = np.unique(np.asarray(self.statuses), return_counts=True)
        return ", ".join(f"{c} {lab}" for lab, c in zip(labels, counts, strict=True))

    def to_dict(self) -> dict:
        return {"eps": self.eps, "statuses": list(self.statuses), "quantities": self.rows()}


def perturb(model, eps: float, key):
    """`model` with every layer W_l + ε·RMS(θ)·ξ_l, ξ_l standard normal: a perturbation of
    relative size ε that leaves every invariant set of the initialisation."""
    import jax

    from ..engine._dynamics import flatten, rms
    from ..model import Factorization

    scale = rms(flatten(model), model, None)
    keys = jax.random.split(key, model.depth)
    return Factorization(
        [
            w + eps * scale * jax.random.normal(kk, w.shape, w.dtype)
            for kk, w in zip(keys, model.layers, strict=True)
        ]
    )


def endpoint_quantities(model, problem, *, top: int = 5, family=None) -> dict[str, float]:
    """The quantities whose digits `sensitivity` judges: the top singular values, stable rank
    (and its excess over 1, srank − 1), effective rank, unobserved error (where some truth off
    Ω is known), and with
    `family=(n, s)` the family's σ_A, σ_B, σ_C measured from the layers."""
    sigma = np.asarray(singular_values(model))
    out = {f"sigma_{i + 1}": float(sigma[i]) for i in range(min(top, sigma.size))}
    out["stable_rank"] = stable_rank_of(sigma)
    out["stable_rank_excess"] = stable_rank_excess_of(sigma)
    out["effective_rank"] = effective_rank_of(sigma)
    error = unobserved_error(model, problem)
    if not (error["count"] == 0 and math.isnan(error["abs"])):  # else no truth is known
        out["unobserved_error"] = error["abs"]
    if family is not None:
        n, s = family
        spectrum = family_spectrum(model, n, s)
        for mode, present in (("a", True), ("b", n >= 2), ("c", s >= 2)):
            if present:
                out[f"sigma_{mode}"] = spectrum[f"sigma_{mode}"]
    return out


def sensitivity(
    problem,
    model,
    *,
    k: int = 8,
    eps: float = 1e-12,
    key=0,
    family=None,
    top: int = 5,
    measure=None,
    options=None,
    **kwargs,
) -> Sensitivity:
    """Integrate `model` and `k` perturbed copies of it (`perturb`, relative size `eps`) in
    one vmapped batch, and say how many digits of each endpoint quantity
    (`endpoint_quantities`) they share.

    `family=(n, s)` adds the identity family's σ_A, σ_B, σ_C from the layers; `measure`, a
    function of an endpoint model returning a dict of floats, adds its own. `options` /
    `**kwargs` are the flow's (`FlowOptions`). A quantity's digits are None unless every
    member converged: a flow that is not at its endpoint says nothing of the endpoint.
    """
    import jax

    from .._checks import as_key
    from ..engine import FlowOptions, Status, flow_batch, stack

    if not (isinstance(k, int) and k >= 1):
        raise ValueError(f"k (perturbed flows) must be an integer >= 1, got {k!r}")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps (relative perturbation) must be finite and > 0, got {eps!r}")
    options = options if options is not None else FlowOptions(**kwargs)
    members = [model] + [perturb(model, eps, kk) for kk in jax.random.split(as_key(key), k)]
    result = flow_batch(problem, stack(members), options)
    statuses = [Status(int(c)).label for c in np.asarray(result.status)]
    rows = []
    for i in range(k + 1):
        endpoint = result.member(i).model
        rows.append(endpoint_quantities(endpoint, problem, top=top, family=family))
        if measure is not None:
            rows[-1] |= {name: float(v) for name, v in measure(endpoint).items()}
    values = {name: np.array([r[name] for r in rows]) for name in rows[0]}
    converged = all(s == "converged" for s in statuses)
    digits = {name: reproducible_digits(v) if converged else None for name, v in values.items()}
    floor = 1e-15 * values["sigma_1"][0]
    below = [
        q for q in values if q[6:].isdigit() and q.startswith("sigma_") and values[q][0] < floor
    ]
    return Sensitivity(float(eps), statuses, values, digits, below, result)
