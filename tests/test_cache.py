"""The persistent compilation cache: a second process loads what the first compiled."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import gflow

ARGV = [sys.executable, "-m", "gflow.cli", "run", "--depth", "3", "--alpha", "1e-3", "--json"]


def _run(cache, *extra):
    env = dict(os.environ, GFLOW_CACHE_DIR=str(cache))
    env.pop("GFLOW_NO_CACHE", None)
    done = subprocess.run(
        ARGV[:3] + list(extra) + ARGV[3:], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def _endpoint(report):
    keys = ("singular_values", "t_end", "loss", "num_steps", "num_rhs_evals", "certificates")
    return {k: report[k] for k in keys}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    cache = tmp_path_factory.mktemp("xla")
    return cache, _run(cache), _run(cache)


def test_a_second_process_hits_the_cache_and_gets_identical_results(two_processes):
    cache, first, second = two_processes
    assert first["compile_cache_hit"] is False and second["compile_cache_hit"] is True
    assert second["compile_time_s"] < first["compile_time_s"] / 4
    assert _endpoint(second) == _endpoint(first)
    programs = list((cache / "gflow-programs").glob("*.jaxexport"))
    assert len(programs) == 1 and not list(cache.glob("**/*.tmp"))


def test_no_cache_flag_neither_reads_nor_writes(two_processes, tmp_path):
    cache, first, _ = two_processes
    before = sorted(p.name for p in cache.rglob("*") if "atime" not in p.name)
    report = _run(cache, "--no-cache")
    after = sorted(p.name for p in cache.rglob("*") if "atime" not in p.name)
    assert after == before  # nothing written (read times aside)
    assert report["compile_cache_hit"] is False
    assert report["compile_time_s"] > 4 * _run(cache)["compile_time_s"]
    assert _endpoint(report) == _endpoint(first)


def test_a_damaged_program_file_is_recompiled_not_fatal(two_processes, tmp_path):
    cache, first, _ = two_processes
    copy = tmp_path / "xla"
    subprocess.run(["cp", "-r", str(cache), str(copy)], check=True)
    (program,) = (copy / "gflow-programs").glob("*.jaxexport")
    program.write_bytes(program.read_bytes()[:1000])  # a writer killed half-way
    report = _run(copy)
    assert _endpoint(report) == _endpoint(first)
    assert program.stat().st_size > 1000  # rewritten whole


def test_import_gflow_does_not_load_diffrax():
    """A process whose programs come from the cache never traces, so never needs diffrax."""
    code = "import sys, gflow; print(sorted(m for m in ('diffrax', 'lineax') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_live_programs_are_bounded_least_recently_used_first(monkeypatch):
    """Each compiled program holds hundreds of memory mappings (Linux allows 65,530 a
    process): only the `MAX_LIVE_PROGRAMS` most recently used stay alive; an evicted one
    comes back from the persistent cache when it is needed again."""
    import gc

    from gflow.engine import _compile

    def maps():
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    def flows(dims):
        start = maps()
        runs = [gflow.flow(gflow.diagonal(d), gflow.identity_family(d, 2, 0.1, 4.0)) for d in dims]
        gc.collect()
        return runs, maps() - start

    monkeypatch.setattr(_compile, "MAX_LIVE_PROGRAMS", 1)
    _compile._PROGRAMS.clear()
    gc.collect()
    runs, _ = flows([2])
    _, evicted = flows([3, 4, 5])
    assert len(_compile._PROGRAMS) == 1
    monkeypatch.setattr(_compile, "MAX_LIVE_PROGRAMS", 8)
    _, kept = flows([6, 7, 8])
    assert len(_compile._PROGRAMS) == 4
    # Kept alive, a program adds ~190–260 mappings (jax 0.10 and 0.12); evicted, 0–130, what
    # XLA keeps. (Measured against the same process's kept programs: the first program of a
    # process that freed others before it can add as few as 125.)
    assert evicted < kept / 2, (evicted, kept)
    again = gflow.flow(gflow.diagonal(8), gflow.identity_family(8, 2, 0.1, 4.0))
    assert again.compile_cache_hit is None  # still alive
    first = gflow.flow(gflow.diagonal(2), gflow.identity_family(2, 2, 0.1, 4.0))
    assert first.compile_cache_hit is not None  # evicted: loaded (or compiled) again
    np.testing.assert_array_equal(first.model.product(), runs[0].model.product())


def test_programs_are_compiled_without_xla_ynnpack_fusion_on_the_cpu():
    """With XLA's YNNPACK fusion, two programs running at once on two threads (a sweep's
    tails side by side) grow the process without bound (benchmarks/README, "seventeenth
    session"): gflow compiles its programs without it, and they compute the same."""
    import jax
    import jax.numpy as jnp

    from gflow.engine import _compile

    if jax.default_backend() != "cpu":
        pytest.skip("the option is the CPU compiler's")
    a, b = np.linspace(0, 1, 288 * 320).reshape(288, 320), np.linspace(-1, 1, 320 * 96)
    b = b.reshape(320, 96)
    fn = lambda a, b: jnp.tanh(a @ b)
    if "__ynn_fusion" not in jax.jit(fn).lower(a, b).compile().as_text():
        pytest.skip("this jaxlib's XLA does not fuse dots into YNNPACK")
    assert _compile.compiler_options() == _compile.CPU_COMPILER_OPTIONS
    program, _ = _compile.compile_timed(fn, a, b, kind="descend")
    assert "__ynn_fusion" not in program.compiled.as_text()
    np.testing.assert_allclose(program(a, b), np.tanh(a @ b), rtol=0, atol=1e-12)


def test_stored_programs_are_keyed_on_the_whole_package_source():
    """An edit to the residual (`problem.py`) or the products (`model.py`) must not load a
    program traced before it: these were once outside the hash (only `engine/` was in it)."""
    from pathlib import Path

    from gflow.engine._compile import source_files

    package = Path(gflow.__file__).resolve().parent
    files = set(source_files())
    for name in ("problem.py", "model.py", "engine/_solve.py", "sweeps/_run.py"):
        assert package / name in files
    # and on the versions of the libraries it traces (an upgrade of diffrax alone, too)
    from importlib import metadata

    from gflow.engine._compile import _traced_library_versions

    versions = dict(_traced_library_versions())
    assert versions["diffrax"] == metadata.version("diffrax")
    assert versions["equinox"] == metadata.version("equinox")


def test_programs_that_save_samples_or_stop_at_a_horizon_are_stored_too(tmp_path):
    """A descent with `save_every`, flows with samples (`save`, `save_ts`) and a flow stopped
    at a finite `t_max` on the loss clock run from their stored programs in the next process,
    and give the same samples. Each was traced again in every process: the descent's result
    had no known structure, diffrax checked the flows' sample times with a host callback
    (13–15 s a process at d = 8, not even kept by JAX's cache), and the horizon's root finder
    took a LAPACK QR that `jax.export` refuses."""
    code = (
        "import json, gflow\n"
        "p, m = gflow.diagonal(3), gflow.identity_family(3, 2, 0.1, 4.0)\n"
        "d = gflow.descend(p, m, lr=0.1, max_steps=500, save_every=50, save_layers=True)\n"
        "a = gflow.flow(p, m, save=5, save_layers=True)\n"
        "b = gflow.flow(p, m, save_ts=(0.0, 1.0, 10.0))\n"
        "c = gflow.flow(p, m, clock='loss', t_max=10.0, save=4)\n"
        "out = [[r.trajectory.loss.tolist(), r.trajectory.singular_values.tolist()]\n"
        "       for r in (d, a, b, c)]\n"
        "out.append([c.status_label, c.t_end.item(), [r.compile_cache_hit for r in (a, b, c)]])\n"
        "print(json.dumps(out))\n"
    )
    env = dict(os.environ, GFLOW_CACHE_DIR=str(tmp_path))
    env.pop("GFLOW_NO_CACHE", None)

    def run():
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.splitlines()[-1])

    first = run()
    assert first[-1][:2] == ["t_max", 10.0]
    stored = sorted((tmp_path / "gflow-programs").glob("*.jaxexport"))
    assert len(stored) == 4  # the descent and the three flows (none reaches its stiff tail)
    written = [f.stat().st_mtime_ns for f in stored]
    second = run()
    assert second[:-1] == first[:-1]
    assert second[-1][2] == [True, True, True]  # and XLA's compilation came from JAX's cache
    assert [f.stat().st_mtime_ns for f in stored] == written  # loaded, not traced and written


def test_equinox_checks_traced_for_a_stored_program_hold_no_host_callback():
    """Inside `checks_without_host_callbacks` an equinox runtime check traces to a select
    (NaN where it fails), so the program exports; outside, the user's setting (a host
    callback that raises) is back."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from jax import export

    from gflow.engine import _compile

    def checked():  # a new function each time: JAX keeps a function's trace
        return jax.jit(lambda x: eqx.error_if(x, x < 0, "negative"))

    with _compile.checks_without_host_callbacks(), _compile.checks_without_host_callbacks():
        exported = export.export(checked())(jnp.ones(2))
    assert np.array_equal(exported.call(jnp.ones(2)), np.ones(2))
    assert np.all(np.isnan(exported.call(-jnp.ones(2))))
    # the same check traced afterwards is the user's again (equinox keeps a check's trace)
    with pytest.raises(NotImplementedError, match="host_callbacks"):
        export.export(checked())(jnp.ones(2))
    with pytest.raises(Exception, match="negative"):
        checked()(-jnp.ones(2)).block_until_ready()
    with _compile.checks_without_host_callbacks():  # and one kept from before is not used
        assert export.export(checked())(jnp.ones(2)) is not None
