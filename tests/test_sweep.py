"""Sweeps: batched grids against single flows, crash-safe resume, compile counts, devices."""

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import xarray as xr

import gflow
from gflow.sweeps._build import build, build_chunk
from gflow.sweeps._store import spec_differences

SPEC = gflow.SweepSpec(
    axes={"depth": [2, 3], "alpha": [0.1, 1e-2, 1e-3], "m": [4.0, math.inf]},
    fixed={"dim": 3},
    chunk_size=4,
    depth_mode="compile",
)


@pytest.fixture(scope="module")
def small_sweep(tmp_path_factory):
    before = gflow.compile_count()
    out = tmp_path_factory.mktemp("sweep") / "grid.zarr"
    ds = gflow.sweep(SPEC, out, progress=False)
    return ds, out, gflow.compile_count() - before


def test_grid_dims_and_statuses(small_sweep):
    ds, _, _ = small_sweep
    assert dict(ds.sizes) == {"depth": 2, "alpha": 3, "m": 2, "k": 4}
    assert np.all(np.isnan(ds["sigma"].values[..., 3]))  # a 3×3 matrix has 3 values
    assert list(ds["depth"].values) == [2, 3]
    assert np.all(ds["status"].values == gflow.Status.CONVERGED)
    assert np.all(ds["done"].values)
    assert json.loads(ds.attrs["spec"])["axes"]["alpha"] == [0.1, 0.01, 0.001]


def test_points_equal_single_flows(small_sweep):
    ds, _, _ = small_sweep
    for depth, alpha, m in [(2, 0.1, 4.0), (3, 1e-3, 4.0), (3, 1e-2, math.inf)]:
        single = gflow.flow(gflow.diagonal(3), gflow.identity_family(3, depth, alpha, m))
        point = ds.sel(depth=depth, alpha=alpha, m=m)
        np.testing.assert_allclose(
            point["sigma"].values[:3],
            gflow.singular_values(single.model),
            rtol=1e-10,
            atol=1e-14 * float(point["sigma"][0]),  # the SVD's own resolution
        )
        # Batched and single programs round differently, which can move one accept/reject
        # decision of the step controller; the endpoint is unaffected (above), the stopping
        # time moves by far less than the tolerance-scale of the time grid.
        np.testing.assert_allclose(float(point["t_end"]), float(single.t_end), rtol=1e-6)
        assert abs(int(point["num_steps"]) - int(single.num_steps)) <= 3


def test_the_store_opens_as_a_labelled_grid(small_sweep):
    """`xr.open_zarr` on the store itself gives the grid: one dimension per axis, labelled."""
    ds, out, _ = small_sweep
    store = xr.open_zarr(out)
    assert store["stable_rank"].dims == ("depth", "alpha", "m")
    assert store["sigma"].dims == ("depth", "alpha", "m", "k")
    assert list(store["alpha"].values) == [0.1, 1e-2, 1e-3]
    at_depth_3 = store.stable_rank.sel(depth=3)
    assert at_depth_3.dims == ("alpha", "m")
    np.testing.assert_array_equal(at_depth_3.values, ds["stable_rank"].sel(depth=3).values)
    np.testing.assert_array_equal(
        store["sigma"].sel(depth=2, alpha=1e-2, m=4.0).values,
        ds["sigma"].sel(depth=2, alpha=1e-2, m=4.0).values,
    )
    assert store["done"].dtype == bool and store["status"].dtype == np.int8


def test_a_flat_store_of_an_older_gflow_is_read_as_a_grid_but_not_resumed(small_sweep, tmp_path):
    ds, _, _ = small_sweep
    flat = ds.stack(point=list(SPEC.axes)).reset_index("point").transpose("point", ...)
    # the old layout: one `point` dimension in execution order, `grid_index` to undo it
    order = np.array([i for _, idx in gflow.sweeps._spec.execution_order(SPEC) for i in idx])
    flat = flat.isel(point=order).drop_vars(list(SPEC.axes))
    flat = flat.assign_coords(grid_index=("point", order))
    flat.attrs = {k: v for k, v in ds.attrs.items() if k != "layout"}
    old = tmp_path / "old.zarr"
    flat.to_zarr(old, consolidated=False)
    again = gflow.load_sweep(old)
    assert again["sigma"].dims == ("depth", "alpha", "m", "k")
    np.testing.assert_array_equal(again["sigma"].values, ds["sigma"].values)
    np.testing.assert_array_equal(again["status"].values, ds["status"].values)
    with pytest.raises(ValueError, match="older gflow"):
        gflow.sweep(SPEC, old, resume=True, progress=False)


def test_a_sensitivity_sweep_stores_the_reproducible_digits(tmp_path):
    """Blocks 3×2, m = 3, α = 0.02: depth 2's σ_B is stable, depth 3's is decided by rounding
    (its invariant set is unstable while mode C decays); the store says so per point."""
    spec = gflow.SweepSpec(
        axes={"depth": [2, 3]},
        fixed={"blocks": 3, "block_size": 2, "m": 3.0, "alpha": 0.02},
        problem="block-diagonal",
        chunk_size=2,
        top=4,
        sensitivity=3,
        sensitivity_eps=1e-14,
    )
    ds = gflow.sweep(spec, tmp_path / "digits.zarr", progress=False)
    assert np.all(ds["status"].values == gflow.Status.CONVERGED)
    digits_b = xr.open_zarr(tmp_path / "digits.zarr")["digits_sigma_b_layers"]
    assert digits_b.dims == ("depth",)
    assert int(digits_b.sel(depth=2)) >= 10 and int(digits_b.sel(depth=3)) <= 6
    assert ds["digits_sigma"].dims == ("depth", "k")
    assert int(ds["digits_sigma"].sel(depth=3, k=0)) >= 8  # σ₁ = σ_A stays reproducible
    assert int(ds["digits_sigma"].sel(depth=3, k=1)) <= 6
    # the unperturbed flows are the plain sweep's
    plain = gflow.sweep(dataclasses.replace(spec, sensitivity=0), progress=False)
    np.testing.assert_array_equal(plain["sigma"].values, ds["sigma"].values)
    assert "digits_sigma" not in plain


def test_one_compilation_per_depth(small_sweep):
    _, _, compiles = small_sweep
    assert compiles <= 2


def test_workers_share_one_store(small_sweep, tmp_path):
    ds, _, _ = small_sweep
    out = tmp_path / "shared.zarr"
    chunks = len(gflow.sweeps._spec.execution_order(SPEC))
    first = gflow.sweep(SPEC, out, progress=False, worker=(0, 2))
    done = first["done"].values
    assert 0 < done.sum() < done.size  # worker 0 ran only its chunks (k mod 2 == 0)
    full = gflow.sweep(SPEC, out, progress=False, worker=(1, 2))
    assert chunks >= 2 and np.all(full["done"].values)
    np.testing.assert_array_equal(full["sigma"].values, ds["sigma"].values)
    with pytest.raises(ValueError, match="worker"):
        gflow.sweep(SPEC, out, worker=(2, 2))


def test_depth_padding_gives_the_same_grid_from_one_program(small_sweep):
    ds, _, _ = small_sweep
    padded_spec = gflow.SweepSpec(**{**SPEC.__dict__, "depth_mode": "auto"})  # small: pads
    assert padded_spec.pads_depths
    before = gflow.compile_count()
    padded = gflow.sweep(padded_spec, progress=False)
    assert gflow.compile_count() - before == 1
    assert np.all(padded["status"].values == gflow.Status.CONVERGED)
    sigma, sigma_padded = ds["sigma"].values[..., :3], padded["sigma"].values[..., :3]
    floor = 1e-14 * sigma[..., :1]  # the SVD's own resolution
    assert np.all(np.abs(sigma_padded - sigma) <= 1e-10 * sigma + floor)
    np.testing.assert_allclose(
        padded["log_sigma_b_layers"].values, ds["log_sigma_b_layers"].values, atol=1e-9
    )
    assert np.max(np.abs(padded["num_steps"].values - ds["num_steps"].values)) <= 3


def test_pad_depth_keeps_the_product():
    model = gflow.identity_family(3, 2, 0.5, 4.0)
    padded = gflow.pad_depth(model, 4)
    assert padded.depth == 4
    np.testing.assert_allclose(padded.product(), model.product(), atol=1e-15)
    with pytest.raises(ValueError, match="cannot pad"):
        gflow.pad_depth(padded, 3)
    with pytest.raises(ValueError, match="depth_mode"):
        gflow.SweepSpec(axes={"alpha": [0.1]}, depth_mode="stack")


def test_theory_agreement_in_the_store(small_sweep):
    ds, _, _ = small_sweep
    for depth in (2, 3):
        for alpha in (0.1, 1e-2, 1e-3):
            lim = gflow.family_limit(depth, 3, 1, alpha, 4.0)
            got = float(ds["log_sigma_b_layers"].sel(depth=depth, alpha=alpha, m=4.0))
            assert abs(got - float(lim.log_sigma_b)) < 1e-8


def test_existing_store_needs_resume_and_resume_is_a_no_op(small_sweep):
    _, out, _ = small_sweep
    with pytest.raises(FileExistsError):
        gflow.sweep(SPEC, out, progress=False)
    before = gflow.compile_count()
    again = gflow.sweep(SPEC, out, resume=True, progress=False)
    assert gflow.compile_count() == before  # nothing recomputed
    assert np.all(again["done"].values)


def test_resuming_with_other_settings_names_what_changed(small_sweep):
    _, out, _ = small_sweep
    changed = dataclasses.replace(SPEC, options=gflow.FlowOptions(tail_scale="entry"))
    with pytest.raises(ValueError, match="options.tail_scale: 'layer' → 'entry'"):
        gflow.sweep(changed, out, resume=True, progress=False)
    stored = json.loads(SPEC.to_json())
    del stored["options"]["tail_scale"]  # a store from before the option existed
    assert spec_differences(json.dumps(stored), SPEC.to_json()) == [
        "options.tail_scale: '(absent)' → 'layer'"
    ]


def test_table_export(small_sweep, tmp_path):
    ds, _, _ = small_sweep
    frame = gflow.export_table(ds, tmp_path / "flat.csv")
    assert len(frame) == 12 and {"depth", "alpha", "m", "sigma_0", "status"} <= set(frame)
    assert (tmp_path / "flat.csv").read_text().startswith("depth,alpha,m")
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    gflow.export_table(ds, tmp_path / "flat.parquet")
    back = pd.read_parquet(tmp_path / "flat.parquet")
    assert back.equals(frame)


def test_diverging_point_is_a_status_not_an_exception():
    spec = gflow.SweepSpec(axes={"alpha": [0.1, 1e40]}, fixed={"dim": 3, "depth": 3}, chunk_size=2)
    ds = gflow.sweep(spec, progress=False)
    assert [gflow.Status(int(s)).label for s in ds["status"].values] == ["converged", "diverged"]
    summary = gflow.sweep_summary(ds)
    assert summary["not_converged"] == [{"alpha": 1e40, "status": "diverged"}]
    json.dumps(summary)  # as the CLI prints it
    # a stop the user asked for (here a horizon) is counted, not listed
    ds["status"].values[:] = int(gflow.Status.T_MAX)
    assert gflow.sweep_summary(ds)["status"] == {"t_max": 2}
    assert "not_converged" not in gflow.sweep_summary(ds)


def test_spec_validation():
    with pytest.raises(ValueError, match="unknown axis"):
        gflow.SweepSpec(axes={"lr": [1]})
    with pytest.raises(ValueError, match="unknown problem"):
        gflow.SweepSpec(axes={"alpha": [1]}, problem="ring")
    # inits are built traced, where the builders cannot check: the spec checks first
    with pytest.raises(ValueError, match="alpha must be finite and > 0, got 0.0"):
        gflow.SweepSpec(axes={"alpha": [0.1, 0.0]})
    with pytest.raises(ValueError, match="m must be > 1"):
        gflow.SweepSpec(axes={"seed": [0]}, fixed={"m": 1.0})
    with pytest.raises(ValueError, match="sensitivity must be an integer >= 0"):
        gflow.SweepSpec(axes={"seed": [0]}, sensitivity=-1)
    with pytest.raises(ValueError, match="sensitivity_eps must be finite and > 0"):
        gflow.SweepSpec(axes={"seed": [0]}, sensitivity=2, sensitivity_eps=0.0)
    # a sweep keeps endpoints: samples would only be computed (and crashed its tails apart)
    for saving in ({"save": 4}, {"save_ts": (0.0, 1.0)}):
        with pytest.raises(ValueError, match="not its trajectory: options save and save_ts"):
            gflow.SweepSpec(axes={"seed": [0]}, options=gflow.FlowOptions(**saving))


@pytest.mark.parametrize(
    "problem, init, fixed",
    [
        ("diagonal", "gaussian", {}),
        ("block-diagonal", "identity", {"noise": 0.1}),
        ("bernoulli", "orthogonal", {"density": 0.5}),
    ],
)
def test_chunks_build_the_bits_of_single_points(problem, init, fixed):
    """A chunk's problems and models (shared problems, one vmapped init call) are bit for bit
    those `build` makes point by point, so a sweep point is reproducible on its own."""
    spec = gflow.SweepSpec(
        axes={"seed": [0, 1], "alpha": [0.1, 1e-3], "m": [2.0, math.inf]},
        fixed={"dim": 4, "depth": 3, "blocks": 2, "block_size": 2, **fixed},
        problem=problem,
        init=init,
    )
    points = spec.points()
    problems, models = build_chunk(points, problem, init, pad_to=4)
    for i, point in enumerate(points):
        single_problem, single_model = build(point, problem, init, pad_to=4)
        for batched, single in zip(
            (problems.target, problems.mask, *models.layers),
            (single_problem.target, single_problem.mask, *single_model.layers),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(batched[i]), np.asarray(single))


KILL_CONFIG = textwrap.dedent(
    """
    problem = "diagonal"
    init = "identity"
    [axes]
    alpha = [0.3, 0.2, 0.1, 0.07, 0.05, 0.03, 0.02, 0.01, 0.007, 0.005, 0.003, 0.002,
             0.001, 0.0007, 0.0005, 0.0003]
    m = [2.0, 4.0, 8.0, 16.0]
    [fixed]
    dim = 4
    depth = 5
    [sweep]
    chunk_size = 1
    """
)


def _done_chunks(store):
    try:
        ds = xr.open_zarr(store, consolidated=False)
        return ds["done"].values.copy(), ds["run_id"].values.copy()
    except Exception:
        return None, None


def test_sigkill_midway_then_resume_loses_and_repeats_nothing(tmp_path):
    config = tmp_path / "kill.toml"
    config.write_text(KILL_CONFIG)
    store = tmp_path / "kill.zarr"
    cmd = [sys.executable, "-m", "gflow.cli", "sweep", str(config), "--out", str(store), "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    done = None
    while time.time() < deadline:
        done, run_ids = _done_chunks(store)
        # One flow per chunk: 64 chunk writes, a window a 50 ms poll cannot miss.
        if done is not None and 4 <= done.sum() < done.size:
            break
        if proc.poll() is not None:
            pytest.fail("the sweep finished before it could be killed; make the grid longer")
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done, first_ids = _done_chunks(store)
    assert 0 < done.sum() < done.size
    finished_before = done.copy()
    import warnings

    import xarray as xr

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "failed to open Zarr store with consolidated metadata"
        assert int(xr.open_zarr(store).done.sum()) == int(done.sum())
    result = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    done_after, ids_after = _done_chunks(store)
    assert done_after.all()
    # chunks finished before the kill kept the first run's id: not recomputed
    np.testing.assert_array_equal(ids_after[finished_before], first_ids[finished_before])
    assert np.all(ids_after[~finished_before] != first_ids[finished_before][0])
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["flows"] == 64


def test_several_devices_give_identical_results(tmp_path):
    script = textwrap.dedent(
        """
        import jax
        jax.config.update("jax_num_cpu_devices", 4)
        import json, math, numpy as np, gflow
        spec = gflow.SweepSpec(axes={"alpha": [0.1, 0.03, 0.01, 0.003, 0.001], "m": [4.0]},
                               fixed={"dim": 3, "depth": 3}, chunk_size=5)
        assert len(jax.local_devices()) == 4
        many = gflow.sweep(spec, progress=False)
        one = gflow.sweep(spec, progress=False, devices=jax.local_devices()[:1])
        diff = np.nanmax(np.abs(many["sigma"].values - one["sigma"].values))
        same_steps = bool((many["num_steps"] == one["num_steps"]).all())
        print(json.dumps({"diff": float(diff), "steps_equal": same_steps}))
        """
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    # identical up to the round-off of a different batch size per device (σ₁ = 3)
    assert report["diff"] <= 1e-14 and report["steps_equal"]


@pytest.mark.slow
def test_the_512_flow_grid_completes_with_a_status_everywhere(tmp_path):
    spec = gflow.SweepSpec(
        axes={
            "depth": [2, 3, 4, 5],
            "alpha": list(np.geomspace(1e-1, 1e-4, 8)),
            "m": [2.0, 4.0, 16.0, math.inf],
            "seed": [0, 1, 2, 3],
        },
        fixed={"dim": 8},
        chunk_size=64,
    )
    before = gflow.compile_count()
    ds = gflow.sweep(spec, tmp_path / "grid.zarr", progress=False)
    assert gflow.compile_count() - before <= 4
    assert ds["status"].size == 512 and np.all(ds["status"].values >= 0)
    for depth, alpha, m in [(2, 0.1, 2.0), (5, 1e-4, 16.0)]:
        a = float(ds["alpha"].values[np.argmin(np.abs(ds["alpha"].values - alpha))])
        single = gflow.flow(gflow.diagonal(8), gflow.identity_family(8, depth, a, m))
        point = ds.sel(depth=depth, alpha=a, m=m, seed=0)
        np.testing.assert_allclose(
            point["sigma"].values,
            gflow.singular_values(single.model)[:4],
            rtol=1e-10,
            atol=1e-14 * float(point["sigma"][0]),
        )


# SPEC padded to one program (depth_mode auto): 3 chunks of 4, chunk k runs on worker k mod 2
WORKER_CONFIG = textwrap.dedent(
    """
    problem = "diagonal"
    init = "identity"
    [axes]
    depth = [2, 3]
    alpha = [0.1, 0.01, 0.001]
    m = [4.0, "inf"]
    [fixed]
    dim = 3
    [sweep]
    chunk_size = 4
    """
)
DIVERGING_CONFIG = textwrap.dedent(
    """
    [axes]
    alpha = [0.1, 1e40]
    [fixed]
    dim = 3
    depth = 3
    [sweep]
    chunk_size = 1
    """
)


def _start_worker(config, store, worker):
    cmd = [sys.executable, "-m", "gflow.cli", "sweep", str(config), "--out", str(store)]
    cmd += ["--quiet", "--worker", worker]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc):
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-2000:]
    return json.loads(stdout.strip().splitlines()[-1])


def test_a_worker_alone_exits_cleanly_and_reports_what_is_pending(tmp_path):
    """Worker 0 of 2 finishes while worker 1's chunk is unwritten: exit 0, a summary of its
    own chunks, the others `pending` wherever the store is read."""
    config = tmp_path / "w.toml"
    config.write_text(WORKER_CONFIG)
    store = tmp_path / "w.zarr"
    report = _finish(_start_worker(config, store, "0/2"))
    assert report["status"] == {"converged": 8} and report["flows"] == 8
    assert report["chunks_pending"] == 1 and report["store_flows"] == 12
    ds = gflow.load_sweep(store)
    assert gflow.sweep_summary(ds)["status"] == {"converged": 8, "pending": 4}
    frame = gflow.export_table(ds, tmp_path / "partial.csv")
    labels = frame["status_label"].tolist()
    assert labels.count("pending") == 4 and labels.count("converged") == 8
    assert set(frame[frame["status_label"] == "pending"]["status"]) == {-1}
    assert "pending" in (tmp_path / "partial.csv").read_text()


def test_concurrent_workers_both_exit_0_and_merge_to_the_single_run(tmp_path):
    config = tmp_path / "w.toml"
    config.write_text(WORKER_CONFIG)
    store = tmp_path / "w.zarr"
    # worker 0 runs two chunks, worker 1 one: worker 1 finishes first
    procs = [_start_worker(config, store, w) for w in ("0/2", "1/2")]
    reports = [_finish(p) for p in procs]
    assert [r["flows"] for r in reports] == [8, 4]
    assert all(r["status"] == {"converged": r["flows"]} for r in reports)
    merged = gflow.load_sweep(store)
    single = gflow.sweep(gflow.load_spec(config), progress=False)
    assert gflow.sweep_summary(merged) == {
        "flows": 12,
        "status": {"converged": 12},
        "chunks_pending": 0,
    }
    for name in ("sigma", "status", "t_end", "num_steps", "log_sigma_b_layers"):
        np.testing.assert_array_equal(merged[name].values, single[name].values)


def test_a_worker_with_a_diverging_point_records_it_next_to_a_converging_one(tmp_path):
    config = tmp_path / "w.toml"
    config.write_text(DIVERGING_CONFIG)
    store = tmp_path / "w.zarr"
    # chunks run shortest expected flow first: α = 1e40 is chunk 0 (worker 0)
    procs = [_start_worker(config, store, w) for w in ("0/2", "1/2")]
    reports = [_finish(p) for p in procs]
    assert [r["status"] for r in reports] == [{"diverged": 1}, {"converged": 1}]
    assert reports[0]["not_converged"] == [{"alpha": 1e40, "status": "diverged"}]
    assert "not_converged" not in reports[1]
    ds = gflow.load_sweep(store)
    assert gflow.status_labels(ds["status"].values).tolist() == ["converged", "diverged"]


@pytest.mark.parametrize(
    "axes, message",
    [
        ({"depth": [2, -3]}, "depth must be an integer >= 1, got -3"),
        ({"seed": [0, 1.5]}, "seed must be an integer >= 0"),
        ({"density": [0.5, 0.0]}, "density must be in"),
        ({"noise": [-0.1]}, "noise must be finite and >= 0"),
    ],
)
def test_a_bad_axis_is_refused_before_the_store_exists(tmp_path, axes, message):
    config = tmp_path / "bad.toml"
    lines = [f"{k} = {v}" for k, v in axes.items()]
    config.write_text("[axes]\n" + "\n".join(lines) + "\n")
    store = tmp_path / "bad.zarr"
    from gflow import cli

    assert cli.main(["sweep", str(config), "--out", str(store), "--quiet"]) == 2
    assert not store.exists()
    with pytest.raises(ValueError, match=message):
        gflow.SweepSpec(axes=axes)


STIFF_SPEC = gflow.SweepSpec(
    axes={"seed": [0, 1]},
    fixed={"dim": 8, "density": 0.5, "rank": 2, "depth": 3, "alpha": 1e-2},
    problem="bernoulli",
    init="gaussian",
    chunk_size=1,
)


def _chunks_hooked(monkeypatch, first_tails):
    """Wrap the tails of the first chunk a sweep starts with `first_tails(call, k)`; returns
    an event set once a later chunk's heads have run."""
    import threading

    from gflow.sweeps import _run

    later_started, chunks = threading.Event(), []
    real_init = _run.StartedChunk.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        chunks.append(self)
        if len(chunks) == 1:
            assert self.calls, "the first chunk should leave stiff tails pending"
            self.calls = [first_tails(call, k) for k, call in enumerate(self.calls)]
        else:
            later_started.set()

    monkeypatch.setattr(_run.StartedChunk, "__init__", init)
    return later_started


def test_a_chunk_s_pending_tails_do_not_hold_up_the_next_chunk(monkeypatch):
    """The first chunk's stiff tails wait until the second chunk's heads have run: a sweep
    that finished chunk by chunk would never get there (the wait fails after 120 s). The
    grid equals the same points flowed one by one."""
    import threading

    later_started = _chunks_hooked(monkeypatch, lambda call, k: _after(later_started, call))
    ds = gflow.sweep(STIFF_SPEC, progress=False)
    tail_threads = lambda: [t for t in threading.enumerate() if t.name == "gflow-tails"]
    deadline = time.monotonic() + 10
    while tail_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not tail_threads()  # the sweep's tail threads have ended
    assert np.all(ds["done"].values)
    assert np.all(ds["end_phase"].values == int(gflow.Phase.STIFF_TAIL))
    assert np.all(ds["wall_time_s"].values > 0)
    problem, model = build(STIFF_SPEC.points()[1], "bernoulli", "gaussian")
    single = gflow.flow(problem, model)
    np.testing.assert_allclose(
        ds.sel(seed=1)["sigma"].values[:2], gflow.singular_values(single.model)[:2], rtol=1e-9
    )


def _after(event, call):
    def run():
        assert event.wait(timeout=120), "the next chunk did not start while a tail was pending"
        return call()

    return run


def test_the_padding_of_a_chunk_runs_no_stiff_tail(monkeypatch):
    """A chunk with fewer points than `chunk_size` is padded with copies of its last point
    (one compiled program per group); those copies' stiff tails are not run: a sweep's last
    chunk, its longest flows, would otherwise run its slowest tail once per padding member."""
    from gflow.sweeps import _run

    spec = dataclasses.replace(STIFF_SPEC, axes={"seed": [1]}, chunk_size=3)
    chunks, real_init = [], _run.StartedChunk.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        chunks.append(self)

    monkeypatch.setattr(_run.StartedChunk, "__init__", init)
    ds = gflow.sweep(spec, progress=False)
    assert [(c.n, len(c.calls)) for c in chunks] == [(1, 1)]
    assert ds["status"].values.tolist() == [int(gflow.Status.CONVERGED)]
    assert ds["end_phase"].values.tolist() == [int(gflow.Phase.STIFF_TAIL)]
    problem, model = build(spec.points()[0], "bernoulli", "gaussian")
    single = gflow.flow(problem, model)
    np.testing.assert_allclose(
        ds["sigma"].values[0, :2], gflow.singular_values(single.model)[:2], rtol=1e-9
    )


def test_the_tail_pool_reports_its_running_and_waiting_tails():
    """While the progress bar (saved points) stands still, the pool names what runs: how many
    tails, the longest-running one's grid point and seconds, and how many wait."""
    import threading

    from gflow.sweeps._run import _TailPool

    release = threading.Event()

    class Chunk:  # a started chunk whose three tails wait for `release`
        calls = [lambda k=k: release.wait(10) and k for k in range(3)]

        def label(self, j):
            return f"seed={j}"

        def finish(self, results):
            return {"tails": results}

    reports, saved = [], []
    pool = _TailPool(threads=1, open_chunks=2, report=reports.append, report_every=0.02)
    assert pool.activity() == ""
    pool.submit([7], Chunk())
    deadline = time.monotonic() + 10
    while not pool.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.activity().startswith("1 tail running (longest: seed=0, ")
    assert pool.activity().endswith(" s), 2 waiting")
    time.sleep(0.1)  # the reporter runs while nothing waits on the pool (a head computing)
    assert reports and reports[-1].startswith("1 tail running")
    release.set()
    pool.save_finished(lambda idx, res: saved.append((idx, res)), block=True)
    pool.close(wait=True)
    assert saved == [([7], {"tails": [0, 1, 2]})]
    assert reports[-1] == pool.activity() == ""  # the bar is left without a stale postfix
    assert not pool.reporter.is_alive()


def test_a_failing_tail_stops_the_sweep_with_its_error(monkeypatch):
    def failing(call, k):
        def run():
            if k == 0:
                raise RuntimeError("tail 0 failed")
            return call()

        return run

    _chunks_hooked(monkeypatch, failing)
    with pytest.raises(RuntimeError, match="tail 0 failed"):
        gflow.sweep(STIFF_SPEC, progress=False)


def test_a_process_that_exits_right_after_a_sweep_exits_cleanly():
    """The sweep's tail threads have ended when it returns: one still freeing its programs
    and arrays while the interpreter exited aborted the process (exit 134)."""
    script = textwrap.dedent(
        f"""
        import jax
        jax.config.update("jax_enable_x64", True)
        import gflow
        import json
        spec = gflow.SweepSpec.from_dict(json.loads({STIFF_SPEC.to_json()!r}))
        gflow.sweep(spec, progress=False)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
