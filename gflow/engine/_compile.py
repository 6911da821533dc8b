"""The persistent compilation cache: a compiled flow is kept on disk and reused by the next
process that needs the same program (same options, shapes, devices and JAX version).

On by default, in ``$GFLOW_CACHE_DIR``, else ``$XDG_CACHE_HOME/gflow/xla``, else
``~/.cache/gflow/xla``. ``GFLOW_NO_CACHE=1`` (or ``gflow --no-cache``) turns it off; a cache
directory the user configured in JAX itself (``JAX_COMPILATION_CACHE_DIR``) is left alone.
Entries are written under a file lock and the directory is capped at ``MAX_BYTES`` (least
recently used entries go first), so concurrent processes such as sweep workers can share it.
Clearing it is deleting the directory.
"""

from __future__ import annotations

import os
import time
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


ALREADY_COMPILED = CompileTime(0.0, None)


_COUNTS = {"flow": 0, "descend": 0}


def compile_count(kind: str = "flow") -> int:
    """How many programs of `kind` (`"flow"`: flows and batches of flows, `"descend"`: discrete
    optimizers) this process has compiled or loaded from the persistent cache. A repeated call
    with the same options and shapes reuses its program and does not count."""
    return _COUNTS[kind]


def fields_of(config) -> tuple:
    """A config's fields as (name, value) pairs: an unabbreviated key for a program file."""
    import dataclasses

    return tuple((f.name, getattr(config, f.name)) for f in dataclasses.fields(config))


_PROGRAMS: dict = {}


def program(kind: str, config, args, make_fn, *, extra=(), out_like=None, remember=True):
    """The compiled program `make_fn()` for `args`, built once per process for its `kind`,
    `config` (options), `extra` (batching) and the structure and shapes of `args`: a sweep
    compiles once per shape group, and a later call with other shapes cannot silently recompile
    (an executable only accepts its own shapes). Returns (a callable taking `args`, its
    `CompileTime`). With `remember=False` (a config without a stable identity) nothing is kept."""
    leaves = jax.tree_util.tree_leaves(args)
    key = (
        kind,
        config,
        extra,
        jax.tree_util.tree_structure(args),
        tuple((x.shape, x.dtype) for x in leaves),
    )
    hit = _PROGRAMS.get(key) if remember else None
    if hit is not None:
        return hit, ALREADY_COMPILED
    file_key = repr((kind, fields_of(config), extra)) if remember else None
    compiled, compile_time = compile_timed(
        make_fn(), *args, kind=kind, key=file_key, out_like=out_like
    )
    if remember:
        _PROGRAMS[key] = compiled
    return compiled, compile_time


def compile_timed(fn, *args, kind: str, key=None, out_like=None):
    """`jax.jit(fn)` compiled for `args`: (a callable taking `args`, its `CompileTime`).

    With a `key` (a string naming the program: its options and batching) and `out_like` (any
    pytree of the output's structure), the executable is also kept whole in the cache directory
    and loaded by the next process without tracing or lowering `fn` again, which is most of the
    time of a cache hit. The file's name hashes the key with everything else a program depends
    on (argument shapes, gflow's own source, the JAX version, the device, XLA's flags), so an
    edit to gflow or an upgrade never loads a stale program; an unreadable file is recompiled.
    Programs are stored flat (arrays in, arrays out): pytree definitions do not survive pickling.
    """
    _COUNTS[kind] += 1
    start = time.perf_counter()
    in_tree = jax.tree_util.tree_structure(args)
    out_tree = None if out_like is None else jax.tree_util.tree_structure(out_like)
    path = None if out_tree is None else _program_path(key, args)
    if path is not None:
        loaded = _load(path)
        if loaded is not None:
            return _unflattening(loaded, out_tree), CompileTime(time.perf_counter() - start, True)
    hits = cache_hits()
    structure = {}

    def flat_fn(*leaves):
        out_leaves, structure["out"] = jax.tree_util.tree_flatten(
            fn(*jax.tree_util.tree_unflatten(in_tree, leaves))
        )
        return out_leaves

    compiled = jax.jit(flat_fn).lower(*jax.tree_util.tree_leaves(args)).compile()
    elapsed = time.perf_counter() - start
    if path is not None and structure["out"] == out_tree:
        _store(path, compiled)
    program = _unflattening(compiled, structure["out"])
    return program, CompileTime(elapsed, cache_hits() > hits)


def _unflattening(compiled, out_tree):
    return lambda *a: jax.tree_util.tree_unflatten(
        out_tree, compiled(*jax.tree_util.tree_leaves(a))
    )


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
        jax.__version__,
        jaxlib.__version__,
        device.platform,
        device.device_kind,
        jax.device_count(),
        bool(jax.config.jax_enable_x64),
        os.environ.get("XLA_FLAGS", ""),
    )
    digest = hashlib.sha256(repr(parts).encode()).hexdigest()
    return Path(directory) / "gflow-programs" / f"{digest}.pkl"


def _source_hash() -> str:
    if "source" not in _SOURCE:
        import hashlib

        h = hashlib.sha256()
        for file in sorted(Path(__file__).parent.rglob("*.py")):
            h.update(file.read_bytes())
        _SOURCE["source"] = h.hexdigest()
    return _SOURCE["source"]


_SOURCE: dict = {}


def _load(path: Path):
    import pickle

    from jax.experimental import serialize_executable

    try:
        payload, in_tree, out_tree = pickle.loads(path.read_bytes())
        compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    except Exception:  # missing, partly written by a crashed process, or from another build
        return None
    return compiled


def _store(path: Path, compiled) -> None:
    """Write atomically (a temporary name, then rename): a concurrent reader sees the whole
    file or none."""
    import pickle
    import tempfile

    from jax.experimental import serialize_executable

    try:
        blob = pickle.dumps(serialize_executable.serialize(compiled))
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
            f.write(blob)
        os.replace(f.name, path)
    except Exception:  # a program that cannot be serialized is still usable in this process
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
