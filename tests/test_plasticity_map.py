"""The plasticity map: its masks and problems, early stopping (flow and descent), the batched
runs it rests on, its store (resume), its verdicts and its figure, on the smallest grid."""

import dataclasses
import json

import numpy as np
import pytest

import gflow
from gflow.studies import _plasticity_map as pm
from gflow.studies._plasticity_verdicts import (
    claim_summary,
    descent_disagreements,
    plasticity_deficit,
    plasticity_endpoints,
    plasticity_verdicts,
    plot_deficit,
)

SMALL = pm.PRESETS["small"]


@pytest.fixture(scope="module")
def small_map(tmp_path_factory):
    out = tmp_path_factory.mktemp("pmap") / "map.zarr"
    ds = pm.plasticity_map(SMALL, out, progress=False)
    return out, ds


# --- the problems --------------------------------------------------------------------------------


def test_pretraining_masks_lie_inside_a_connected_resume_mask():
    spec = dataclasses.replace(SMALL, subsets=("diagonal", "blocks", "random-0.25", "random-0.5"))
    for seed in (0, 1):
        problem = pm.seed_problem(spec, seed)
        mask2 = np.asarray(problem.mask)
        assert mask2.sum() == spec.observed
        assert np.all(np.diag(mask2) == 1)
        assert len(gflow.bipartite_components(problem)) == 1
        for name in spec.subsets:
            mask1 = pm.pretrain_mask(spec, name, mask2, seed)
            assert np.all(mask1 <= mask2), name
            if name.startswith("random-"):
                assert mask1.sum() == round(pm.subset_fraction(name) * spec.observed)
        blocks = pm.pretrain_mask(spec, "blocks", mask2, seed)
        assert np.all(np.diag(blocks) == 1)
        rows, cols = np.nonzero(blocks)
        assert np.all(rows // spec.block_size == cols // spec.block_size)
    # the same seed gives the same problem and subsets; another seed another
    a, b = pm.seed_problem(spec, 0), pm.seed_problem(spec, 0)
    np.testing.assert_array_equal(np.asarray(a.mask), np.asarray(b.mask))
    assert not np.array_equal(np.asarray(a.mask), np.asarray(pm.seed_problem(spec, 1).mask))


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(subsets=("diagonal", "random-1.5")), "unknown subset"),
        (dict(subsets=("rows",)), "unknown subset"),
        (dict(observed=8), "cannot hold the diagonal and connect"),
        (dict(depths=(2, 2)), "depths holds a value twice"),
        (dict(alphas=(0.1, -1.0)), "alphas must be finite and > 0"),
        (dict(early_loss=1.0), "early_loss must lie in (0, 1)"),
        (dict(seeds=()), "seeds must not be empty"),
        (dict(inits=("orthogonal",)), "unknown init"),
        (dict(m=1.0), "m must be > 1"),
        (dict(truth="sparse"), "unknown truth"),
    ],
)
def test_a_bad_map_is_refused_with_a_clear_error(change, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        dataclasses.replace(SMALL, **change)


# --- early stopping and batched runs ---------------------------------------------------------


def test_an_early_stop_lands_on_its_loss_and_says_so():
    problem = pm.seed_problem(SMALL, 0)
    init = pm.initial_model(SMALL, 3, 0.1, "gaussian", 0)
    r = gflow.flow(problem, init, stop_loss=1e-2)
    assert r.status_label == "loss_reached"
    assert abs(float(r.loss / r.loss_init) / 1e-2 - 1) < 1e-6
    full = gflow.flow(problem, init)
    assert full.status_label == "converged" and float(full.t_end) > float(r.t_end)
    gd = gflow.descend(problem, init, lr=0.01, stop_loss=1e-2)
    assert gd.status_label == "loss_reached"
    ratio = float(gd.loss / gd.loss_init)
    assert ratio <= 1e-2  # the first iterate at or below it
    with pytest.raises(ValueError, match="stop_loss runs on the loss clock"):
        gflow.FlowOptions(stop_loss=1e-2, clock="physical")
    with pytest.raises(ValueError, match="stop_loss must lie in"):
        gflow.DescentOptions(stop_loss=2.0)


def test_batches_with_tails_apart_and_batched_descent_match_one_by_one():
    problem = pm.seed_problem(SMALL, 1)
    inits = [pm.initial_model(SMALL, 2, a, "gaussian", 1) for a in (0.1, 0.01)]
    batch = gflow.flow_batch(problem, gflow.stack(inits), tails="apart")
    together = gflow.flow_batch(problem, gflow.stack(inits), tails="batch")
    for i, init in enumerate(inits):
        alone = gflow.flow(problem, init)
        assert batch.member(i).status_label == "converged"
        x, y = batch.member(i).model.product(), alone.model.product()
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-8)
        np.testing.assert_allclose(together.member(i).model.product(), y, rtol=0, atol=1e-8)
    options = gflow.DescentOptions(lr=1.0, max_steps=3000, rtol=1e-6)
    lrs = [0.02, 0.05]
    gd = gflow.descend_batch(problem, gflow.stack(inits), options, lr=lrs)
    for i, init in enumerate(inits):
        alone = gflow.descend(problem, init, dataclasses.replace(options, lr=lrs[i]))
        assert int(gd.member(i).num_steps) == int(alone.num_steps)
        np.testing.assert_allclose(gd.member(i).model.product(), alone.model.product(), atol=1e-12)
    with pytest.raises(ValueError, match="finite learning rates"):
        gflow.descend_batch(problem, gflow.stack(inits), options, lr=[0.1, -1.0])
    with pytest.raises(ValueError, match="unknown tails"):
        gflow.flow_batch(problem, gflow.stack(inits), tails="later")


# --- the map -----------------------------------------------------------------------------------


def test_every_cell_of_the_small_map_matches_the_plasticity_study(small_map):
    _, ds = small_map
    assert bool(ds.done.all())
    assert plasticity_endpoints(ds).sum() > 0
    early = ds.sel(pretraining="early")
    ok = early.status_pretrain == int(gflow.Status.LOSS_REACHED)
    np.testing.assert_allclose(early.loss_pretrain.where(ok), SMALL.early_loss, rtol=1e-6)
    # one cell, by the one-cell API (gflow.studies.plasticity): the same numbers
    depth, alpha, seed, subset = 3, SMALL.alphas[0], SMALL.seeds[1], "random-0.5"
    problem = pm.seed_problem(SMALL, seed)
    mask1 = pm.pretrain_mask(SMALL, subset, np.asarray(problem.mask), seed)
    init = pm.initial_model(SMALL, depth, alpha, "gaussian", seed)
    r = gflow.studies.plasticity(problem, mask1, init, judge_trajectory=False)
    cell = ds.sel(depth=depth, alpha=alpha, init="gaussian", subset=subset, seed=seed)
    cell = cell.sel(pretraining="endpoint")
    assert r.warm.status == r.cold.status == r.pretrain.status == "converged"
    assert int(cell.status_warm) == int(cell.status_cold) == 0
    np.testing.assert_allclose(float(cell.error_warm), r.warm.unobserved_error["rel"], rtol=1e-7)
    np.testing.assert_allclose(float(cell.error_cold), r.cold.unobserved_error["rel"], rtol=1e-7)
    np.testing.assert_allclose(float(cell.srank_warm), r.warm.stable_rank, rtol=1e-7)
    np.testing.assert_allclose(float(cell.distance_warm), r.warm.distance_travelled, rtol=1e-6)
    # coupling of the pretraining: depth 2 from a Gaussian init on the diagonal is decoupled
    d2 = ds.pretrain_coupled.sel(depth=2, subset="diagonal").values
    d3 = ds.pretrain_coupled.sel(depth=3, subset="diagonal").values
    assert np.all(d2 == 0) and np.all(d3 == 1)


def test_a_map_resumes_only_its_unfinished_units(small_map, tmp_path, monkeypatch):
    out, ds = small_map
    import shutil

    import zarr

    copy = tmp_path / "copy.zarr"
    shutil.copytree(out, copy)
    group = zarr.open_group(str(copy), mode="r+")
    group["done"][1, 0, 0] = False  # as if killed before this unit's flag was written
    group["error_warm"][1, 0, 0] = np.nan
    calls = []
    real = pm.run_unit

    def counted(spec, depth, alpha, init):
        calls.append((depth, alpha, init))
        return real(spec, depth, alpha, init)

    monkeypatch.setattr(pm, "run_unit", counted)
    again = pm.plasticity_map(SMALL, copy, resume=True, progress=False)
    assert calls == [(SMALL.depths[1], SMALL.alphas[0], SMALL.inits[0])]
    np.testing.assert_allclose(again.error_warm.values, ds.error_warm.values, rtol=1e-10)
    with pytest.raises(FileExistsError):
        pm.plasticity_map(SMALL, copy, progress=False)
    with pytest.raises(ValueError, match=r"different plasticity map \(seeds: \["):
        pm.plasticity_map(dataclasses.replace(SMALL, seeds=(0,)), copy, resume=True)


def test_verdicts_show_only_endpoints_and_judge_each_cell(small_map):
    _, ds = small_map
    ds = ds.copy(deep=True)
    at = dict(depth=3, init="gaussian", subset="diagonal", pretraining="endpoint")
    # a cell whose warm start failed is no endpoint: no deficit, no verdict from it
    ds["status_warm"].loc[at] = int(gflow.Status.MAX_STEPS)
    assert np.isnan(plasticity_deficit(ds).sel(at).values).all()
    rows = plasticity_verdicts(ds)
    row = next(r for r in rows if all(r[k] == v for k, v in at.items()))
    assert row["endpoints"] == 0 and row["verdict"] == "no endpoint"
    # a coupled depth-3 cell holds exactly when its median deficit is within the tolerance
    at = dict(depth=3, init="gaussian", subset="random-0.5", pretraining="early")
    ds["error_cold"].loc[at] = 0.1
    ds["error_warm"].loc[at] = 0.15
    ds["status_pretrain"].loc[at] = int(gflow.Status.LOSS_REACHED)
    ds["status_warm"].loc[at] = ds["status_cold"].loc[at] = 0
    row = next(r for r in plasticity_verdicts(ds) if all(r[k] == v for k, v in at.items()))
    assert row["coupled"] == "coupled" and row["verdict"] == "holds"
    assert row["error_deficit"] == pytest.approx(1.5)
    row = next(
        r for r in plasticity_verdicts(ds, tolerance=1.2) if all(r[k] == v for k, v in at.items())
    )
    assert row["verdict"] == "fails"
    # where the cold start itself does not complete the matrix there is nothing to judge
    ds["error_cold"].loc[at] = 0.9
    ds["error_warm"].loc[at] = 0.9
    row = next(r for r in plasticity_verdicts(ds) if all(r[k] == v for k, v in at.items()))
    assert row["verdict"] == "cold fails"
    summary = claim_summary(plasticity_verdicts(ds))
    assert sum(summary.values()) == len(rows)


def test_disagreements_with_descent_name_their_driver(small_map):
    _, ds = small_map
    ds = ds.copy(deep=True)
    at = dict(depth=3, init="gaussian", subset="random-0.5", pretraining="endpoint")
    for name in ("status_pretrain", "status_warm", "status_cold"):
        ds[name].loc[at] = 0
        ds["sgd_" + name].loc[at] = 0
    early = {**at, "pretraining": "early"}
    for name in ("status_warm", "status_cold"):
        ds[name].loc[early] = 0
    ds["status_pretrain"].loc[early] = int(gflow.Status.LOSS_REACHED)
    ds["error_warm"].loc[at] = ds["error_cold"].loc[at] * 1.1  # the flow keeps plasticity
    ds["error_warm"].loc[early] = ds["error_cold"].loc[early] * 25  # unless stopped early
    ds["sgd_error_warm"].loc[at] = ds["sgd_error_cold"].loc[at] * 30  # descent loses it
    rows = [r for r in descent_disagreements(ds) if all(r[k] == v for k, v in at.items())]
    assert len(rows) == 1
    assert rows[0]["sgd_deficit"] == pytest.approx(30) and rows[0]["flow_deficit"] < 2
    assert rows[0]["drivers"] == ["pretraining length"]
    # on the edge (1.8 against 2.3) is no disagreement
    ds["sgd_error_warm"].loc[at] = ds["sgd_error_cold"].loc[at] * 2.3
    ds["error_warm"].loc[at] = ds["error_cold"].loc[at] * 1.8
    assert not [r for r in descent_disagreements(ds) if all(r[k] == v for k, v in at.items())]


def test_the_heatmap_marks_cells_without_endpoints(small_map):
    import matplotlib.pyplot as plt

    _, ds = small_map
    ds = ds.copy(deep=True)
    ds["status_cold"].loc[dict(depth=2)] = int(gflow.Status.MAX_STEPS)
    fig = plot_deficit(ds)
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    n_panels = ds.sizes["init"] * ds.sizes["pretraining"] * ds.sizes["alpha"]
    assert texts.count("×") == n_panels * ds.sizes["subset"]  # every depth-2 cell
    ds["error_cold"].loc[dict(depth=3)] = 0.9  # the cold start fails: marked, not judged
    fig2 = plot_deficit(ds)
    marked = [t.get_text() for ax in fig2.axes for t in ax.texts if t.get_text().endswith(" c")]
    assert len(marked) == n_panels * ds.sizes["subset"]
    plt.close(fig2)
    plt.close(fig)


def test_the_cli_runs_a_map_and_summarises_its_verdicts(small_map, tmp_path, capsys):
    from gflow.cli import main

    out = tmp_path / "cli.zarr"
    figure = tmp_path / "map.png"
    code = main(
        [
            "plasticity-map",
            "--preset",
            "small",
            "--depths",
            "2",
            "3",
            "--no-sgd",
            "--out",
            str(out),
            "--figure",
            str(figure),
            "--quiet",
        ]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["cell_seeds"] == 16 and summary["endpoints"] > 0
    assert sum(summary["claim"].values()) == 8
    assert figure.exists() and figure.stat().st_size > 10_000
    code = main(["plasticity-map", "--preset", "small", "--out", str(out), "--quiet"])
    assert code == 2  # exists: a usage error that names --resume
    assert "resume" in capsys.readouterr().err


def test_the_notebook_runs_small(small_map, tmp_path, monkeypatch):
    import os
    import runpy
    from pathlib import Path

    monkeypatch.setenv("GFLOW_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("GFLOW_NOTEBOOK_OUT", str(tmp_path))
    root = Path(__file__).resolve().parents[1]
    runpy.run_path(os.fspath(root / "notebooks" / "plasticity_map.py"), run_name="__main__")
    assert (tmp_path / "plasticity_map_flow.png").stat().st_size > 10_000
    assert (tmp_path / "plasticity_map_sgd.png").stat().st_size > 10_000
