"""Reading a plasticity map: the warm/cold deficit of its endpoints, the claim "depth ≥ 3
protects plasticity when pretraining is coupled" tested cell by cell, where gradient descent
and the exact flow disagree (and which of lr, pretraining length or α the numbers point to),
and its heatmaps. A run that did not reach its endpoint enters none of these."""

from __future__ import annotations

import itertools
import math

import numpy as np

from ..engine import Status

# A warm start "keeps its plasticity" when its unobserved error is at most this many times the
# cold start's (the deficit); `plasticity_verdicts(tolerance=)` changes it.
TOLERANCE = 2.0

# Plasticity is the ability to learn what a fresh model learns: a cell is judged only where the
# cold start completes the matrix, its median relative unobserved error below this (else the
# verdict is `cold fails`: both starts fail, and their ratio says nothing about plasticity).
COLD_LIMIT = 0.5

_EXPECTED_PRETRAIN = {"endpoint": int(Status.CONVERGED), "early": int(Status.LOSS_REACHED)}


def _lr(ds, lr) -> float:
    return float(ds.lr.values[0]) if lr is None else float(lr)


def _select(ds, method: str, lr):
    """The variables of one method as a dataset with flow-like names (`status_warm`, …)."""
    if method == "flow":
        return ds
    if method != "sgd":
        raise ValueError(f"method must be 'flow' or 'sgd', got {method!r}")
    if "lr" not in ds.coords:
        raise ValueError("this map was run without gradient descent (sgd_lrs empty)")
    names = [n for n in ds.data_vars if n.startswith("sgd_")]
    sub = ds[names].sel(lr=_lr(ds, lr))
    return sub.rename({n: n.removeprefix("sgd_") for n in names})


def plasticity_endpoints(ds, method: str = "flow", lr=None):
    """Where a cell is an endpoint: pretraining ended as asked (converged, or stopped at the
    early loss), and the warm and the cold runs converged."""
    import xarray as xr

    sub = _select(ds, method, lr)
    expected = xr.DataArray(
        [_EXPECTED_PRETRAIN[p] for p in ds.pretraining.values],
        coords={"pretraining": ds.pretraining},
        dims="pretraining",
    )
    ok = (sub.status_pretrain == expected) & (sub.status_warm == int(Status.CONVERGED))
    ok = ok & (sub.status_cold == int(Status.CONVERGED))
    return ok & ds.done


def plasticity_deficit(ds, quantity: str = "error", method: str = "flow", lr=None):
    """warm / cold per cell and seed: of the relative unobserved error (`error`) or of the
    stable rank (`srank`); NaN where the cell is not an endpoint (`plasticity_endpoints`)."""
    if quantity not in ("error", "srank"):
        raise ValueError(f"quantity must be 'error' or 'srank', got {quantity!r}")
    sub = _select(ds, method, lr)
    ratio = sub[f"{quantity}_warm"] / sub[f"{quantity}_cold"]
    return ratio.where(plasticity_endpoints(ds, method, lr))


def _coupling_label(flags) -> str:
    flags = np.asarray(flags)
    flags = flags[flags >= 0]
    if flags.size == 0:
        return "pending"
    return "coupled" if flags.all() else "decoupled" if not flags.any() else "mixed"


def plasticity_verdicts(ds, tolerance: float = TOLERANCE) -> list[dict]:
    """One row per cell (depth, α, init, Ω₁, pretraining), over its seeds: the coupling of
    its pretraining, the flow's median deficit (error and stable rank) over the seeds that
    reached endpoints, and the verdict of the claim "depth ≥ 3 protects plasticity when
    pretraining is coupled": `holds` (median deficit ≤ `tolerance`), `fails`, `no endpoint`
    (no seed reached one), `cold fails` (the cold start itself does not complete the matrix:
    median error ≥ `COLD_LIMIT`, nothing to compare with), or `not claimed` (depth 2, or
    pretraining not coupled). Depth-2 rows with decoupled pretraining say whether plasticity
    was lost (`lost` / `kept`), the paper's other half."""
    error = plasticity_deficit(ds, "error")
    srank = plasticity_deficit(ds, "srank")
    rows = []
    dims = ("depth", "alpha", "init", "subset", "pretraining")
    for values in itertools.product(*(ds[d].values for d in dims)):
        at = dict(zip(dims, values, strict=True))
        e = error.sel(at).values
        ok = np.isfinite(e)
        coupled = _coupling_label(ds.pretrain_coupled.sel(at).values)
        median = _median(e, ok)
        row = {
            **{k: _plain(v) for k, v in at.items()},
            "coupled": coupled,
            "endpoints": int(ok.sum()),
            "seeds": int(e.size),
            "error_deficit": median,
            "error_deficit_max": float(np.max(e[ok])) if ok.any() else math.nan,
            "srank_deficit": _median(srank.sel(at).values, ok),
            "warm_error": _median(ds.error_warm.sel(at).values, ok),
            "cold_error": _median(ds.error_cold.sel(at).values, ok),
            "warm_distance": _median(ds.distance_warm.sel(at).values, ok),
        }
        row["verdict"] = _verdict(
            int(at["depth"]), coupled, ok.any(), median, tolerance, row["cold_error"]
        )
        rows.append(row)
    return rows


def _plain(v):
    return v.item() if hasattr(v, "item") else v


def _median(values, ok) -> float:
    return float(np.median(values[ok])) if ok.any() else math.nan


def _verdict(depth, coupled, any_endpoint, median, tolerance, cold_error) -> str:
    claimed = (depth >= 3 and coupled == "coupled") or (depth == 2 and coupled == "decoupled")
    if not claimed:
        return "not claimed"
    if not any_endpoint:
        return "no endpoint"
    if not cold_error < COLD_LIMIT:
        return "cold fails"
    if depth >= 3:
        return "holds" if median <= tolerance else "fails"
    return "lost" if median > tolerance else "kept"


def claim_summary(rows: list[dict]) -> dict:
    """Counts of the verdicts: the claim's cells (depth ≥ 3, coupled) and depth 2 decoupled."""
    count = lambda v: sum(r["verdict"] == v for r in rows)
    verdicts = ("holds", "fails", "no endpoint", "cold fails", "lost", "kept", "not claimed")
    return {v: count(v) for v in verdicts}


def descent_disagreements(ds, tolerance: float = TOLERANCE) -> list[dict]:
    """Cells where gradient descent at some learning rate and the exact flow disagree on
    whether the warm start kept its plasticity, both at endpoints: their median deficits lie
    on opposite sides of `tolerance` and differ by more than that factor (a cell on the edge,
    1.8 against 2.3, is no disagreement). Each row says which quantity the map's own numbers
    point to:

    - `lr`: descent at a smaller learning rate in the same cell agrees with the flow (the gap
      closes as lr → 0: it is discretisation);
    - `pretraining length`: the flow with the other pretraining length (endpoint or early
      stop) gives descent's answer;
    - `α`: the flow at another init scale in the same row gives descent's answer;
    - `unexplained` otherwise. Several may apply; all that do are listed, in that order."""
    if "lr" not in ds.coords:
        return []
    flow = plasticity_deficit(ds, "error").median("seed", skipna=True)
    lrs = sorted(float(v) for v in ds.lr.values)
    sgd = {lr: plasticity_deficit(ds, "error", "sgd", lr).median("seed", skipna=True) for lr in lrs}
    kept = lambda v: math.isfinite(v) and v <= tolerance
    rows = []
    for lr in lrs:
        ratio = np.maximum(flow / sgd[lr], sgd[lr] / flow)
        differ = ((flow <= tolerance) != (sgd[lr] <= tolerance)) & (ratio > tolerance)
        for idx in zip(*np.nonzero(differ.values), strict=True):
            at = {d: differ[d].values[i] for d, i in zip(differ.dims, idx, strict=True)}
            f_val, s_val = float(flow.sel(at)), float(sgd[lr].sel(at))
            smaller = {x: float(sgd[x].sel(at)) for x in lrs if x < lr}
            other_pre = {
                str(p): float(flow.sel({**at, "pretraining": p}))
                for p in ds.pretraining.values
                if p != at["pretraining"]
            }
            other_alpha = {
                float(a): float(flow.sel({**at, "alpha": a}))
                for a in ds.alpha.values
                if a != at["alpha"]
            }
            drivers = []
            if any(math.isfinite(v) and kept(v) == kept(f_val) for v in smaller.values()):
                drivers.append("lr")
            if any(math.isfinite(v) and kept(v) == kept(s_val) for v in other_pre.values()):
                drivers.append("pretraining length")
            if any(math.isfinite(v) and kept(v) == kept(s_val) for v in other_alpha.values()):
                drivers.append("α")
            cell = ds.sel(at)
            rows.append(
                {
                    **{k: _plain(v) for k, v in at.items()},
                    "lr": lr,
                    "flow_deficit": f_val,
                    "sgd_deficit": s_val,
                    "sgd_deficit_smaller_lr": smaller,
                    "flow_pretrain_loss": float(cell.loss_pretrain.median("seed")),
                    "sgd_pretrain_loss": float(cell.sgd_loss_pretrain.sel(lr=lr).median("seed")),
                    "sgd_pretrain_steps": float(cell.sgd_steps_pretrain.sel(lr=lr).median("seed")),
                    "flow_deficit_other_pretraining": other_pre,
                    "flow_deficit_other_alpha": other_alpha,
                    "drivers": drivers or ["unexplained"],
                }
            )
    return rows


def plot_deficit(ds, method: str = "flow", lr=None, *, tolerance: float = TOLERANCE):
    """Heatmaps of the median log₁₀ deficit of unobserved error over depth × Ω₁: a panel per
    α (rows) and init × pretraining (columns). Cells with no endpoint are grey with ×;
    decoupled pretraining is marked `d`, mixed `~`, a cold start that does not complete the
    matrix (`cold fails`) `c`. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    ratio = plasticity_deficit(ds, "error", method, lr)
    deficit = np.log10(ratio.median("seed", skipna=True))
    # the cold start's median error over the same endpoints: a cell whose cold start does not
    # complete the matrix is marked, as its verdict is `cold fails`
    cold = _select(ds, method, lr).error_cold.where(ratio.notnull()).median("seed", skipna=True)
    columns = [(i, p) for i in ds.init.values for p in ds.pretraining.values]
    alphas = ds.alpha.values
    fig, axes = plt.subplots(
        len(alphas),
        len(columns),
        figsize=(2.0 + 2.3 * len(columns), 0.6 + 2.0 * len(alphas)),
        squeeze=False,
        constrained_layout=True,
    )
    limit = max(
        1.0, float(np.nanmax(np.abs(deficit.values))) if np.isfinite(deficit.values).any() else 1.0
    )
    norm = TwoSlopeNorm(vcenter=0.0, vmin=-limit, vmax=limit)
    image = None
    subsets = [str(s).replace("random-", "q=") for s in ds.subset.values]
    for r, alpha in enumerate(alphas):
        for c, (init, pre) in enumerate(columns):
            ax = axes[r, c]
            at = dict(alpha=alpha, init=init, pretraining=pre)
            values = deficit.sel(at).transpose("depth", "subset").values
            image = ax.imshow(values, cmap="RdBu_r", norm=norm, origin="lower", aspect="auto")
            coupled = ds.pretrain_coupled.sel(at).transpose("depth", "subset", "seed").values
            cold_error = cold.sel(at).transpose("depth", "subset").values
            for y in range(values.shape[0]):
                for x in range(values.shape[1]):
                    mark = {"decoupled": " d", "mixed": " ~"}.get(
                        _coupling_label(coupled[y, x]), ""
                    )
                    if not cold_error[y, x] < COLD_LIMIT:
                        mark += " c"
                    if np.isfinite(values[y, x]):
                        ax.text(
                            x,
                            y,
                            f"{10 ** values[y, x]:.2g}{mark}",
                            ha="center",
                            va="center",
                            fontsize=7,
                        )
                    else:
                        ax.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, color="0.85"))
                        ax.text(x, y, "×", ha="center", va="center", color="0.4")
            ax.set_xticks(range(len(subsets)), subsets, fontsize=7)
            ax.set_yticks(range(ds.sizes["depth"]), [f"L={d}" for d in ds.depth.values], fontsize=7)
            ax.set_title(f"α={alpha:g}, {init}, {pre}", fontsize=8)
    who = "exact flow" if method == "flow" else f"gradient descent, η = {_lr(ds, lr):g} (mean loss)"
    fig.suptitle(
        f"warm/cold unobserved error ({who}); ≤ {tolerance:g}: plasticity kept\n"
        "× no endpoint; d: pretraining decoupled; c: cold start fails (not judged)",
        fontsize=9,
    )
    fig.colorbar(image, ax=axes, shrink=0.6, label="log₁₀ deficit (median over seeds)")
    return fig
