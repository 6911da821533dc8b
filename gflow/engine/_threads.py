"""Work side by side on the CPU cores: independent computations on threads (XLA releases the
GIL while a program runs), and the BLAS threads of the LAPACK that XLA:CPU calls.

jaxlib factorises (Cholesky, LU) through SciPy's LAPACK, whose OpenBLAS starts a thread per
core and keeps them spinning between calls. On the small matrices of a sweep's stiff tails
(a few hundred unknowns) that spinning takes a core from the other tails and speeds nothing up
(measured in benchmarks/README, `scale`): a flow whose largest factorisation is small, and
runs side by side, ask for one BLAS thread each."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import os
import queue
import threading


def available_cores() -> int:
    """The CPU cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def run_concurrently(calls, threads=None) -> list:
    """The results of `calls` (functions of no argument), in order, computed on up to
    `threads` daemon threads (default: `available_cores()`). Daemon threads, so that a Ctrl-C
    reaches the caller at once and the process can exit without waiting for runs in flight;
    the first exception raised by a call is raised here."""
    threads = threads_for(len(calls), threads)
    if threads <= 1:
        return [call() for call in calls]
    todo, done = queue.Queue(), queue.Queue()
    for k in range(len(calls)):
        todo.put(k)

    def work():
        while True:
            try:
                k = todo.get_nowait()
            except queue.Empty:
                return
            try:
                done.put((k, calls[k](), None))
            except BaseException as error:  # handed to the caller, which raises it
                done.put((k, None, error))

    for _ in range(threads):
        threading.Thread(target=work, daemon=True).start()
    results = [None] * len(calls)
    for _ in calls:
        k, value, error = done.get()
        if error is not None:
            while not todo.empty():  # start nothing more
                todo.get_nowait()
            raise error
        results[k] = value
    return results


@functools.cache
def _scipy_openblas():
    """SciPy's bundled OpenBLAS (the LAPACK jaxlib calls), or None where there is none; looked
    up once (every flow asks)."""
    try:
        import scipy
    except ImportError:
        return None
    libs = os.path.join(os.path.dirname(os.path.dirname(scipy.__file__)), "scipy.libs")
    for path in glob.glob(os.path.join(libs, "libscipy_openblas*")):
        try:
            lib = ctypes.CDLL(path)
            get, set_ = lib.scipy_openblas_get_num_threads, lib.scipy_openblas_set_num_threads
        except (OSError, AttributeError):
            continue
        get.restype, set_.argtypes = ctypes.c_int, [ctypes.c_int]
        return get, set_
    return None


@contextlib.contextmanager
def blas_threads(n: int | None):
    """Within the block, SciPy's OpenBLAS uses `n` threads (None, or no such library: as it
    is); the previous number is restored after."""
    library = _scipy_openblas() if n is not None else None
    if library is None:
        yield
        return
    get, set_ = library
    before = get()
    set_(n)
    try:
        yield
    finally:
        set_(before)


# Largest factorised matrix (rows) for which one BLAS thread is faster. Measured on 2 cores:
# dense tails at 192 unknowns 1.75x faster with one thread; the Gauss-Newton inverse at
# |Omega| = 704 (d = 50) 1.15x slower.
ONE_THREAD_UP_TO = 400


def factorised_rows(model, options, observed: int) -> int:
    """Rows of the largest matrix a flow's stiff tail factorises: the P × P stage matrix on the
    dense path (or where CG may fall back to it), else the Gauss–Newton Gram (|Ω|,
    `observed`) or the 64-column sketch."""
    from ._rosenbrock import Rodas4

    size = sum(w[0].size if w.ndim == 3 else w.size for w in model.layers)
    auto = options.linear_solver == "auto"
    if options.linear_solver == "dense" or (auto and size <= Rodas4.dense_max):
        return size
    preconditioner = observed if options.preconditioner == "gauss-newton" else 64
    if auto and size <= Rodas4.fallback_max:
        return max(size, preconditioner)
    return preconditioner


def blas_threads_for(rows: int, side_by_side: int = 1):
    """`blas_threads(1)` where the factorisations are small (`rows`) or runs go side by side,
    else as it is."""
    return blas_threads(1 if side_by_side > 1 or rows <= ONE_THREAD_UP_TO else None)


def threads_for(calls: int, threads: int | None = None) -> int:
    """How many threads `run_concurrently` uses for `calls` calls."""
    return max(1, min(threads or available_cores(), calls))
