# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# # Loss of plasticity: pretrain on few observations, resume with more
#
# A depth-2 model pretrained on *disconnected* observations (the diagonal) converges fast to a
# high-rank solution. Resumed with more observations it trains lazily — it barely moves — and
# keeps the high rank; for m > m* ≈ 50 it even gets the sign of the unobserved entry wrong.
# Depth ≥ 3 avoids this, but only when pretraining was coupled (m < ∞). Exact numbers:
# docs/theory.md §7. Set `GFLOW_NOTEBOOK_SMALL=1` for CI sizes.

# %%
import math
import os
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

import gflow

SMALL = os.environ.get("GFLOW_NOTEBOOK_SMALL") == "1"
OUT = Path(os.environ.get("GFLOW_NOTEBOOK_OUT", "notebook-out"))
OUT.mkdir(parents=True, exist_ok=True)

# %% [markdown]
# ## 2×2: the warm-start table and the wrong-sign threshold

# %%
problem, pretrain_mask = gflow.studies.two_by_two_problem()
for m in (2.0, 4.0, 16.0, math.inf):
    r = gflow.studies.plasticity(problem, pretrain_mask, gflow.identity_family(2, 2, 0.1, m))
    print(
        f"m = {m:>4}: warm X21 = {r.warm.unobserved_values['1,0']:+.9f}, "
        f"stable rank {r.warm.stable_rank:.6f}, moved {r.warm.distance_travelled:.3f}; "
        f"cold X21 = {r.cold.unobserved_values['1,0']:+.6f}"
    )

ms = np.geomspace(1.5, 400, 12 if SMALL else 40)
curves = {depth: gflow.studies.two_by_two_warm_curve(depth, ms) for depth in (2, 3)}

fig, ax = plt.subplots(figsize=(5.5, 4), constrained_layout=True)
for depth, values in curves.items():
    ax.semilogx(ms, values, "o-", ms=3, label=f"warm start, L = {depth}")
ax.axhline(0, color="k", lw=0.8)
ax.axvline(49.99, color="r", ls="--", lw=0.8, label="m* ≈ 49.99 (theory)")
ax.set_xlabel("init shape m (pretraining from αF_m, α = 0.1)")
ax.set_ylabel("unobserved entry X₂₁ after resuming (truth: 1)")
ax.set_title("2×2: depth 2 loses plasticity; wrong sign for m > m*")
ax.legend(fontsize=8)
fig.savefig(OUT / "plasticity_2x2.png", dpi=120)
assert curves[2][ms > 60].max() < 0 < curves[2][ms < 40].min()

# %% [markdown]
# ## d×d: stable rank after resuming, warm vs cold, per depth

# %%
d = 6 if SMALL else 12
depths = (2, 3) if SMALL else (2, 3, 4, 5)
rows = gflow.studies.dxd_study(d, depths, (0.1,), seed=0)
for row in rows:
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})


def endpoint(row, phase):
    """The stable rank of a phase that converged (after a converged pretraining), else nan."""
    reached = row["pretrain_status"] == row[f"{phase}_status"] == "converged"
    return row[f"{phase}_stable_rank"] if reached else np.nan


fig, ax = plt.subplots(figsize=(5.5, 4), constrained_layout=True)
ax.plot(depths, [endpoint(r, "warm") for r in rows], "o-", label="warm (pretrained on Ω₁)")
ax.plot(depths, [endpoint(r, "cold") for r in rows], "s--", label="cold (fresh init)")
ax.set_xlabel("depth L")
ax.set_ylabel("stable rank after training on Ω₂")
ax.set_xticks(depths)
ax.set_title(f"{d}×{d}, X* = J, Ω₁ = diagonal ⊂ Ω₂ connected\nα = 0.1, m = 4")
ax.legend()
fig.savefig(OUT / "plasticity_dxd.png", dpi=120)

# %% [markdown]
# ## Kleinman et al.'s deficit, by the exact flow (skipped at CI size)
#
# d = 20, rank-2 truth, Ω₂ = 160 random entries, Ω₁ = a random half of Ω₂ (already connected),
# Gaussian inits. Test MSE on the entries outside Ω₂, warm (pretrained on Ω₁) vs cold.

# %%
if not SMALL:
    d, n_obs = 20, 160
    truth = gflow.bernoulli(d, d, 1.0, 2, key=7)
    rng = np.random.default_rng(0)
    idx = rng.choice(d * d, size=n_obs, replace=False)
    mask2 = np.zeros(d * d)
    mask2[idx] = 1
    half = np.zeros(d * d)
    half[rng.choice(idx, size=n_obs // 2, replace=False)] = 1
    problem = truth.with_mask(mask2.reshape(d, d))
    off = mask2.reshape(d, d) == 0
    truth_values = np.asarray(truth.target)[off]
    for depth in (2, 3):
        for alpha in (0.3, 0.1):
            init = gflow.gaussian([d] * (depth + 1), alpha, key=3)
            r = gflow.studies.plasticity(problem, half.reshape(d, d), init, judge_trajectory=False)
            mse = {
                k: float(np.mean((np.asarray(r.models[k].product())[off] - truth_values) ** 2))
                for k in ("warm", "cold")
            }
            print(
                f"L = {depth}, α = {alpha}: test MSE warm {mse['warm']:.3g} vs cold "
                f"{mse['cold']:.3g}; warm moved {r.warm.distance_travelled:.3f}"
            )
