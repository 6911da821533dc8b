"""The front door of the engine: `flow` and `flow_batch` validate, compile once per options,
batching and shapes (`_compiled_solver`), and time the solve; `pad_depth` and `stack` prepare
models and batches."""

from __future__ import annotations

import functools
import threading
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..model import Factorization
from ..problem import Problem
from ._compile import ALREADY_COMPILED, program
from ._options import BATCHED_TAILS_REFUSED, FlowOptions
from ._result import FlowResult, Status
from ._threads import blas_threads_for, factorised_rows, run_concurrently, threads_for


def _compiled_solver(
    problem, model, options, in_axes=None, devices=None, depths=None, defer_tail=False
):
    """One compiled program per (options, batching, shapes, devices), cached: a sweep compiles
    once per shape group, and a later call with other shapes cannot silently recompile (the
    cached executable only accepts its own shapes). With `depths` (an int array, batched like
    the model) the program takes it as a third argument: depth-padded models (`pad_depth`).
    `defer_tail`: members that reach the stiff tail stop there (`solve`, `finish_tail`)."""
    devices = tuple(devices) if devices is not None and len(devices) > 1 else None
    args = (problem, model) if depths is None else (problem, model, depths)
    if depths is not None and in_axes is not None:
        in_axes = (*in_axes, 0)
    axis = None if in_axes is None else "flows"

    observed = observed_bound(problem)
    rank = None
    if defer_tail and options.stiff_tail:
        # a head that defers its tail runs no stiff solver: its tail program takes the rank
        # and the tail's options, so heads that differ only there are one program
        options = options.head()
    else:
        rank = tangent_rank(problem, options, observed)

    def make_fn():
        from ._solve import solve  # diffrax and the solvers: only to trace a program

        kw = dict(batch_axis=axis, observed=observed, defer_tail=defer_tail, tangent_rank=rank)
        if depths is None:
            fn = lambda p, m: solve(p, m, options, **kw)
        else:
            fn = lambda p, m, d: solve(p, m, options, depth=d, **kw)
        if in_axes is None:
            return fn
        fn = jax.vmap(fn, in_axes=in_axes, axis_name=axis)
        if devices is None:
            return fn
        # Each device loops over its own slice of the batch: no per-step synchronisation
        # with the slowest member elsewhere (a sharded `jit` would synchronise every step).
        mesh = jax.sharding.Mesh(np.array(devices), ("batch",))
        spec = jax.sharding.PartitionSpec
        return jax.shard_map(
            fn,
            mesh=mesh,
            in_specs=tuple(spec("batch") if ax == 0 else spec() for ax in in_axes),
            out_specs=spec("batch"),
            # diffrax's while loops mix per-device and replicated values; each device's
            # program is a plain vmapped solve, so there is nothing to check across devices.
            check_vma=False,
        )

    # programs spread over devices are kept by JAX's own cache only
    out_like = None if devices is not None else result_like(model, options)
    return program(
        "flow",
        options,
        args,
        make_fn,
        extra=(in_axes, depths is None, devices, observed, rank, defer_tail),
        out_like=out_like,
    )


def finish_tails(problem, model, head: FlowResult, options: FlowOptions, depths=None, threads=None):
    """The whole flows of a batch solved with `defer_tail=True` (`head`, from the initial
    `model`): each member whose stiff tail is pending runs it alone and unpadded (a program
    per depth), so that a batch costs the sum of its members' tails rather than its stiffest
    member's tail times the batch size. Returns the batched result, models padded back to the
    batch's depth.

    The tails run `threads` at a time (default: the CPU cores this process may use): a tail
    at a sweep's sizes is a sequence of small factorisations that keeps one core busy, so
    tails side by side use the others (measured in benchmarks/README, `scale`)."""
    return PendingTails(problem, model, head, options, depths).finish(threads)


class PendingTails:
    """The stiff tails a batch solved with `defer_tail=True` left pending (`head`, from the
    initial `model`), as calls to run anywhere, in any order, side by side (`calls`: one per
    pending member, each returning that member's whole flow; compiled here, in the calling
    thread, so that threads never compile the same program), and `assemble(results)`, the
    batch's result from their results in the order of `calls`. `rows`: the largest matrix
    they factorise (`factorised_rows`); `compile_time`: their programs' (`CompileTime`; a
    later tail stage's, compiled only when a call gets there, is added when it is).
    `members`: how many leading members of the batch are real; the rest pad it to its
    compiled size, and their tails are not run (they stay pending)."""

    def __init__(
        self, problem, model, head: FlowResult, options: FlowOptions, depths=None, members=None
    ):
        self.head = jax.tree_util.tree_map(np.asarray, head)
        self.depth = model.depth
        self.options = options
        self.pending = np.flatnonzero(self.head.status == Status.PENDING)
        if members is not None:
            self.pending = self.pending[self.pending < members]
        self.calls, self.rows, self.compile_time = [], 0, ALREADY_COMPILED
        self._lock = threading.Lock()
        if self.pending.size == 0:
            return
        self.members = [self.head.member(i) for i in range(self.head.status.shape[0])]
        for i in self.pending:
            problem_i = problem
            if problem.target.ndim == 3:
                problem_i = jax.tree_util.tree_map(lambda x, i=i: np.asarray(x[i]), problem)
            depth = model.depth if depths is None else int(depths[i])
            init = Factorization([np.asarray(w[i]) for w in model.layers[:depth]])
            # the head as the tail program takes it: unpadded, with a result's own structure
            unpadded = Factorization(self.members[i].model.layers[:depth])
            head_i = eqx.tree_at(lambda r: r.model, self.members[i], unpadded)
            compiled, start, compile_time = _tail_program(problem_i, init, head_i, options)
            self.compile_time += compile_time
            self.calls.append(functools.partial(self._run_tail, compiled, problem_i, init, start))
            self.rows = max(self.rows, factorised_rows(init, options, observed_bound(problem_i)))

    def _run_tail(self, compiled, problem, init, start) -> FlowResult:
        """One call: the tail program, then any later stage, whose compile time is added to
        `compile_time` where it happens (in whatever thread runs the call)."""
        result = jax.tree_util.tree_map(np.asarray, compiled(problem, init, start))
        result, later_compile = _later_stages(problem, init, result, self.options)
        with self._lock:
            self.compile_time += later_compile
        return result

    def finish(self, threads=None) -> FlowResult:
        """Run the calls, `threads` at a time (`finish_tails`), and assemble the batch."""
        if self.options.tails_run_alone:
            threads = 1
        with blas_threads_for(self.rows, side_by_side=threads_for(len(self.calls), threads)):
            return self.assemble(run_concurrently(self.calls, threads))

    def assemble(self, results) -> FlowResult:
        if self.pending.size == 0:
            return self.head
        members = list(self.members)
        for i, full in zip(self.pending, results, strict=True):
            members[i] = eqx.tree_at(lambda r: r.model, full, pad_depth(full.model, self.depth))
        return stack(members)


def _tail_program(
    problem, init, head: FlowResult, options: FlowOptions, in_axes=None, stage: int = 0
):
    """The compiled stiff tail of an unpadded flow from `init` whose head (a `defer_tail=True`
    solve's result) is `head`, or with `in_axes` (the problem's and the model's, as the head's
    program was batched) of a batch finished together: (program, the head as the program
    takes it, its `CompileTime`). `stage`: which of `_solve.tail_stages` (a later stage goes
    on from the previous one's result, `head`)."""
    like = result_like(init, options)
    start = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(like), jax.tree_util.tree_leaves(head)
    )
    stages = stages_of_tail(problem, init, options, continued=in_axes is None)
    method, _ = stages[stage]
    if method == "radau":
        observed = observed_bound(problem, RADAU_MULTIPLE)
    else:
        observed = observed_bound(problem)
    rank = tangent_rank(problem, options, observed, head)
    axis = None if in_axes is None else "flows"

    def make_fn():
        from ._solve import finish_tail

        fn = lambda p, m, h: finish_tail(
            p,
            m,
            h,
            options,
            observed=observed,
            batch_axis=axis,
            tangent_rank=rank,
            stage=stage,
            stages=stages,
        )
        return fn if in_axes is None else jax.vmap(fn, in_axes=(*in_axes, 0), axis_name=axis)

    compiled, compile_time = program(
        "flow-tail",
        options,
        (problem, init, start),
        make_fn,
        extra=(observed, rank, in_axes, stage, stages),
        out_like=like,
    )
    return compiled, start, compile_time


def _later_stages(problem, init, result: FlowResult, options: FlowOptions):
    """The flow `result` of a tail program run alone, carried through the later stages of
    `_solve.tail_stages` while it is `PENDING` (out of its Rosenbrock steps, with Radau IIA to
    go on): (the result, those programs' `CompileTime`). A later stage's program is compiled
    only when a flow reaches it, in whatever thread that is (`program` compiles one at a
    time)."""
    compile_time, stage = ALREADY_COMPILED, 0
    while np.any(np.asarray(result.status) == Status.PENDING):
        stage += 1
        compiled, start, more = _tail_program(problem, init, result, options, stage=stage)
        compile_time += more
        result = jax.tree_util.tree_map(np.asarray, compiled(problem, init, start))
    return result, compile_time


def result_like(model: Factorization, options: FlowOptions) -> FlowResult:
    """The structure of the result a solve of `model` with `options` returns."""
    samples = bool(options.save) or options.save_ts is not None
    return FlowResult.skeleton(model, samples, options.save_layers)


def _run(compiled, problem, model, options, in_axes=None, lazy=False):
    """Run a flow program; with `lazy` (a `defer_tail=True` program), then the stiff tail of
    whatever it left pending, a program compiled only then: (result, wall seconds, the tail
    program's `CompileTime`, `ALREADY_COMPILED` where none was needed)."""
    start = time.perf_counter()
    result = jax.block_until_ready(compiled(problem, model))
    wall = time.perf_counter() - start
    if not lazy or not np.any(np.asarray(result.status) == Status.PENDING):
        return result, wall, ALREADY_COMPILED
    tail, head, tail_compile = _tail_program(problem, model, result, options, in_axes)
    start = time.perf_counter()
    result = jax.block_until_ready(tail(problem, model, head))
    wall += time.perf_counter() - start
    if in_axes is None:  # a batched tail has one stage (`_solve.tail_stages`)
        start = time.perf_counter()
        result, later_compile = _later_stages(problem, model, result, options)
        tail_compile += later_compile
        wall += time.perf_counter() - start - later_compile.seconds
    return result, wall, tail_compile


# The multiple a Radau IIA tail program takes the observed entries to (`_tail_program`):
# its Newton matrix is formed from 3 × that many rows at every step, so it takes a finer
# multiple than the Rosenbrock programs share (a d = 8 mask's 40, not 64).
RADAU_MULTIPLE = 8


def stages_of_tail(problem, init, options: FlowOptions, continued: bool = True):
    """`_solve.tail_stages` for the tail of a flow of `problem` from `init`, with the rows a
    Radau stage would take: every program of one tail takes the same stages."""
    from ._solve import tail_stages

    return tail_stages(
        options, init, continued=continued, observed=observed_bound(problem, RADAU_MULTIPLE)
    )


def observed_bound(problem: Problem, multiple: int = 64) -> int:
    """The largest number of observed entries of a (batched) problem, rounded up to a multiple
    of `multiple` (capped at the number of entries): masks of similar counts, as a random-mask
    sweep draws them, then share one compiled program."""
    mask = np.asarray(problem.mask)
    counts = mask.reshape(-1, mask.shape[-2] * mask.shape[-1]).sum(axis=1)
    bound = -(-int(counts.max()) // multiple) * multiple
    return min(bound, mask.shape[-2] * mask.shape[-1])


def tangent_rank(
    problem: Problem, options: FlowOptions, observed: int, head: FlowResult | None = None
) -> int | None:
    """The rank the stiff tail's Gauss–Newton preconditioner takes where it resolves to its
    `tangent` factorisation (`gauss_newton`, `_solve.gauss_newton_factorization`), else None:
    programs are keyed on the rank only where it changes them.

    A tail program goes on from `head` (a `defer_tail=True` solve's result, batched or not):
    it takes the rank of X where its pending members' tails begin (`learned_rank`), which a
    real data set's target (unknown, nan, off Ω) cannot give. A program that runs the stiff
    solver from the start (`solver="rodas4"`, a sweep's `tails="batch"`) has to know the
    rank before it runs: it takes the target's (`target_rank`)."""
    from ._solve import TANGENT_MIN_OBSERVED, _gauss_newton_entries, gauss_newton_factorization

    entries = _gauss_newton_entries(options, observed)
    if entries is None or options.gauss_newton not in ("auto", "tangent"):
        return None
    if options.gauss_newton == "auto" and entries < TANGENT_MIN_OBSERVED:
        return None  # no rank could qualify: spare a sweep's chunks and tails the SVDs
    if head is None:
        rank, source = target_rank(problem), "the target"
    else:
        pending = np.asarray(head.status) == Status.PENDING
        rank, source = learned_rank(head.model, pending), "X where the stiff tail begins"
    shape = problem.target.shape[-2:]
    if options.gauss_newton == "tangent":
        if rank == 0:
            raise ValueError(
                f'gauss_newton="tangent" needs a tangent space of rank ≥ 1, but {source} is zero'
            )
        if rank * (shape[0] + shape[1]) > entries:
            hint = " (unknown entries off the mask, nan, read as 0)" if head is None else ""
            raise ValueError(
                f'gauss_newton="tangent": {source} has rank {rank}{hint}, so its tangent system '
                f"({rank * (shape[0] + shape[1])} rows) would be larger than the Gram it "
                f'stands for ({entries} rows); use gauss_newton="auto"'
            )
    chosen = gauss_newton_factorization(options, entries, rank, shape)
    return rank if chosen == "tangent" else None


def learned_rank(model: Factorization, members=True) -> int:
    """The number r of directions X has learned, which the `tangent` preconditioner holds: the
    cut at the largest gap σ_r/σ_{r+1} in X's spectrum above `_gram.TANGENT_GAP`·σ₁ (below
    it lies the init's residue; above it, at depth 2, a spread of small singular values that
    the completion keeps: the `scale` problem at d = 100, depth 2, has 16 above 1e-2·σ₁ where
    its tail begins, but σ₅/σ₆ = 18 and every other ratio ≤ 1.3; its tail took 3.70 s with
    r = 5, 4.02 s with r = 7 and 5.5 s with the Gram's inverse, 2026-12-06). In a batch the
    largest over `members` (a boolean per member; members whose X is not finite count 0)."""
    from ._gram import TANGENT_GAP

    x = np.asarray(model.product())
    x = x.reshape(-1, *x.shape[-2:])[np.broadcast_to(members, x.shape[:-2]).reshape(-1)]
    ranks = [0]
    for member in x:
        if np.all(np.isfinite(member)):
            sigma = np.linalg.svd(member, compute_uv=False)
            if sigma[0] > 0:
                above = int(np.sum(sigma > TANGENT_GAP * sigma[0]))
                below = np.append(sigma, 0.0)[1 : above + 1]
                gaps = np.divide(sigma[:above], below, out=np.full(above, np.inf), where=below > 0)
                ranks.append(int(np.argmax(gaps)) + 1)
    return max(ranks)


def target_rank(problem: Problem) -> int:
    """The numerical rank of a (batched) problem's target, the largest in a batch (entries
    that are not finite, which only unobserved ones may be, read as 0)."""
    target = np.asarray(problem.target)
    target = np.where(np.isfinite(target), target, 0.0).reshape(-1, *target.shape[-2:])
    return max(int(np.linalg.matrix_rank(t)) for t in target)


def flow_blas_threads(problem, model, options):
    """The BLAS threads a (batched) flow of `model` on `problem` runs with (`_threads`)."""
    return blas_threads_for(factorised_rows(model, options, observed_bound(problem)))


def flow(
    problem: Problem,
    model: Factorization,
    options: FlowOptions | None = None,
    **kwargs,
) -> FlowResult:
    """Integrate the gradient flow of `model` on `problem` to its limit (or until told to stop).

    **Arguments:**

    - `problem`: a `Problem` (target and mask).
    - `model`: the initial `Factorization`.
    - `options`: a `FlowOptions`; or pass its fields as keyword arguments
      (`flow(p, m, rtol=1e-12, t_max=100.0)`).

    **Returns:** a `FlowResult` with the endpoint model, a `Status`, solver statistics and the
    wall time of the solve alone (`wall_time_s`) and of compiling it (`compile_time_s`, 0 when
    a compiled program for the same shapes and options was reused). With `solver="auto"`, the
    stiff tail is a second program, compiled only when the flow reaches it (~45% of a whole
    flow's compile time), which goes on from where the first stopped, samples included.
    Flows that differ only in how their tails are solved (`FlowOptions.head`) share the first.

    **Raises:** `ValueError` for a model that does not fit the problem or bad options. A
    diverging flow does not raise: its status is `Status.DIVERGED`.

    ```python
    import gflow
    p = gflow.diagonal(4)
    m = gflow.identity_family(4, depth=3, alpha=1e-2, m=4)
    r = gflow.flow(p, m)
    r.status_label, gflow.singular_values(r.model)
    ```
    """
    if options is None:
        options = FlowOptions(**kwargs)
    elif kwargs:
        raise TypeError("pass either `options` or keyword options, not both")
    model.check_problem(problem)
    if problem.target.dtype != model.layers[0].dtype:
        raise ValueError(
            f"problem dtype {problem.target.dtype} differs from model dtype {model.layers[0].dtype}"
        )
    lazy = options.stiff_tail
    compiled, compile_time = _compiled_solver(problem, model, options, defer_tail=lazy)
    with flow_blas_threads(problem, model, options):
        result, wall, tail_compile = _run(compiled, problem, model, options, lazy=lazy)
    both = compile_time + tail_compile
    return result.timed(wall, both.seconds, both.cache_hit)


def pad_depth(model: Factorization, depth: int) -> Factorization:
    """`model` with identity layers appended up to `depth` layers: the same product. Pass the
    true depth to the engine (`solve(..., depth=)`, `SweepSpec(depth_mode="pad")`) to keep the
    padding frozen."""
    d = model.widths[-1]
    if depth < model.depth:
        raise ValueError(f"cannot pad a depth-{model.depth} model down to depth {depth}")
    eye = jnp.eye(d, dtype=model.layers[0].dtype)
    return Factorization(list(model.layers) + [eye] * (depth - model.depth))


def stack(items):
    """Stack equal-structure pytrees (problems, models) along a new leading batch axis."""
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *items)


def flow_batch(
    problem: Problem,
    model: Factorization,
    options: FlowOptions | None = None,
    *,
    tails: str = "apart",
    **kwargs,
) -> FlowResult:
    """Integrate a batch of flows in one compiled, vmapped program.

    `model` is a batched Factorization (leading axis on every layer, e.g. from `stack`);
    `problem` is either one shared Problem or a batched one. Every field of the returned
    `FlowResult` has the batch axis in front; each member has its own status, so one diverging
    member never stops the others. Under `vmap` a batch costs about (slowest member's steps) ×
    (batch size): group members of similar flow length.

    `tails`: `apart` (default, as in sweeps) finishes each member that reaches the stiff
    tail of `solver="auto"` alone after the batch, side by side on the cores, so that the
    batch costs the sum of its members' tails, not its stiffest tail times its size; `batch`
    runs the tails inside the batch, vmapped (as in `flow`, a second program compiled only
    when a member reaches its tail). The same flows either way (endpoints to the tolerance);
    apart was faster on every batch measured, similar members too (benchmarks/README,
    2026-12-06: eight d = 8 flows 6.8 s against 17.2 s, two d = 50 flows 5.4 against 9.5 s).
    `wall_time_s` and `compile_time_s` cover the tails' programs too.
    """
    if tails not in ("batch", "apart"):
        raise ValueError(f"unknown tails {tails!r}; choose from ('batch', 'apart')")
    if options is None:
        options = FlowOptions(**kwargs)
    elif kwargs:
        raise TypeError("pass either `options` or keyword options, not both")
    if tails == "batch" and options.tails_batch_refused:
        raise ValueError(BATCHED_TAILS_REFUSED)
    if model.layers[0].ndim != 3:
        raise ValueError("flow_batch needs a batched model (layers of shape (batch, d_out, d_in))")
    batched_problem = problem.target.ndim == 3
    if (model.widths[-1], model.widths[0]) != problem.target.shape[-2:]:
        raise ValueError(
            f"model output shape {(model.widths[-1], model.widths[0])} does not match the "
            f"problem's {problem.target.shape[-2:]}"
        )
    in_axes = (0 if batched_problem else None, 0)
    apart = tails == "apart" and options.stiff_tail
    lazy = not apart and options.stiff_tail
    compiled, compile_time = _compiled_solver(
        problem, model, options, in_axes, defer_tail=apart or lazy
    )
    with flow_blas_threads(problem, model, options):
        result, wall, tail_compile = _run(compiled, problem, model, options, in_axes, lazy)
    if apart:
        pending = PendingTails(problem, model, result, options)  # compiles their programs
        compiled_before = pending.compile_time.seconds
        start = time.perf_counter()
        result = pending.finish()
        # less a later tail stage's compilation, which `compile_time_s` counts
        later = pending.compile_time.seconds - compiled_before
        wall += time.perf_counter() - start - later
        tail_compile = pending.compile_time
    both = compile_time + tail_compile
    return result.timed(wall, both.seconds, both.cache_hit)
