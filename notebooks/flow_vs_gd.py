# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# # Gradient flow vs gradient descent, Adam and RMSProp
#
# Researchers train with SGD at a small learning rate and call it "gradient flow". gflow
# integrates the flow itself, so we can measure how small is small enough.
#
# * On the identity family with depth 2 the ratio λ_A/λ_B is conserved *exactly* by GD, so the
#   GD limit equals the flow's for every stable step (docs/theory.md §8).
# * For depth ≥ 3 GD carries an O(lr) bias: the endpoint error scales like lr¹.
# * The depth-induced low-rank bias holds for SGD, Adam and RMSProp alike.
#
# Set `GFLOW_NOTEBOOK_SMALL=1` for the small sizes CI runs; figures go to `GFLOW_NOTEBOOK_OUT`.

# %%
import os
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

import gflow

SMALL = os.environ.get("GFLOW_NOTEBOOK_SMALL") == "1"
OUT = Path(os.environ.get("GFLOW_NOTEBOOK_OUT", "notebook-out"))
OUT.mkdir(parents=True, exist_ok=True)
D = 3 if SMALL else 4
LRS = [0.04, 0.02, 0.01] if SMALL else [0.08, 0.04, 0.02, 0.01, 0.005]
DEPTHS = [2, 3] if SMALL else [2, 3, 4]

# %% [markdown]
# ## Endpoint error vs learning rate on the identity family (diagonal observations)

# %%
problem = gflow.diagonal(D)
errors = {}
for depth in DEPTHS:
    init = gflow.identity_family(D, depth, 0.3, 4.0)
    ref = gflow.flow(problem, init, rtol=1e-12)
    assert ref.status_label == "converged"
    errors[depth] = []
    for lr in LRS:
        gd = gflow.descend(problem, init, lr=lr, rtol=1e-12)
        # a descent that did not converge has no endpoint to compare: left out (nan)
        reached = gd.status_label == "converged"
        errors[depth].append(
            gflow.endpoint_distance(gd, ref, problem)["singular_values"] if reached else np.nan
        )
    print(f"L = {depth}: errors {np.array(errors[depth])}")

fig, ax = plt.subplots(figsize=(5, 4), constrained_layout=True)
for depth in DEPTHS:
    err = np.maximum(errors[depth], 1e-16)
    good = ~np.isnan(err)
    lrs = np.asarray(LRS)[good]
    slope = gflow.loglog_slope(lrs, err[good]) if np.nanmin(errors[depth]) > 1e-13 else 0.0
    ax.loglog(lrs, err[good], "o-", label=f"L = {depth} (slope {slope:.2f})")
ax.set_xlabel("learning rate")
ax.set_ylabel("max relative error of singular values vs flow")
ax.set_title("GD endpoint error vs learning rate\n(identity family, α = 0.3, m = 4)")
ax.legend()
fig.savefig(OUT / "flow_vs_gd_error.png", dpi=120)
if any(d >= 3 for d in DEPTHS):
    assert not np.isnan(errors[3]).any()  # every GD run converged: the slope uses them all
    assert 0.9 <= gflow.loglog_slope(LRS, errors[3]) <= 1.1
assert np.nanmax(errors[2]) < 1e-8  # depth 2: the GD limit is the flow's, for every stable lr

# %% [markdown]
# ## Stable rank vs depth, for each optimizer (random init, diagonal observations)

# %%
d = 4 if SMALL else 6
problem = gflow.diagonal(d)
runs = {
    "flow": lambda init: gflow.flow(problem, init),
    "sgd": lambda init: gflow.descend(problem, init, lr=0.05, max_steps=40_000),
    "adam": lambda init: gflow.descend(problem, init, optimizer="adam", lr=1e-3, max_steps=40_000),
    "rmsprop": lambda init: gflow.descend(
        problem, init, optimizer="rmsprop", lr=1e-4, max_steps=40_000
    ),
}
depths = [2, 3] if SMALL else [2, 3, 4, 5]
ranks = {name: [] for name in runs}
for depth in depths:
    init = gflow.gaussian([d] * (depth + 1), 0.3, key=depth)
    for name, run in runs.items():
        r = run(init)
        # only endpoints are plotted: a run that did not converge is left out (nan)
        ranks[name].append(gflow.stable_rank(r.model) if r.status_label == "converged" else np.nan)
        if r.status_label != "converged":
            print(f"L = {depth}: {name} did not converge ({r.status_label}), left out")
    print(f"L = {depth}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in ranks.items()))

fig, ax = plt.subplots(figsize=(5, 4), constrained_layout=True)
# the flow drawn large and hollow, so that an optimizer landing on it does not hide it
styles = {
    "flow": dict(marker="o", ms=12, mfc="none", lw=3, alpha=0.6),
    "sgd": dict(marker="s", ms=5, ls="--"),
    "adam": dict(marker="^", ms=5, ls="-."),
    "rmsprop": dict(marker="v", ms=5, ls=":"),
}
for name, values in ranks.items():
    missing = [L for L, v in zip(depths, values, strict=True) if np.isnan(v)]
    note = f" (no endpoint at L = {', '.join(map(str, missing))})" if missing else ""
    ax.plot(depths, values, label=name + note, **styles[name])
ax.set_xlabel("depth L")
ax.set_ylabel("stable rank of the endpoint")
ax.set_xticks(depths)
ax.set_title("Depth lowers the rank, whatever the optimizer")
ax.legend()
fig.savefig(OUT / "flow_vs_gd_rank.png", dpi=120)
