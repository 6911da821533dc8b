"""What a sweep is: its grid (`SweepSpec`), checked whole before any work, and the order in
which its flows run.

Points are grouped by shape (depth and matrix size need their own compiled program), and within
a group sorted by expected flow length (escape time grows like α^{−(L−2)}), because a vmapped
batch costs about (slowest member's steps) × (batch size). Each chunk of `chunk_size` points is
one batch.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field

import numpy as np

from ..engine import FlowOptions
from ..engine._options import BATCHED_TAILS_REFUSED

DYNAMIC_AXES = ("alpha", "m", "seed", "value", "noise", "density")


STATIC_AXES = ("depth", "dim", "blocks", "block_size", "rank")


DEFAULTS = {
    "alpha": 0.01,
    "m": 4.0,
    "seed": 0,
    "value": 1.0,
    "noise": 0.0,
    "density": 0.5,
    "depth": 3,
    "dim": 4,
    "blocks": 2,
    "block_size": 2,
    "rank": 1,
}


PROBLEMS = ("diagonal", "block-diagonal", "bernoulli")


INITS = ("identity", "gaussian", "orthogonal")


DEPTH_MODES = ("auto", "compile", "pad")


TAIL_MODES = ("apart", "batch")


# Padding costs more per step and saves one compilation per extra depth: it pays up to grids
# of a few thousand flows (see `depth_mode`; measured in benchmarks/README).
PAD_MAX_FLOWS = 4096


def _whole(v, low):
    return isinstance(v, int | np.integer) and not isinstance(v, bool) and v >= low


def _real(v):
    return isinstance(v, int | float | np.number) and not isinstance(v, bool)


_VALID = {
    "alpha": (lambda a: _real(a) and math.isfinite(a) and a > 0, "finite and > 0"),
    "m": (lambda m: _real(m) and m > 1, "> 1 (m = inf allowed)"),
    "seed": (lambda s: _whole(s, 0), "an integer >= 0"),
    "value": (lambda w: _real(w) and math.isfinite(w), "finite"),
    "noise": (lambda s: _real(s) and math.isfinite(s) and s >= 0, "finite and >= 0"),
    "density": (lambda p: _real(p) and 0 < p <= 1, "in (0, 1]"),
    "depth": (lambda n: _whole(n, 1), "an integer >= 1"),
    "dim": (lambda n: _whole(n, 1), "an integer >= 1"),
    "blocks": (lambda n: _whole(n, 1), "an integer >= 1"),
    "block_size": (lambda n: _whole(n, 1), "an integer >= 1"),
    "rank": (lambda n: _whole(n, 1), "an integer >= 1"),
}


@dataclass(frozen=True)
class SweepSpec:
    """A grid of flows.

    - `axes`: axis name → values; names from `alpha`, `m`, `seed`, `value`, `noise`, `density`
      (batched in one program) and `depth`, `dim`, `blocks`, `block_size`, `rank` (one program
      per combination). The grid is their cartesian product.
    - `fixed`: values for parameters that are not axes (defaults: `DEFAULTS`).
    - `problem`: `diagonal` (d = dim), `block-diagonal` (n = blocks, s = block_size) or
      `bernoulli` (dim × dim, density, rank); `init`: `identity`, `gaussian` or `orthogonal`.
    - `options`: `FlowOptions` for every flow; `chunk_size`: flows per batch;
      `top`: singular values stored per flow.
    - `depth_mode`: `compile` (one program per depth), `pad` (one program for all depths:
      every model padded to the largest depth with frozen identity layers; same endpoints,
      fewer compilations, more work per step) or `auto` (default): `pad` for grids of up to
      `PAD_MAX_FLOWS` flows, where compilation dominates, `compile` for larger ones
      (benchmarks/README: `sweep_throughput`).
    - `tails`: where members that reach the stiff tail (`solver="auto"`) finish it: `apart`
      (default), each alone after its batch, so a batch costs the sum of its members' tails
      rather than its stiffest member's tail times the batch size; or `batch`, inside the
      vmapped batch (one program, every member stepping until the slowest is done).
    - `sensitivity`: K > 0 also runs every point from K inits perturbed at relative size
      `sensitivity_eps` (`gflow.sensitivity`), with the same compiled programs, and stores how
      many digits of its singular values, of srank − 1 and (identity family) of σ_B from the
      layers are reproducible (`digits_*`, −1 where a member did not converge); it costs
      K + 1 times the flows.
    """

    axes: dict
    fixed: dict = field(default_factory=dict)
    problem: str = "diagonal"
    init: str = "identity"
    options: FlowOptions = field(default_factory=FlowOptions)
    chunk_size: int = 64
    top: int = 4
    depth_mode: str = "auto"
    tails: str = "apart"
    sensitivity: int = 0
    sensitivity_eps: float = 1e-12

    def __post_init__(self):
        if not self.axes:
            raise ValueError("a sweep needs at least one axis")
        axes = {}
        for name, values in self.axes.items():
            if name not in DEFAULTS:
                raise ValueError(f"unknown axis {name!r}; choose from {sorted(DEFAULTS)}")
            values = tuple(_scalar(v) for v in np.atleast_1d(np.asarray(values, dtype=object)))
            if not values:
                raise ValueError(f"axis {name!r} has no values")
            axes[name] = values
        object.__setattr__(self, "axes", axes)
        for name in self.fixed:
            if name not in DEFAULTS:
                raise ValueError(f"unknown parameter {name!r} in fixed")
        if self.problem not in PROBLEMS:
            raise ValueError(f"unknown problem {self.problem!r}; choose from {PROBLEMS}")
        if self.init not in INITS:
            raise ValueError(f"unknown init {self.init!r}; choose from {INITS}")
        if self.depth_mode not in DEPTH_MODES:
            raise ValueError(f"unknown depth_mode {self.depth_mode!r}; choose from {DEPTH_MODES}")
        if self.tails not in TAIL_MODES:
            raise ValueError(f"unknown tails {self.tails!r}; choose from {TAIL_MODES}")
        if self.tails == "batch" and self.options.tails_batch_refused:
            raise ValueError(BATCHED_TAILS_REFUSED)
        if self.options.save or self.options.save_ts is not None:
            raise ValueError(
                "a sweep stores each flow's endpoint, not its trajectory: options save and "
                "save_ts are for flow and flow_batch"
            )
        if not (isinstance(self.chunk_size, int) and self.chunk_size >= 1):
            raise ValueError("chunk_size must be a positive integer")
        if not (isinstance(self.sensitivity, int) and self.sensitivity >= 0):
            raise ValueError(f"sensitivity must be an integer >= 0, got {self.sensitivity!r}")
        if not (math.isfinite(self.sensitivity_eps) and self.sensitivity_eps > 0):
            raise ValueError(
                f"sensitivity_eps must be finite and > 0, got {self.sensitivity_eps!r}"
            )
        # Every value is checked here, before a store is created or any work done (models
        # are built traced, where the builders could not check their scalars).
        for name, (ok, rule) in _VALID.items():
            values = self.axes.get(name, (self.fixed.get(name, DEFAULTS[name]),))
            bad = [v for v in values if not ok(v)]
            if bad:
                raise ValueError(f"{name} must be {rule}, got {bad[0]!r}")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(len(v) for v in self.axes.values())

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def points(self) -> list[dict]:
        """Every grid point as a full parameter dict, in canonical (row-major) order."""
        base = DEFAULTS | dict(self.fixed)
        names = list(self.axes)
        return [
            base | dict(zip(names, combo, strict=True))
            for combo in itertools.product(*self.axes.values())
        ]

    @property
    def pads_depths(self) -> bool:
        if self.depth_mode == "auto":
            return len(self.axes.get("depth", ())) > 1 and self.size <= PAD_MAX_FLOWS
        return self.depth_mode == "pad"

    @property
    def max_depth(self) -> int:
        return int(max(self.axes.get("depth", [(DEFAULTS | self.fixed)["depth"]])))

    def to_json(self) -> str:
        d = asdict(self)
        d["options"] = asdict(self.options)
        return json.dumps(d, default=_json_default)

    @classmethod
    def from_dict(cls, d: dict) -> SweepSpec:
        d = dict(d)
        options = d.pop("options", {}) or {}
        if isinstance(options, dict):
            options = FlowOptions(**{k: _scalar(v) for k, v in options.items()})
        axes = {k: [_scalar(x) for x in v] for k, v in d.pop("axes").items()}
        sweep = d.pop("sweep", {}) or {}
        return cls(axes=axes, options=options, **d, **sweep)


def _scalar(v):
    if isinstance(v, str) and v.strip().lower() in ("inf", "+inf", "infinity"):
        return math.inf
    if isinstance(v, np.generic):
        return v.item()
    return v


def _json_default(o):
    if isinstance(o, tuple):
        return list(o)
    return str(o)


def _expected_length(point: dict) -> float:
    depth, alpha = int(point["depth"]), float(point["alpha"])
    if depth >= 3:
        return alpha ** (-(depth - 2))
    return math.log(1.0 / alpha) if alpha < 1 else 0.0


def execution_order(spec: SweepSpec) -> list[tuple[tuple, list[int]]]:
    """Groups of canonical point indices: one group per static shape key, each sorted by
    expected flow length and cut into chunks of `chunk_size`."""
    points = spec.points()
    groups: dict[tuple, list[int]] = {}
    pads = spec.pads_depths  # then every depth shares one program: not part of the key
    for i, p in enumerate(points):
        key = (0 if pads else p["depth"], p["dim"], p["blocks"], p["block_size"], p["rank"])
        groups.setdefault(key, []).append(i)
    order = []
    for key in sorted(groups):
        idx = sorted(groups[key], key=lambda i: _expected_length(points[i]))
        for start in range(0, len(idx), spec.chunk_size):
            order.append((key, idx[start : start + spec.chunk_size]))
    return order


def load_spec(path) -> SweepSpec:
    """A `SweepSpec` from a TOML file (`gflow sweep --example` prints one)."""
    import tomllib

    with open(path, "rb") as f:
        return SweepSpec.from_dict(tomllib.load(f))
