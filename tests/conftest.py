import gc

import numpy as np
import pytest

import gflow  # noqa: F401  (switches JAX to float64 before any test builds arrays)


@pytest.fixture(scope="session")
def rng():
    return np.random.default_rng(20260301)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """A test module's compiled programs are released when it ends (its module-scoped
    fixtures share them while it runs): every program holds hundreds of memory mappings, and
    a session that kept all of them would pass Linux's per-process limit (see
    gflow.engine._compile.MAX_LIVE_PROGRAMS)."""
    yield
    import jax

    from gflow.engine import _compile

    _compile._PROGRAMS.clear()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def tail_stages():
    """problem ↦ the stages of one stiff-tail step at the default options (RODAS4P2 or RODAS5P
    by its observed entries): the unit in which the tail's field evaluations are counted."""
    from gflow.engine._flow import observed_bound
    from gflow.engine._rosenbrock import TABLEAUS
    from gflow.engine._solve import tail_tableau

    def stages(problem):
        return TABLEAUS[tail_tableau(gflow.FlowOptions(), observed_bound(problem))].stages

    return stages
