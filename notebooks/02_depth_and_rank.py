# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# # Depth and rank: a sweep with the theory overlaid
#
# A grid over depth and α, run as one compiled, vmapped program per depth, with the predicted
# stable rank of the identity family drawn underneath (Theorem 3.3 / Corollary 3.4).

# %%
import math
import os
from pathlib import Path

import gflow

SMALL = os.environ.get("GFLOW_NOTEBOOK_SMALL") == "1"
OUT = Path(os.environ.get("GFLOW_NOTEBOOK_OUT", "notebook-out"))
OUT.mkdir(parents=True, exist_ok=True)
depths = [2, 3] if SMALL else [2, 3, 4, 5, 6]
alphas = [1e-1, 1e-2, 1e-3] if SMALL else [1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4]

# %%
spec = gflow.SweepSpec(
    axes={"depth": depths, "alpha": alphas, "m": [4.0]}, fixed={"dim": 4}, chunk_size=len(alphas)
)
ds = gflow.sweep(spec, progress=False)
print(ds[["status", "stable_rank", "t_end", "num_steps"]].squeeze("m").to_dataframe())

# %% [markdown]
# Stable rank from the layers (σ_B is far below SVD resolution at small α and large depth).

# %%
rows = []
for depth in depths:
    for alpha in alphas:
        point = ds.sel(depth=depth, alpha=alpha, m=4.0)
        la, lb = float(point["log_sigma_a_layers"]), float(point["log_sigma_b_layers"])
        rows.append(
            {
                "L": depth,
                "alpha": alpha,
                "sigma_a": math.exp(la),
                "sigma_b": math.exp(lb),
                "stable_rank": 1 + 3 * math.exp(2 * (lb - la)),
                "status": int(point["status"]),  # non-converged rows are drawn as grey crosses
            }
        )
        if int(point["status"]) == gflow.Status.CONVERGED:  # only endpoints meet the theory
            lim = gflow.family_limit(depth, 4, 1, alpha, 4.0)
            assert abs(lb - float(lim.log_sigma_b)) < 1e-8
fig = gflow.plot_rank_vs_alpha(rows, n=4, m=4.0)
fig.savefig(OUT / "depth_and_rank.png", dpi=110)
