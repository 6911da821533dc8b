"""Compiling each program once: in this process (`program`: one executable per kind, options,
batching and argument shapes, counted by `compile_count`) and across processes (the persistent
caches on disk: JAX's compiled executables and gflow's exported, traced programs).

On by default, in ``$GFLOW_CACHE_DIR``, else ``$XDG_CACHE_HOME/gflow/xla``, else
``~/.cache/gflow/xla``. ``GFLOW_NO_CACHE=1`` (or ``gflow --no-cache``) turns it off; a cache
directory the user configured in JAX itself (``JAX_COMPILATION_CACHE_DIR``) is left alone.
Entries are written under a file lock and the directory is capped at ``MAX_BYTES`` (least
recently used entries go first), so concurrent processes such as sweep workers can share it.
Clearing it is deleting the directory.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import jax

MAX_BYTES = 2 * 1024**3
_HITS = {"count": 0}


def default_dir() -> Path:
    if os.environ.get("GFLOW_CACHE_DIR"):
        return Path(os.environ["GFLOW_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gflow" / "xla"


def enable(path: str | os.PathLike | None = None) -> Path | None:
    """Use the persistent cache at `path` (default: `default_dir()`). Must run before the first
    compilation of the process: JAX reads the setting once. Returns the directory, or None where
    it cannot be created (the cache is then simply not used)."""
    directory = Path(path) if path is not None else default_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", os.fspath(directory))
    # Programs that compile in under 0.1 s (eager operations) are not worth a file: they
    # would only lengthen the cache's directory scans.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return directory


def disable() -> None:
    """No persistent cache for this process (before its first compilation)."""
    jax.config.update("jax_compilation_cache_dir", None)


def cache_hits() -> int:
    """Programs this process has loaded from the persistent cache so far."""
    return _HITS["count"]


@dataclass(frozen=True)
class CompileTime:
    """Seconds spent tracing, lowering and compiling (or loading) a program, and whether XLA's
    compilation came from the persistent cache (None: the program was already in memory)."""

    seconds: float
    cache_hit: bool | None

    def __add__(self, other: CompileTime) -> CompileTime:
        """Two programs together (a flow and its stiff tail): their seconds added; compiled
        if either was, else from the cache if either was, else already in memory."""
        hits = (self.cache_hit, other.cache_hit)
        hit = False if False in hits else (True if True in hits else None)
        return CompileTime(self.seconds + other.seconds, hit)


ALREADY_COMPILED = CompileTime(0.0, None)


_COUNTS = {"flow": 0, "flow-tail": 0, "descend": 0, "descend-batch": 0}


def compile_count(kind: str = "flow") -> int:
    """How many programs of `kind` (`"flow"`: flows and batches of flows, `"flow-tail"`: stiff
    tails run as programs of their own, by a `flow` or `flow_batch` that reaches its tail
    and by a sweep's tails apart, `"descend"`: discrete optimizers) this process has
    compiled or loaded from the persistent cache. A repeated call with the same options and
    shapes reuses its program and does not count."""
    return _COUNTS[kind]


def fields_of(config) -> tuple:
    """A config's fields as (name, value) pairs: an unabbreviated key for a program file."""
    import dataclasses

    return tuple((f.name, getattr(config, f.name)) for f in dataclasses.fields(config))


# Compiled programs kept alive in this process, least recently used first. Each holds its
# machine code in ~500–1,000 memory mappings, and Linux allows a process 65,530 of them
# (vm.max_map_count): a process that kept every program (a long sweep of shape groups, a
# test session, `gflow reproduce --full`) would crash in XLA once past ~100 programs. An
# evicted program that is needed again comes back from the persistent cache.
MAX_LIVE_PROGRAMS = 32
_PROGRAMS: OrderedDict = OrderedDict()


def program(kind: str, config, args, make_fn, *, extra=(), out_like=None, remember=True):
    """The compiled program `make_fn()` for `args`, built once per process for its `kind`,
    `config` (options), `extra` (batching) and the structure and shapes of `args`: a sweep
    compiles once per shape group, and a later call with other shapes cannot silently recompile
    (an executable only accepts its own shapes). Returns (a callable taking `args`, its
    `CompileTime`). With `remember=False` (a config without a stable identity) nothing is kept.
    Threads compile one at a time (a sweep's tail threads may compile a later tail stage)."""
    with _ONE_AT_A_TIME:
        return _program(kind, config, args, make_fn, extra, out_like, remember)


_ONE_AT_A_TIME = threading.RLock()


def _program(kind, config, args, make_fn, extra, out_like, remember):
    leaves = jax.tree_util.tree_leaves(args)
    options = compiler_options()
    key = (
        kind,
        config,
        extra,
        jax.tree_util.tree_structure(args),
        tuple((x.shape, x.dtype) for x in leaves),
        tuple(sorted(options.items())),
    )
    hit = _PROGRAMS.get(key) if remember else None
    if hit is not None:
        _PROGRAMS.move_to_end(key)
        return hit, ALREADY_COMPILED
    file_key = repr((kind, fields_of(config), extra)) if remember else None
    # `make_fn` is called only if the program is traced: a program loaded from the cache
    # never imports what building it needs (diffrax, for flows)
    compiled, compile_time = compile_timed(
        lambda *a: make_fn()(*a),
        *args,
        kind=kind,
        key=file_key,
        out_like=out_like,
        options=options,
    )
    if remember:
        _PROGRAMS[key] = compiled
        while len(_PROGRAMS) > MAX_LIVE_PROGRAMS:
            _PROGRAMS.popitem(last=False)
    return compiled, compile_time


def compile_timed(fn, *args, kind: str, key=None, out_like=None, options=None):
    """`jax.jit(fn)` compiled for `args` with XLA's `options` (default: `compiler_options()`):
    (a callable taking `args`, its `CompileTime`).

    With a `key` (a string naming the program: its options and batching) and `out_like` (any
    pytree of the output's structure), the traced program is also kept in the cache directory
    (`jax.export`) and the next process compiles it from there without tracing `fn` again,
    which is most of the time of a start-up; XLA's compilation of it then comes from JAX's own
    persistent cache. The file's name hashes the key with everything else a program depends on
    (argument shapes, gflow's own source, the versions of JAX and of the libraries a program
    traces, the device, XLA's flags), so an edit to gflow or an upgrade never loads a stale
    program; an unreadable file is retraced.
    Programs are stored flat (arrays in, arrays out): Equinox modules are not registered for
    `jax.export`'s serialisation of pytrees.
    """
    _COUNTS[kind] += 1
    options = compiler_options() if options is None else options
    start = time.perf_counter()
    leaves, in_tree = jax.tree_util.tree_flatten(args)
    out_tree = None if out_like is None else jax.tree_util.tree_structure(out_like)
    path = None if out_tree is None else _program_path(key, args)
    hits = cache_hits()
    if path is not None:
        exported = _load(path)
        if exported is not None:
            compiled = jax.jit(exported.call).lower(*leaves).compile(compiler_options=options)
            program = _unflattening(compiled, out_tree)
            return program, CompileTime(time.perf_counter() - start, cache_hits() > hits)
    structure = {}

    def flat_fn(*flat):
        out_leaves, structure["out"] = jax.tree_util.tree_flatten(
            fn(*jax.tree_util.tree_unflatten(in_tree, flat))
        )
        return out_leaves

    with checks_without_host_callbacks():
        exported = None if path is None else _export(flat_fn, leaves)
        if exported is None:
            compiled = jax.jit(flat_fn).lower(*leaves).compile(compiler_options=options)
    if exported is not None:
        compiled = jax.jit(exported.call).lower(*leaves).compile(compiler_options=options)
        if structure["out"] == out_tree:
            _store(path, exported)
    program = _unflattening(compiled, structure["out"])
    return program, CompileTime(time.perf_counter() - start, cache_hits() > hits)


# XLA's CPU compiler hands dots, and what it fuses with them, to YNNPACK (jaxlib 0.10 and
# 0.12). Two such programs running at once on two threads, as a sweep's stiff tails do, grow
# the process without bound: a jitted loop of one 288 × 320 × 96 float64 dot on two threads
# by ~40 MB/s on jaxlib 0.10.2 (15 GB in 40 s on 0.12.1), two Radau tails by ~20 MB/s;
# nothing with the fusion off. Without it gflow's solves were 1.1–1.3× faster at d ≤ 50 and
# on the d = 8 sweep, and within 3% at d = 100 and 200 (benchmarks/README, "seventeenth
# session"; `python -m benchmarks.fusion`).
CPU_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def compiler_options() -> dict:
    """XLA options gflow compiles its programs with: `CPU_COMPILER_OPTIONS` on the CPU, where
    this jaxlib knows them; none elsewhere."""
    if jax.default_backend() != "cpu" or not CPU_COMPILER_OPTIONS:
        return {}
    options = dict(CPU_COMPILER_OPTIONS)
    return options if _accepted(tuple(sorted(options.items()))) else {}


@functools.cache
def _accepted(options: tuple) -> bool:
    """Whether this jaxlib's XLA takes `options` (an older or newer one may not know them)."""
    try:
        jax.jit(lambda x: x + 1).lower(0.0).compile(compiler_options=dict(options))
    except Exception:  # XLA's "No such compile option"
        return False
    return True


def _unflattening(compiled, out_tree):
    """A callable taking the program's pytrees; `.compiled`: XLA's executable (its HLO text)."""

    def call(*a):
        return jax.tree_util.tree_unflatten(out_tree, compiled(*jax.tree_util.tree_leaves(a)))

    call.compiled = compiled
    return call


def _program_path(key, args) -> Path | None:
    directory = jax.config.jax_compilation_cache_dir
    if key is None or not directory:
        return None
    import hashlib

    import jaxlib

    device = jax.devices()[0]
    parts = (
        key,
        str(jax.tree_util.tree_structure(args)),
        [(x.shape, str(x.dtype)) for x in jax.tree_util.tree_leaves(args)],
        _source_hash(),
        _traced_library_versions(),
        jax.__version__,
        jaxlib.__version__,
        device.platform,
        device.device_kind,
        jax.device_count(),
        bool(jax.config.jax_enable_x64),
        os.environ.get("XLA_FLAGS", ""),
    )
    digest = hashlib.sha256(repr(parts).encode()).hexdigest()
    return Path(directory) / "gflow-programs" / f"{digest}.jaxexport"


def source_files() -> list[Path]:
    """The source a stored program may have traced: the whole package, not the engine alone
    (the loss and residual live in `problem.py`, the products and gradients in `model.py`)."""
    package = Path(__file__).resolve().parent.parent
    return sorted(package.rglob("*.py"))


# Libraries whose code a stored program may have traced (jax and jaxlib are keyed apart).
TRACED_LIBRARIES = ("diffrax", "equinox", "lineax", "optimistix", "optax")


@functools.cache
def _traced_library_versions() -> tuple:
    from importlib import metadata

    versions = []
    for name in TRACED_LIBRARIES:
        try:
            versions.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            versions.append((name, None))
    return tuple(versions)


@functools.cache
def _source_hash() -> str:
    import hashlib

    h = hashlib.sha256()
    for file in source_files():
        h.update(file.read_bytes())
    return h.hexdigest()


_CHECKS = {"lock": threading.Lock(), "depth": 0, "saved": None}


@contextlib.contextmanager
def checks_without_host_callbacks():
    """Equinox's runtime checks traced in here select NaN where they fail, instead of calling
    the host to raise (as if ``EQX_ON_ERROR=nan``). diffrax checks a flow's sample times
    (`saveat.ts` increasing and within the solve) and a fixed step's sign that way, and a
    program with a host callback can be neither exported nor kept by JAX's persistent cache:
    every process traced and compiled a flow with samples again (13–15 s at d = 8, against
    0.7 s loading one without). gflow builds those arguments valid (sample grids clipped into
    their phase, positive steps) and reports a solve's failures as statuses, so these checks
    never fire in its programs. A user's own ``EQX_ON_ERROR`` (breakpoint, off) is left
    alone, and so is an equinox without this module-level setting (its programs are then
    traced again in each process, as before). Re-entrant and thread-safe: the setting holds
    while any thread is inside."""
    import equinox._errors as errors

    def switch(mode):
        errors.EQX_ON_ERROR = mode
        # equinox traces a check once per signature and keeps it: forget the other mode's
        jitted = getattr(getattr(errors, "branched_error_if_impl_jit", None), "_cached", None)
        if hasattr(jitted, "clear_cache"):
            jitted.clear_cache()

    with _CHECKS["lock"]:
        if _CHECKS["depth"] == 0:
            _CHECKS["saved"] = getattr(errors, "EQX_ON_ERROR", None)
            if _CHECKS["saved"] == "raise":
                switch("nan")
        _CHECKS["depth"] += 1
    try:
        yield
    finally:
        with _CHECKS["lock"]:
            _CHECKS["depth"] -= 1
            if _CHECKS["depth"] == 0 and _CHECKS["saved"] == "raise":
                switch("raise")


def _export(flat_fn, leaves):
    """`jax.export` of the program, or None where it refuses: programs with XLA custom calls
    that carry no compatibility guarantee (a LAPACK QR's `ormqr`, lineax's default for a
    non-square solve: why the horizon's root finder solves by SVD) or with host callbacks
    (`checks_without_host_callbacks` keeps equinox's out) cannot be exported; they are traced
    again in each process. (An error of the program itself is raised again by that second
    trace.)"""
    from jax import export

    try:
        return export.export(jax.jit(flat_fn))(*leaves)
    except Exception:
        return None


def _load(path: Path):
    """The exported program at `path`, or None (missing, partly written, another build)."""
    from jax import export

    try:
        return export.deserialize(bytearray(path.read_bytes()))
    except Exception:
        return None


def _store(path: Path, exported) -> None:
    """Write atomically (a temporary name, then rename): a concurrent reader sees the whole
    file or none."""
    import tempfile

    try:
        blob = exported.serialize()
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
            f.write(blob)
        os.replace(f.name, path)
    except Exception:  # a program that cannot be written is still usable in this process
        return


def _count_hit(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _HITS["count"] += 1


def _setup() -> None:
    jax.monitoring.register_event_listener(_count_hit)
    if os.environ.get("GFLOW_NO_CACHE", "0") not in ("", "0"):
        return
    if jax.config.jax_compilation_cache_dir:  # the user's own JAX setting wins
        return
    enable()


_setup()
