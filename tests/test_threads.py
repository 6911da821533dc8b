"""Work side by side: the thread runner and the BLAS thread setting."""

import threading
import time

import pytest

from gflow.engine import _threads


def test_results_come_back_in_order_and_run_side_by_side():
    seen = set()

    def call(k):
        def run():
            seen.add(threading.get_ident())
            time.sleep(0.05 * (3 - k))  # the first call finishes last
            return k * k

        return run

    assert _threads.run_concurrently([call(k) for k in range(3)], threads=3) == [0, 1, 4]
    assert len(seen) == 3  # three threads, none of them the caller's
    assert threading.get_ident() not in seen


def test_the_first_error_reaches_the_caller():
    def boom():
        raise ValueError("tail 2 failed")

    with pytest.raises(ValueError, match="tail 2 failed"):
        _threads.run_concurrently([lambda: 1, boom, lambda: 3], threads=2)


def test_one_thread_runs_the_calls_on_the_caller():
    here = []
    out = _threads.run_concurrently([lambda: here.append(threading.get_ident()) or 7], threads=4)
    assert out == [7] and here == [threading.get_ident()]


def test_blas_threads_are_set_inside_the_block_and_restored_after():
    library = _threads._scipy_openblas()
    if library is None:
        pytest.skip("no SciPy OpenBLAS in this environment")
    get, _ = library
    before = get()
    with _threads.blas_threads(1):
        assert get() == 1
    assert get() == before
    with _threads.blas_threads(None):  # None leaves it alone
        assert get() == before


@pytest.mark.parametrize(
    ("width", "depth", "options", "rows"),
    [
        (8, 3, {}, 192),  # dense tail: the P × P stage matrix
        (8, 5, {}, 320),  # CG that may fall back to the P × P matrix
        (8, 5, {"linear_solver": "cg"}, 40),  # pure CG: the Gram only
        (24, 2, {}, 40),  # P = 1,152 > fallback_max: the Gram only
        (8, 5, {"preconditioner": "spectral", "linear_solver": "cg"}, 64),
    ],
)
def test_the_largest_factorised_matrix_counts_the_dense_fallback(width, depth, options, rows):
    import jax.numpy as jnp

    import gflow

    model = gflow.Factorization(tuple(jnp.zeros((width, width)) for _ in range(depth)))
    assert _threads.factorised_rows(model, gflow.FlowOptions(**options), observed=40) == rows
