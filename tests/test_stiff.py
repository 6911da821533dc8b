"""The stiff tail: Rodas4 (dense and matrix-free) against known solutions and the explicit path."""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import gflow
from gflow.engine import Rodas4
from gflow.engine._rosenbrock import conjugate_gradient, galerkin_start
from gflow.engine._stopping import ROUNDING_RATIO, default_atol, rounding_ratio

# (linear_solver, symmetric): dense LU, dense Cholesky, matrix-free CG.
LINEAR_ALGEBRA = [("dense", False), ("dense", True), ("cg", True)]


def _stiff_linear_system(negative=None):
    """y' = −A y, A = Q diag(λ) Qᵀ with λ = 1e-3 … 1e4 (optionally one λ < 0), and a y0 with
    no component along the negative direction."""
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.normal(size=(20, 20)))
    lam = np.geomspace(1e-3, 1e4, 20)
    if negative is not None:
        lam[0] = negative
    c = rng.normal(size=20)
    if negative is not None:
        c[0] = 0.0
    return q, lam, c


@pytest.mark.parametrize("linear_solver,symmetric", LINEAR_ALGEBRA)
def test_rodas4_on_a_stiff_linear_system(linear_solver, symmetric):
    """y' = −A y with eigenvalues 1e-3 … 1e4: exact solution Q e^{−Λt} Qᵀ y0; and a passive
    energy e' = ‖Ay‖², exact Σ c_i² λ_i (1 − e^{−2λ_i t})/2."""
    q, lam, c = _stiff_linear_system()
    a = jnp.asarray(q @ np.diag(lam) @ q.T)
    y0 = {"y": jnp.asarray(q @ c), "energy": jnp.asarray(0.0)}

    def field(t, y, args):
        return {"y": -a @ y["y"], "energy": jnp.sum((a @ y["y"]) ** 2)}

    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(field),
        Rodas4(linear_solver=linear_solver, symmetric=symmetric, passive=("energy",)),
        0.0,
        1.0,
        None,
        y0,
        stepsize_controller=diffrax.PIDController(rtol=1e-8, atol=1e-10),
        saveat=diffrax.SaveAt(t1=True, solver_state=True),
        max_steps=10_000,
    )
    exact = q @ (np.exp(-lam) * c)
    np.testing.assert_allclose(np.asarray(sol.ys["y"][-1]), exact, atol=1e-8)
    energy = np.sum(c**2 * lam * (1 - np.exp(-2 * lam)) / 2)
    np.testing.assert_allclose(float(sol.ys["energy"][-1]), energy, rtol=1e-7)
    iters = int(sol.solver_state["iters"])
    assert (iters > 0) == (linear_solver == "cg")


def test_rodas4_cholesky_rejects_steps_past_negative_curvature():
    """With a negative eigenvalue λ, (I/(hγ) + A) is indefinite once hγ|λ| ≥ 1: the Cholesky
    factorisation fails, the step is rejected, and the decaying modes stay exact."""
    q, lam, c = _stiff_linear_system(negative=-1e-2)
    a = jnp.asarray(q @ np.diag(lam) @ q.T)
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(lambda t, y, args: -a @ y),
        Rodas4(linear_solver="dense", symmetric=True),
        0.0,
        2000.0,
        None,
        jnp.asarray(q @ c),
        stepsize_controller=diffrax.PIDController(rtol=1e-8, atol=1e-10),
        max_steps=10_000,
    )
    assert int(sol.stats["num_rejected_steps"]) > 0
    # The unstable direction amplifies any error by e^{20}; the others must stay exact.
    stable = q[:, 1:].T @ np.asarray(sol.ys[-1])
    np.testing.assert_allclose(stable, np.exp(-lam[1:] * 2000.0) * c[1:], atol=1e-8)


@pytest.mark.parametrize("widths", [[5, 4, 6], [4, 3, 5, 2, 6]], ids=["L2", "L4"])
def test_closed_form_hessian_equals_autodiff(widths):
    problem = gflow.bernoulli(widths[-1], widths[0], 0.5, 1, key=0)
    problem = gflow.Problem(problem.target + 0.3, problem.mask)  # residual ≠ 0
    model = gflow.gaussian(widths, 0.7, key=1)
    flat, unravel = ravel_pytree(model)
    reference = jax.jit(jax.hessian(lambda theta: unravel(theta).loss(problem)))(flat)
    hessian = jax.jit(gflow.loss_hessian)(model, problem)
    scale = float(jnp.max(jnp.abs(reference)))
    np.testing.assert_allclose(np.asarray(hessian), np.asarray(reference), atol=1e-13 * scale)


@pytest.mark.parametrize("tableau", ["rodas4p2", "rodas4p", "rodas4"])
def test_rodas4_is_fourth_order(tableau):
    """Fixed steps on y' = −y²: the error falls like h⁴, for each tableau."""
    errors = []
    for n in (8, 16, 32):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(lambda t, y, args: -(y**2)),
            Rodas4(linear_solver="dense", tableau=tableau),
            0.0,
            2.0,
            2.0 / n,
            jnp.asarray([1.0]),
            stepsize_controller=diffrax.ConstantStepSize(),
        )
        errors.append(abs(float(sol.ys[-1, 0]) - 1.0 / 3.0))
    orders = np.log2(np.array(errors[:-1]) / np.array(errors[1:]))
    assert np.all(orders > 3.7), orders


@pytest.fixture(scope="module")
def stiff_case():
    """An 8×8 random mask whose tail is stiff, and its flow under the default strategy."""
    problem = gflow.bernoulli(8, 8, 0.4, 1, key=0)
    init = gflow.gaussian([8] * 4, 0.05, key=1)
    return problem, init, gflow.flow(problem, init)


def test_auto_strategy_finishes_a_stiff_tail_that_stalls_tsit5(stiff_case, tail_stages):
    problem, init, auto = stiff_case
    explicit = gflow.flow(problem, init, solver="tsit5", max_steps=20_000)
    assert explicit.status_label == "max_steps"
    assert auto.status_label == "converged"
    assert auto.end_phase == gflow.Phase.STIFF_TAIL  # the Rosenbrock phase ran
    tail = auto.work()["stiff tail"]
    assert int(auto.num_rhs_evals) == sum(p["rhs_evals"] for p in auto.work().values())
    # every stage of every step, the stopping rule at the start and at each accepted point,
    # and the divergence test at the end (dense steps: no stage is solved again)
    stages = tail_stages(problem)
    accepted = tail["steps"] - tail["rejected_steps"]
    assert tail["rhs_evals"] == stages * tail["steps"] + accepted + 2
    assert float(auto.loss) <= 1e-20 * float(auto.loss_init)
    reference = gflow.flow(problem, init, solver="rodas4", rtol=1e-12)
    assert reference.status_label == "converged"
    err = gflow.endpoint_distance(auto, reference, problem)
    s = gflow.singular_values(reference.model)
    top = int(np.sum(s >= 1e-5 * s[0]))
    assert gflow.endpoint_distance(auto, reference, problem, top=top)["singular_values"] <= 1e-6
    assert err["unobserved"] <= 1e-6


def test_padded_stiff_tail_with_certificates_is_the_same_flow(stiff_case):
    """Frozen identity layers leave the flow unchanged through the Rosenbrock phase (its
    Jacobian has their rows and columns zeroed), and the energy integral rides along as a
    passive state through every phase."""
    problem, init, auto = stiff_case
    options = gflow.FlowOptions(certificates=True)
    padded = jax.jit(lambda p, m: gflow.solve(p, m, options, depth=3))(
        problem, gflow.pad_depth(init, 4)
    )
    assert padded.status_label == "converged"
    assert "stiff tail" in padded.work()
    assert abs(int(padded.num_steps) - int(auto.num_steps)) <= 0.01 * int(auto.num_steps)
    np.testing.assert_allclose(
        np.asarray(padded.model.product()), np.asarray(auto.model.product()), atol=1e-9
    )
    assert gflow.energy_residual(padded) <= 1e-9


def test_batch_with_one_stiff_member_equals_single_flows(stiff_case):
    """The stiff phase runs for a batch when any member needs it, and only that member moves."""
    problem, init, auto = stiff_case
    easy = gflow.gaussian([8] * 4, 0.5, key=3)
    batch = gflow.flow_batch(problem, gflow.stack([init, easy]), tails="batch")
    single_easy = gflow.flow(problem, easy)
    assert "stiff tail" not in single_easy.work()  # finished in the explicit phase
    for member, single in zip((batch.member(0), batch.member(1)), (auto, single_easy), strict=True):
        assert member.status_label == "converged"
        # The stiff phase ran (did work) for exactly the member that needs it.
        assert ("stiff tail" in member.work()) == ("stiff tail" in single.work())
        # Batched and single programs round differently (see test_sweep): ± a few steps.
        assert abs(int(member.num_steps) - int(single.num_steps)) <= 3
        np.testing.assert_allclose(
            np.asarray(member.model.product()), np.asarray(single.model.product()), atol=1e-9
        )


def test_a_flow_compiles_its_stiff_tail_only_once_it_reaches_it(stiff_case, monkeypatch):
    """`flow` and `flow_batch` run the stiff tail as a second program, compiled only when a
    flow reaches it; the flow is the one the single program with the tail inside
    integrates."""
    from gflow.engine._flow import _compiled_solver

    problem, init, _ = stiff_case
    options = gflow.FlowOptions(rtol=1e-9)  # programs no other test compiles
    heads, tails = gflow.compile_count("flow"), gflow.compile_count("flow-tail")
    easy = gflow.flow(problem, gflow.gaussian([8] * 4, 0.5, key=3), options)
    assert easy.status_label == "converged" and easy.end_phase != gflow.Phase.STIFF_TAIL
    assert gflow.compile_count("flow") - heads == 1
    assert gflow.compile_count("flow-tail") == tails
    stiff = gflow.flow(problem, init, options)
    assert stiff.status_label == "converged" and stiff.end_phase == gflow.Phase.STIFF_TAIL
    assert gflow.compile_count("flow") - heads == 1  # the same head program
    assert gflow.compile_count("flow-tail") - tails == 1
    assert stiff.compile_time_s > 0 and stiff.compile_cache_hit is not None
    one_program, _ = _compiled_solver(problem, init, options)
    inside = one_program(problem, init)
    assert inside.end_phase == gflow.Phase.STIFF_TAIL
    # the same steps and work; the endpoint to rounding (two programs fuse differently)
    assert stiff.work() == inside.work()
    np.testing.assert_allclose(
        stiff.model.product(), inside.model.product(), rtol=1e-12, atol=1e-13
    )
    batch = gflow.flow_batch(problem, gflow.stack([init, init]), options, tails="batch")
    assert gflow.compile_count("flow-tail") - tails == 2  # the batch's own tail program
    np.testing.assert_allclose(
        np.asarray(batch.member(1).model.product()), np.asarray(inside.model.product()), atol=1e-9
    )
    assert batch.member(0).work() == batch.member(1).work()
    heads = gflow.compile_count("flow")
    from gflow.engine import _compile, _flow

    tail_program = _flow._tail_program  # the tails' compile time is counted (1,000 s here)

    def slow(*args, **kwargs):
        compiled, start, _ = tail_program(*args, **kwargs)
        return compiled, start, _compile.CompileTime(1000.0, False)

    monkeypatch.setattr(_flow, "_tail_program", slow)
    apart = gflow.flow_batch(problem, gflow.stack([init, init]), options)  # the default
    assert apart.compile_time_s >= 2000.0 and apart.compile_cache_hit is False
    # the batch's head program again, and each member's tail in the flow's own tail program
    assert gflow.compile_count("flow") == heads and gflow.compile_count("flow-tail") - tails == 2
    for member in (apart.member(0), apart.member(1)):
        assert member.end_phase == gflow.Phase.STIFF_TAIL
        assert abs(int(member.num_steps) - int(stiff.num_steps)) <= 0.01 * int(stiff.num_steps)
        np.testing.assert_allclose(
            np.asarray(member.model.product()), np.asarray(stiff.model.product()), atol=1e-9
        )


def test_a_saved_flow_samples_its_stiff_tail_in_a_second_program(stiff_case):
    """Samples along the flow no longer hold the stiff tail in the flow's one program: the
    tail program, compiled only once the flow reaches it, goes on from the head's samples.
    The samples and the endpoint are that one program's; a batch that finishes its tails
    apart (it stopped with an error here before) gives each member its own flow's."""
    from gflow.engine._flow import _compiled_solver

    problem, init, auto = stiff_case
    options = gflow.FlowOptions(save=6, save_layers=True)
    tails = gflow.compile_count("flow-tail")
    saved = gflow.flow(problem, init, options)
    assert saved.status_label == "converged" and saved.end_phase == gflow.Phase.STIFF_TAIL
    assert gflow.compile_count("flow-tail") - tails == 1
    for phase, work in auto.work().items():  # samples change no step (only how evals count)
        for column in ("steps", "rejected_steps"):
            assert saved.work()[phase][column] == work[column], (phase, column)
    one_program, _ = _compiled_solver(problem, init, options)
    inside = one_program(problem, init)
    head, _ = _compiled_solver(problem, init, options, defer_tail=True)  # the flow's own
    head = head(problem, init).trajectory.compress()
    samples = saved.trajectory.compress()
    assert len(samples.t) > len(head.t) and samples.t[-1] > head.t[-1]  # the tail's samples
    np.testing.assert_array_equal(samples.t[: len(head.t)], head.t)
    # The two programs compile the tail's stage loop apart: rounding there may move the stop
    # by a step along the last stretch (138 against 139 steps since the stages run as one
    # loop), and small entries of the layers and of X then differ by ~1e-11 of themselves
    # (on jax 0.12 a saved layer entry of 6e-3 by 1.4e-13). gflow holds an entry's error
    # against the size of its layer (`tail_scale="layer"`), not its own: the layers and X
    # are compared to 1e-12 of their size, the times, losses and σ as before.
    inside_samples = inside.trajectory.compress()
    for field in ("t", "loss", "singular_values"):
        a, b = getattr(samples, field), getattr(inside_samples, field)
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)
    for a, b in zip(samples.layers.layers, inside_samples.layers.layers, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12 * np.max(np.abs(b)))
    steps = lambda r: r.work()["stiff tail"]["steps"]
    assert abs(steps(saved) - steps(inside)) <= 1
    product = np.asarray(inside.model.product())
    np.testing.assert_allclose(
        saved.model.product(), product, rtol=0, atol=1e-12 * np.max(np.abs(product))
    )
    easy = gflow.gaussian([8] * 4, 0.5, key=3)
    batch = gflow.flow_batch(problem, gflow.stack([init, easy]), options, tails="apart")
    assert gflow.status_labels(np.asarray(batch.status)).tolist() == ["converged"] * 2
    member = batch.member(0).trajectory
    assert member.t.shape == saved.trajectory.t.shape
    np.testing.assert_array_equal(np.isfinite(member.t), np.isfinite(saved.trajectory.t))
    # the vmapped head ends its explicit steps ~1e-5 (relative) off the flow alone's time
    # (rounding, on a stability-limited phase), so its tail's samples lie at other times
    np.testing.assert_allclose(member.compress().t, samples.t, rtol=1e-4)
    np.testing.assert_allclose(
        np.asarray(batch.member(0).model.product()), np.asarray(saved.model.product()), atol=1e-9
    )
    # a flow that converges before its tail: its tail's samples are there, invalid
    assert np.all(np.isinf(np.asarray(batch.member(1).trajectory.t)[-6:]))
    alone = gflow.flow(problem, easy, options)
    assert alone.end_phase != gflow.Phase.STIFF_TAIL
    assert alone.trajectory.t.shape == inside.trajectory.t.shape
    assert np.all(np.isinf(np.asarray(alone.trajectory.t)[-6:]))


def test_a_deferred_stiff_tail_finished_alone_is_the_same_flow(stiff_case):
    """A sweep's batch stops its stiff members where the tail begins (status pending) and
    finishes each alone, unpadded: the same flow as `flow`, and the batch's easy member is
    untouched. Padded to depth 4 and with certificates, so that both ride through."""
    from gflow.engine._flow import _compiled_solver, finish_tails

    problem, init, auto = stiff_case
    easy = gflow.gaussian([8] * 4, 0.5, key=3)
    models = gflow.stack([gflow.pad_depth(init, 4), gflow.pad_depth(easy, 4)])
    depths = np.array([3, 3], np.int32)
    options = gflow.FlowOptions(certificates=True)
    compiled, _ = _compiled_solver(
        problem, models, options, in_axes=(None, 0), depths=depths, defer_tail=True
    )
    head = compiled(problem, models, depths)
    assert gflow.status_labels(np.asarray(head.status)).tolist() == ["pending", "converged"]
    assert int(head.phase_work[0, 2, 0]) == 0  # the tail did not run in the batch
    before = gflow.compile_count("flow-tail")
    full = finish_tails(problem, models, head, options, depths)
    assert gflow.compile_count("flow-tail") - before <= 1
    stiff, easy_run = full.member(0), full.member(1)
    assert stiff.status_label == "converged" and stiff.end_phase == gflow.Phase.STIFF_TAIL
    assert stiff.work()["explicit"] == head.member(0).work()["explicit"]
    assert int(stiff.num_steps) == sum(p["steps"] for p in stiff.work().values())
    assert abs(int(stiff.num_steps) - int(auto.num_steps)) <= 0.01 * int(auto.num_steps)
    assert stiff.model.depth == 4  # padded back, the padding still the identity
    np.testing.assert_array_equal(np.asarray(stiff.model.layers[3]), np.eye(8))
    np.testing.assert_allclose(
        np.asarray(stiff.model.product()), np.asarray(auto.model.product()), atol=1e-9
    )
    assert gflow.energy_residual(stiff) <= 1e-9
    np.testing.assert_array_equal(
        np.asarray(easy_run.model.product()), np.asarray(head.member(1).model.product())
    )


@pytest.fixture(scope="module")
def lean_tail_head():
    """A d = 8 random mask whose CG tail rejects steps and rebuilds: the flow up to its tail."""
    problem = gflow.bernoulli(8, 8, 0.5, 2, key=jax.random.key(1))
    init = gflow.gaussian([8] * 5, 0.1, key=jax.random.key(11))
    observed = int(np.sum(np.asarray(problem.mask) != 0))
    head = jax.jit(
        lambda p, m: gflow.solve(p, m, gflow.FlowOptions(), observed=observed, defer_tail=True)
    )(problem, init)
    assert head.status_label == "pending"
    return problem, init, observed, head


@pytest.mark.parametrize("sampling", ["none", "save", "save_ts"])
def test_the_lean_tail_takes_the_steps_of_diffeqsolve(lean_tail_head, sampling):
    """The stiff tail runs in `_solver_loop`, which keeps the Gauss–Newton preconditioner from
    a rejected step instead of restoring it: the same steps (rejected ones included) and the
    same endpoint, bit for bit, as the tail in `diffeqsolve`, and the same linear-solver work
    plus that of the rejected steps, which `diffeqsolve` does not keep. With samples (`save`,
    or `save_ts` inside and outside the tail) it takes them from its steps' dense output as
    `diffeqsolve` does: the same samples, bit for bit."""
    from gflow.engine import _phases, _solve

    problem, init, observed, head = lean_tail_head
    t_end = float(head.t_end)
    sampled = {
        "none": {},
        "save": {"save": 7},
        "save_ts": {"save_ts": (0.5 * t_end, t_end, 3 * t_end, 1e3 * t_end, 1e9 * t_end)},
    }[sampling]
    options = gflow.FlowOptions(**sampled)
    setup = _solve._setup(problem, init, options, None).for_tail()
    solver = _solve._solvers(options, setup, None, observed)["stiff"]
    t1 = setup.t_max - head.t_end

    def tail(lean):
        def run(y):
            if lean:
                return _phases.stiff_phase(setup, solver, y, head.t_end, t1, options.max_steps)
            return _phases.physical_phase(
                setup, solver, y, head.t_end, t1, None, options.max_steps, lean=False
            )

        return jax.jit(run)({"model": head.model})

    lean, full = tail(True), tail(False)
    assert int(lean.status) == int(full.status) == gflow.Status.CONVERGED
    assert int(full.stats.num_rejected_steps) > 0 and int(full.stats.factorizations) > 1
    for field in ("num_steps", "num_rejected_steps"):
        assert int(getattr(lean.stats, field)) == int(getattr(full.stats, field)), field
    # the rejected steps ran CG too
    assert int(lean.stats.linear_iters) > int(full.stats.linear_iters)
    assert int(lean.stats.factorizations) >= int(full.stats.factorizations)
    assert float(lean.t) == float(full.t)
    for a, b in zip(lean.y["model"].layers, full.y["model"].layers, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # diffrax tests the stopping rule after rejected steps too (and a rejected step whose CG
    # failed would add its dense re-solve to the lean loop's count only: none here)
    rejected = int(full.stats.num_rejected_steps)
    assert int(lean.stats.rhs_evals) == int(full.stats.rhs_evals) - rejected
    assert (
        sorted(lean.samples) == sorted(full.samples) == ([] if not sampled else ["loss", "sv", "t"])
    )
    for key in full.samples:
        np.testing.assert_array_equal(np.asarray(lean.samples[key]), np.asarray(full.samples[key]))
    if sampled:
        t = np.asarray(lean.samples["t"])
        # samples inside the tail, and rows it never reached (after it converged, or before
        # it began) left invalid
        assert 3 <= np.sum(np.isfinite(t)) < len(t)


def test_tails_finished_side_by_side_equal_tails_finished_one_by_one(stiff_case):
    """Two pending tails on two threads give the members, bit for bit, that one thread gives
    (the same programs on the same inputs: concurrency must not mix their states)."""
    from gflow.engine._flow import _compiled_solver, finish_tails

    problem, init, auto = stiff_case
    other = gflow.gaussian([8] * 4, 0.05, key=2)
    models = gflow.stack([init, other])
    options = gflow.FlowOptions()
    compiled, _ = _compiled_solver(problem, models, options, in_axes=(None, 0), defer_tail=True)
    head = compiled(problem, models)
    assert gflow.status_labels(np.asarray(head.status)).tolist() == ["pending", "pending"]
    apart = finish_tails(problem, models, head, options, threads=2)
    alone = finish_tails(problem, models, head, options, threads=1)
    for a, b in zip(
        jax.tree_util.tree_leaves(apart), jax.tree_util.tree_leaves(alone), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(
        np.asarray(apart.member(0).model.product()), np.asarray(auto.model.product()), atol=1e-9
    )


@pytest.mark.parametrize("tableau", ["rodas4p2", "rodas5p", "rodas4p", "rodas4"])
def test_dense_output_inside_a_step_is_third_order(tableau):
    """Samples between fixed steps of y' = −y² (exact 1/(1 + t)): the dense output's error
    falls at least like h³, where a linear interpolant's would fall like h²."""
    errors = []
    for n in (16, 32, 64):
        h = 2.0 / n
        ts = jnp.arange(n) * h + 0.37 * h
        field = lambda t, y, args: -(y**2)
        ys = _fixed_steps(field, [1.0], 2.0, n, tableau, diffrax.SaveAt(ts=ts))
        errors.append(np.max(np.abs(ys[:, 0] - 1.0 / (1.0 + np.asarray(ts)))))
    orders = np.log2(np.array(errors[:-1]) / np.array(errors[1:]))
    assert np.all(orders > 2.8), orders


def test_auto_takes_rodas5p_where_the_gram_is_large():
    """`rosenbrock="auto"` (the default): RODAS5P where the Gauss–Newton preconditioner holds
    ≥ 1,024 observed entries (fewer steps, so fewer builds and |Ω|²-sized applications), else
    RODAS4P2 (whose cheaper steps win on small flows that spend their step budget)."""
    from gflow.engine._solve import RODAS5P_MIN_OBSERVED, tail_tableau

    default = gflow.FlowOptions()
    assert default.rosenbrock == "auto"
    assert tail_tableau(default, RODAS5P_MIN_OBSERVED) == "rodas5p"
    assert tail_tableau(default, RODAS5P_MIN_OBSERVED - 1) == "rodas4p2"
    assert tail_tableau(default, None) == "rodas4p2" == Rodas4().tableau
    spectral = gflow.FlowOptions(preconditioner="spectral")
    assert tail_tableau(spectral, 10 * RODAS5P_MIN_OBSERVED) == "rodas4p2"
    for name in ("rodas4", "rodas4p", "rodas4p2", "rodas5p"):
        assert tail_tableau(gflow.FlowOptions(rosenbrock=name), 10**5) == name


def test_the_tableaus_are_the_same_method_family():
    """Each tableau is stiffly accurate (the solution is the last stage's argument plus K_s)
    and every option name has a tableau."""
    from gflow.engine._options import ROSENBROCK
    from gflow.engine._rosenbrock import TABLEAUS

    assert set(ROSENBROCK) == set(TABLEAUS) | {"auto"}
    for t in TABLEAUS.values():
        s = t.stages
        assert t.m == [t.a[(s, j)] for j in range(1, s)] + [1.0]
        assert sorted(t.c) == sorted(t.a)  # c_ij for every i > j, like a_ij
        assert all(len(row) <= s for row in t.dense)
    assert [(t.stages, t.order) for t in TABLEAUS.values()] == [(6, 4)] * 3 + [(8, 5)]
    with pytest.raises(ValueError, match="rosenbrock"):
        gflow.FlowOptions(rosenbrock="rodas5")


def _fixed_steps(field, y0, t1, n, tableau, saveat):
    """The samples `saveat` of a dense-algebra RODAS solve of `field` from `y0` over [0, t1]
    in `n` equal steps."""
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(field),
        Rodas4(linear_solver="dense", tableau=tableau),
        0.0,
        t1,
        t1 / n,
        jnp.asarray(y0),
        stepsize_controller=diffrax.ConstantStepSize(),
        saveat=saveat,
    )
    return np.asarray(sol.ys)


def _fixed_step_ends(tableau, steps):
    """The endpoints of fixed-step solves (`steps` steps each) of a small nonlinear system
    with a fast and a slow mode, y₀' = −y₀² + y₁, y₁' = −10 y₁ + y₀y₁, over [0, 1]."""
    field = lambda t, y, args: jnp.stack([-(y[0] ** 2) + y[1], -10.0 * y[1] + y[0] * y[1]])
    end = diffrax.SaveAt(t1=True)
    return [_fixed_steps(field, [1.0, 0.5], 1.0, n, tableau, end)[-1] for n in steps]


def test_each_tableau_converges_at_its_order():
    """Halving the step divides the endpoint error by 2^order: 4 for the RODAS4 family, 5 for
    RODAS5P (measured 4.0 and 4.9), against a RODAS5P solve with 1,024 steps."""
    from gflow.engine._rosenbrock import TABLEAUS

    (reference,) = _fixed_step_ends("rodas5p", [1024])
    for name in ("rodas4p2", "rodas5p"):
        errors = [np.max(np.abs(end - reference)) for end in _fixed_step_ends(name, [16, 32, 64])]
        orders = np.log2(np.array(errors[:-1]) / np.array(errors[1:]))
        assert np.all(np.abs(orders - TABLEAUS[name].order) < 0.2), (name, orders)


def test_every_tableau_lands_on_the_same_endpoint_from_one_head_program(stiff_case):
    """Flows that differ only in their tails' options share the program before the tail
    (`FlowOptions.head`): each compiles its own tail and nothing else, and reaches the tail
    from the same state, having done the same work."""
    problem, init, auto = stiff_case
    assert auto.work()["stiff tail"]["steps"] > 0
    gflow.flow(problem, init)  # the default's programs, live again if they were let go
    heads, tails = gflow.compile_count("flow"), gflow.compile_count("flow-tail")
    for k, tableau in enumerate(("rodas4", "rodas5p"), start=1):
        other = gflow.flow(problem, init, rosenbrock=tableau)
        assert other.status_label == "converged" and "stiff tail" in other.work()
        assert gflow.compile_count("flow") == heads
        assert gflow.compile_count("flow-tail") - tails == k
        np.testing.assert_array_equal(other.phase_work[:2], auto.phase_work[:2])
        np.testing.assert_allclose(
            np.asarray(auto.model.product()), np.asarray(other.model.product()), atol=1e-9
        )


def _sweep_point(depth, alpha, seed):
    """(problem, init) of a d = 8 point of the 112-flow random-mask sweep."""
    from gflow.sweeps._build import build

    point = dict(dim=8, density=0.5, rank=2, noise=0.0, depth=depth, alpha=alpha, seed=seed)
    return build(point | {"m": 1.0}, "bernoulli", "gaussian")


def _sweep_point_both_ways(depth, alpha, seed, **other):
    """(problem, init, the flow at the defaults, the flow with `other` options) of a sweep
    point, both converged."""
    problem, init = _sweep_point(depth, alpha, seed)
    default, changed = gflow.flow(problem, init), gflow.flow(problem, init, **other)
    assert default.status_label == changed.status_label == "converged"
    return problem, init, default, changed


def _tail_steps(result) -> int:
    return result.work()["stiff tail"]["steps"]


@pytest.mark.slow
def test_rodas4p2_does_not_lose_order_on_a_long_stiff_tail():
    """A depth-3 flow from α = 0.003 whose tail runs to t ≈ 3e11 (Hessian eigenvalues ~α⁴
    to O(1)): RODAS4 loses order there. With each entry's error held to its own size
    (`tail_scale="entry"`) it needs 2.8× the steps of RODAS4P2 at rtol 1e-10 (11,053 against
    4,002 when measured); with the default layer scale, where the tiny entries no longer set
    the step, 1.9× (3,165 against 1,657). The same endpoint either way."""
    problem, init = _sweep_point(3, 0.003, 2)
    for scale, fewer in (("entry", 0.5), ("layer", 0.6)):
        new = gflow.flow(problem, init, tail_scale=scale, rosenbrock="rodas4p2")
        old = gflow.flow(problem, init, tail_scale=scale, rosenbrock="rodas4")
        assert new.status_label == old.status_label == "converged"
        assert _tail_steps(new) < fewer * _tail_steps(old)
        np.testing.assert_allclose(
            gflow.singular_values(new.model)[:3], gflow.singular_values(old.model)[:3], rtol=1e-9
        )


def test_a_looser_tail_rtol_takes_fewer_steps_and_keeps_the_stopping_rule():
    """`tail_rtol` loosens the stiff tail's step control only: the flow still stops where the
    remaining distance is within the default rtol/atol, and on a tail that contracts onto its
    limit the endpoint's leading singular values move far less than tail_rtol (measured
    ~1e-13 here: benchmarks/README). With RODAS4P2, whose steps grow as rtol^(−1/5) (order 4):
    100× looser, 2.5× fewer steps in theory."""
    from gflow.engine import remaining_distance_ratio
    from gflow.engine._stopping import default_atol

    problem, init = _sweep_point(3, 0.01, 0)
    default = gflow.flow(problem, init, rosenbrock="rodas4p2")
    loose = gflow.flow(problem, init, rosenbrock="rodas4p2", tail_rtol=1e-8)
    assert default.status_label == loose.status_label == "converged"
    assert _tail_steps(loose) < 0.5 * _tail_steps(default)
    rtol = gflow.FlowOptions().rtol
    ratio = remaining_distance_ratio(loose.model, problem, rtol, default_atol(init, rtol))
    assert float(ratio) <= 1.0
    s, s_loose = gflow.singular_values(default.model), gflow.singular_values(loose.model)
    np.testing.assert_allclose(s_loose[:2], s[:2], rtol=1e-10)


def test_a_tail_step_holds_each_entry_to_the_scale_of_its_layer():
    """`tail_scale="layer"` (default): an entry far below its layer's RMS entry is held to
    atol + rtol·RMS, not to its own size; one above the RMS keeps its own tolerance. The
    controller rescales the error so that diffrax's norm reads |e| / that tolerance."""
    from gflow.engine._dynamics import FieldArgs
    from gflow.engine._phases import FiniteErrorPID

    w = np.array([[3.0, 4.0], [1e-6, 0.0]])  # RMS entry 2.5
    e = np.full((2, 2), 1e-10)
    y = {"model": gflow.Factorization([w])}
    args = FieldArgs(gflow.Problem(np.zeros((2, 2)), np.ones((2, 2))), 0.0, False, None)
    rtol, atol = 1e-10, 1e-20
    pid = FiniteErrorPID(rtol=rtol, atol=atol, layer_scale=True)
    scaled = np.asarray(
        pid._widened(1.0, y, y, args, {"model": gflow.Factorization([e])})["model"].layers[0]
    )
    own = atol + rtol * np.abs(w)
    np.testing.assert_allclose(scaled / own, e / (atol + rtol * np.maximum(np.abs(w), 2.5)))
    assert scaled[0, 1] == e[0, 1]  # |4| > RMS: its own tolerance
    assert scaled[1, 0] < 1e-6 * e[1, 0]  # 1e-6: held to the layer's scale


def test_the_layer_scaled_tail_takes_fewer_steps_to_the_same_endpoint():
    """An algebraic d = 8 tail (depth 3, α = 0.01): the per-entry rule held steps to the
    accuracy of entries ~1e-4 of their layer (measured 3,570 tail steps against 1,440); the
    endpoints agree far below rtol (2e-12 measured; both within 4e-12 of rtol 1e-12 runs)."""
    _, _, layer, entry = _sweep_point_both_ways(3, 0.01, 2, tail_scale="entry")
    assert _tail_steps(layer) < 0.5 * _tail_steps(entry)
    s_layer, s_entry = gflow.singular_values(layer.model), gflow.singular_values(entry.model)
    np.testing.assert_allclose(s_layer[:2], s_entry[:2], rtol=1e-11)


# Random-mask flows against diffrax's Kvaerno5 (dense Jacobian) at rtol 1e-11: an independent
# stiff integrator, about a minute per case, hence slow. (d, L, α, p) span issue 4's ranges.
# "auto" takes the dense path for the first two (P ≤ 200) and CG for the last two (P = 300, 256),
# with its dense fallback.
KVAERNO_CASES = [
    (8, 2, 0.5, 0.3, "auto"),
    (8, 3, 0.05, 0.4, "auto"),
    (10, 3, 0.2, 0.5, "auto"),
    (8, 4, 0.1, 0.6, "auto"),
]


@pytest.mark.slow
@pytest.mark.parametrize("d,depth,alpha,density,linear_solver", KVAERNO_CASES)
def test_auto_matches_kvaerno5_reference(d, depth, alpha, density, linear_solver):
    problem = gflow.bernoulli(d, d, density, 1, key=0)
    init = gflow.gaussian([d] * (depth + 1), alpha, key=1)
    reference = gflow.flow(problem, init, solver="kvaerno5", rtol=1e-11)
    assert reference.status_label == "converged"
    # The loss left when the stopping rule fires is about rtol² of the initial loss, so the
    # issue's 1e-20 needs the reference's rtol (at the default 1e-10 it is ~1e-20 ± a factor).
    auto = gflow.flow(problem, init, rtol=1e-11, linear_solver=linear_solver)
    assert auto.status_label == "converged"
    assert float(auto.loss) <= 1e-20 * float(auto.loss_init)
    if linear_solver == "cg":
        assert int(auto.num_linear_iters) > 0
    s = gflow.singular_values(reference.model)
    top = int(np.sum(s >= 1e-5 * s[0]))
    default = gflow.flow(problem, init, linear_solver=linear_solver)  # default rtol
    for run in (auto, default):
        err = gflow.endpoint_distance(run, reference, problem, top=top)["singular_values"]
        assert err <= 1e-6, err


@pytest.mark.slow
def test_tangent_preconditioner_matches_kvaerno5_reference():
    """The tail preconditioned through the target's tangent space (`gauss_newton="tangent"`,
    which `auto` takes only from 1,024 observed entries) against the independent reference."""
    problem = gflow.bernoulli(10, 10, 0.5, 1, key=0)
    init = gflow.gaussian([10] * 4, 0.2, key=1)
    reference = gflow.flow(problem, init, solver="kvaerno5", rtol=1e-11)
    assert reference.status_label == "converged"
    s = gflow.singular_values(reference.model)
    top = int(np.sum(s >= 1e-5 * s[0]))
    for rtol in (1e-11, 1e-10):
        run = gflow.flow(problem, init, rtol=rtol, linear_solver="cg", gauss_newton="tangent")
        assert run.status_label == "converged" and int(run.num_linear_iters) > 0
        err = gflow.endpoint_distance(run, reference, problem, top=top)["singular_values"]
        assert err <= 1e-6, err


@pytest.mark.slow
def test_auto_takes_the_tangent_preconditioner_at_field_sizes_and_keeps_the_endpoint():
    """d = 64, |Ω| ≈ 1,230, rank 2: `auto` builds the tangent system (k = 512), and ends
    where the Gram's explicit inverse does; with the unobserved entries unknown (nan), as in
    real data, it takes the same tail (X's rank, not the target's) to the last bit."""
    from gflow.engine import _solve
    from gflow.engine._flow import _compiled_solver, learned_rank, observed_bound

    problem = gflow.bernoulli(64, 64, 0.3, 2, key=0)
    init = gflow.gaussian([64] * 4, 0.1, key=1)
    entries = observed_bound(problem)
    head, _ = _compiled_solver(problem, init, gflow.FlowOptions(), defer_tail=True)
    rank = learned_rank(head(problem, init).model)
    chosen = _solve.gauss_newton_factorization(gflow.FlowOptions(), entries, rank, problem.shape)
    assert rank == 2 and chosen == "tangent"
    auto = gflow.flow(problem, init)
    inverse = gflow.flow(problem, init, gauss_newton="inverse")
    for run in (auto, inverse):
        assert run.status_label == "converged" and run.work()["stiff tail"]["factorizations"] > 0
    np.testing.assert_allclose(
        gflow.singular_values(auto.model)[:2], gflow.singular_values(inverse.model)[:2], rtol=1e-10
    )
    mask = np.asarray(problem.mask)
    unknown = gflow.Problem(np.where(mask == 1, np.asarray(problem.target), np.nan), mask)
    blind = gflow.flow(unknown, init)
    np.testing.assert_array_equal(np.asarray(blind.model.product()), auto.model.product())
    assert blind.work() == auto.work()


def test_a_loss_clock_stalled_on_a_second_plateau_hands_over_to_physical_time():
    """σ = (3, 0.5) from α = 1e-2 at depth 4: the second component still holds 2.7% of the
    loss, so the loss clock meets its plateau before its handover and stalls there (stiff).
    Out of its own budget (10 × explicit_steps) it hands over; the endpoint is the physical
    clock's. Out of the user's `max_steps` it still ends the solve."""
    import jax

    d = 4
    u = np.asarray(jax.random.normal(jax.random.key(0), (d, 2)))
    _, v = np.linalg.eigh(u @ u.T)
    problem = gflow.Problem(v @ np.diag([0.0, 0.0, 0.5, 3.0]) @ v.T, np.ones((d, d)))
    init = gflow.gaussian([d] * 5, 1e-2, jax.random.key(10))
    r = gflow.flow(problem, init)
    work = r.work()
    assert r.status_label == "converged"
    assert work["loss clock"]["steps"] == 20_000 and "stiff tail" in work
    physical = gflow.flow(problem, init, clock="physical")
    assert physical.status_label == "converged"
    np.testing.assert_allclose(
        gflow.singular_values(r.model)[:2], gflow.singular_values(physical.model)[:2], rtol=1e-8
    )
    capped = gflow.flow(problem, init, max_steps=20_000)
    assert capped.status_label == "max_steps" and capped.end_phase == gflow.Phase.LOSS_CLOCK


def test_a_loss_clock_whose_steps_are_all_rejected_hands_over_at_once():
    """A d = 8 random mask at depth 4 (the 112-flow sweep's (4, 1e-3, 1)): after ~1.3k accepted
    steps the loss clock's step size collapses on a saddle and every later step is rejected.
    It used to spend the rest of its 20k-step budget so (18.7k rejections); it now hands over
    to physical time after `LOSS_CLOCK_STALL` rejections in a row, from the same state, and
    the endpoint is the physical clock's."""
    from gflow.engine._solve import LOSS_CLOCK_STALL
    from gflow.sweeps._build import build

    point = dict(depth=4, alpha=1e-3, seed=1, dim=8, density=0.5, rank=2, noise=0.0, m=1.0)
    problem, init = build(point, "bernoulli", "gaussian")
    r = gflow.flow(problem, init)
    clock = r.work()["loss clock"]
    assert r.status_label == "converged" and "stiff tail" in r.work()
    assert clock["steps"] < 2_000 and clock["rejected_steps"] >= LOSS_CLOCK_STALL
    physical = gflow.flow(problem, init, clock="physical")
    assert physical.status_label == "converged"
    np.testing.assert_allclose(
        gflow.singular_values(r.model)[:2], gflow.singular_values(physical.model)[:2], rtol=1e-8
    )


def test_the_opt_in_rounding_floor_stops_a_plateau_whose_gradient_is_rounding():
    """σ = (3, 0.5) from α = 1e-4 at depth 5: after the first escape the second component is
    below float64's resolution of X (σ₂ ~ 3e-16), and most of the gradient on that plateau is
    rounding. With `rounding_floor=True` the stiff tail stops there with `rounding_floor`, far
    from an endpoint; a relative change of 1e-15 in the layers changes that gradient by more
    than half its size, where at the initialisation the two orders of the product agree to
    ~1e-15. By default the tail goes on (here until its step budget runs out): the floor is
    not evidence that rounding decides how the flow leaves the plateau (docs/theory.md §5).
    All of that with the float64 gradient (`compensated_gradient=False`). With the opt-in
    rounding allowance the tail's steps are no longer held to rtol in the directions whose
    gradient is rounding: it leaves the plateau and converges to the target (fully observed:
    σ = (3, 0.5)) within the same budget. By default the tail evaluates the gradient in
    double-double arithmetic there, and leaves the plateau to the same target."""
    d = 4
    u = np.asarray(jax.random.normal(jax.random.key(0), (d, 2)))
    _, v = np.linalg.eigh(u @ u.T)
    problem = gflow.Problem(v @ np.diag([0.0, 0.0, 0.5, 3.0]) @ v.T, np.ones((d, d)))
    init = gflow.gaussian([d] * 6, 1e-4, jax.random.key(10))
    # a small loss-clock budget (10 × explicit_steps), so that the tail starts soon
    budget = dict(max_steps=3_000, explicit_steps=200, compensated_gradient=False)
    plain = gflow.flow(problem, init, **budget)
    assert plain.status_label == "max_steps", plain.status_message
    assert plain.end_phase == gflow.Phase.STIFF_TAIL
    assert plain.work()["stiff tail"]["steps"] == budget["max_steps"]
    default = gflow.flow(problem, init, **(budget | {"compensated_gradient": "auto"}))
    assert default.status_label == "converged", default.status_message
    assert default.work()["stiff tail"]["steps"] < budget["max_steps"]
    np.testing.assert_allclose(gflow.singular_values(default.model)[:2], [3.0, 0.5], rtol=1e-9)
    allowed = gflow.flow(problem, init, rounding_allowance=True, **budget)
    assert allowed.status_label == "converged", allowed.status_message
    assert allowed.end_phase == gflow.Phase.STIFF_TAIL
    np.testing.assert_allclose(gflow.singular_values(allowed.model)[:2], [3.0, 0.5], rtol=1e-9)

    r = gflow.flow(problem, init, rounding_floor=True, **budget)
    assert r.status_label == "rounding_floor", r.status_message
    assert r.end_phase == gflow.Phase.STIFF_TAIL
    assert r.work()["stiff tail"]["steps"] < 100
    assert float(r.loss / r.loss_init) > 1e-3  # the second component's loss is still there
    remaining = gflow.engine.remaining_distance_ratio(
        r.model, problem, 1e-10, default_atol(init, 1e-10)
    )
    assert float(remaining) > 1.0  # the stopping rule did not fire

    g = r.model.gradient(problem)
    assert float(rounding_ratio(g, r.model, problem)) <= ROUNDING_RATIO
    assert float(rounding_ratio(init.gradient(problem), init, problem)) > 1e12
    keys = jax.random.split(jax.random.key(1), r.model.depth)
    nearby = gflow.Factorization(
        [
            w * (1 + 1e-15 * jax.random.normal(k, w.shape))
            for k, w in zip(keys, r.model.layers, strict=True)
        ]
    )
    change = ravel_pytree(nearby.gradient(problem))[0] - ravel_pytree(g)[0]
    assert float(jnp.linalg.norm(change) / jnp.linalg.norm(ravel_pytree(g)[0])) > 0.5

    one = gflow.gaussian([d, d], 0.3, jax.random.key(2))
    assert float(rounding_ratio(one.gradient(problem), one, problem)) == np.inf


@pytest.mark.slow
def test_a_flow_the_rounding_floor_would_stop_converges_to_a_reproducible_endpoint():
    """The counterexample that made the rounding floor opt-in (about 2 minutes): a d = 8 random
    mask (seed 0 of a sweep: density 0.5, rank 2), depth 5, α = 3e-4. The floor fires after
    ~25 tail steps at loss 2.48 with σ₂ of X at 4e-16; run on, the flow leaves that plateau and
    converges to σ = (7.088932907158, 3.794507809454), which runs from inits perturbed by a
    relative 1e-15 reproduced to 1e-12 (measured; docs/theory.md §5). In float64 it left the
    plateau after ~95k tail steps, with the rounding allowance in ~25× fewer; the compensated
    gradient (the default) leaves it in ~2,000, and the allowance then saves nothing."""
    problem_key, init_key = gflow.seed_keys(0)
    problem = gflow.bernoulli(8, 8, 0.5, 2, problem_key)
    init = gflow.gaussian([8] * 6, 3e-4, init_key)
    r = gflow.flow(problem, init)
    assert r.status_label == "converged", r.status_message
    assert float(r.loss / r.loss_init) < 1e-18
    np.testing.assert_allclose(
        gflow.singular_values(r.model)[:2], [7.088932907158, 3.794507809454], rtol=1e-10
    )
    assert r.work()["stiff tail"]["steps"] < 5_000 and "radau tail" not in r.work()
    # the rounding allowance: the same endpoint
    allowed = gflow.flow(problem, init, rounding_allowance=True)
    assert allowed.status_label == "converged", allowed.status_message
    np.testing.assert_allclose(
        gflow.singular_values(allowed.model)[:2], [7.088932907158, 3.794507809454], rtol=1e-10
    )


def _spd(n=30, seed=0):
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    return rng, q @ np.diag(np.geomspace(1e-3, 1e3, n)) @ q.T


def test_galerkin_start_is_the_a_norm_projection_onto_earlier_solutions():
    """From solutions x_j with known images A x_j: the start x0 in their span whose residual is
    orthogonal to the span (the A-norm best), exact when b lies in span{A x_j}; near-parallel
    solutions (a repeated one) do not spoil it."""
    rng, a = _spd()
    z = [rng.normal(size=30) for _ in range(4)]
    z.append(z[0] * (1 + 1e-15))
    images = [a @ x for x in z]
    solutions, images = [jnp.asarray(x) for x in z], [jnp.asarray(x) for x in images]
    b = jnp.asarray(rng.normal(size=30))
    x0, r0 = galerkin_start(solutions, images, b)
    np.testing.assert_allclose(np.asarray(r0), np.asarray(b - a @ x0), atol=1e-12)
    zt = np.stack(z)
    assert np.max(np.abs(zt @ np.asarray(r0))) <= 1e-9 * np.max(np.abs(zt @ np.asarray(b)))
    solution = np.linalg.solve(a, np.asarray(b))
    a_norm = lambda e: float(e @ a @ e)
    assert a_norm(solution - np.asarray(x0)) < a_norm(solution)
    inside = images[1] - 2.0 * images[3]
    x_in, r_in = galerkin_start(solutions, images, inside)
    np.testing.assert_allclose(np.asarray(x_in), z[1] - 2.0 * z[3], rtol=1e-9, atol=1e-9)
    assert float(jnp.linalg.norm(r_in)) <= 1e-9 * float(jnp.linalg.norm(inside))


def test_galerkin_start_drops_zero_rows_and_starts_from_zero_without_solutions():
    """A Rosenbrock step's stage loop passes its stages still to come as zero rows: they leave
    the projection as it is, and with only those the start is 0 with residual b, exactly."""
    rng, a = _spd(seed=2)
    z = jnp.asarray(rng.normal(size=(3, 30)))
    images = z @ jnp.asarray(a)
    b = jnp.asarray(rng.normal(size=30))
    padding = jnp.zeros((4, 30))
    x0, r0 = galerkin_start(z, images, b)
    x_padded, r_padded = galerkin_start(
        jnp.concatenate([z, padding]), jnp.concatenate([images, padding]), b
    )
    np.testing.assert_allclose(np.asarray(x_padded), np.asarray(x0), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(np.asarray(r_padded), np.asarray(r0), rtol=1e-12, atol=1e-14)
    x_none, r_none = galerkin_start(padding, padding, b)
    assert np.all(np.asarray(x_none) == 0.0)
    assert np.array_equal(np.asarray(r_none), np.asarray(b))


@pytest.mark.parametrize("linear_solver", ["dense", "auto"])
def test_a_rodas_step_traces_its_vector_field_once_a_solve_path_whatever_its_stages(
    linear_solver,
):
    """The stages after the first run as one loop, so a step's program holds the vector
    field (with its compensated gradient, the bulk of a tail program) once for the
    linearisation and once a linear-solve path (dense; CG with its dense fallback), for six
    stages as for eight: the d = 8 tail programs compile in ~0.6 of the time of the stages
    unrolled (benchmarks/README, "twenty-fourth session")."""
    a = jnp.asarray(_spd(n=8, seed=3)[1])
    calls = []

    def field(t, y, args):
        calls.append(t)
        return -a @ y

    term, y0 = diffrax.ODETerm(field), jnp.ones(8)
    counts = {}
    for tableau in ("rodas4p2", "rodas5p"):
        solver = Rodas4(linear_solver=linear_solver, dense_max=0, symmetric=True, tableau=tableau)
        state = solver.init(term, 0.0, 0.1, y0, None)
        calls.clear()
        step = lambda y, solver=solver, state=state: solver.step(
            term, 0.0, 0.1, y, None, state, False
        )
        jax.make_jaxpr(step)(y0)
        counts[tableau] = len(calls)
    # the linearisation, the dense stages, and with CG its stages (traced twice: once for
    # their shapes where a held dense step skips them)
    expected = 2 if linear_solver == "dense" else 4
    assert counts == {"rodas4p2": expected, "rodas5p": expected}


def test_conjugate_gradient_from_a_start_solves_the_same_system_in_fewer_iterations():
    rng, a = _spd(seed=1)
    a = jnp.asarray(a)
    b = jnp.asarray(rng.normal(size=30))
    matvec = lambda v: a @ v
    x, ok, cold, _ = conjugate_gradient(matvec, b, rtol=1e-10, max_iters=500)
    guess = x + 1e-4 * jnp.asarray(rng.normal(size=30))
    x_warm, ok_warm, warm, r = conjugate_gradient(
        matvec, b, rtol=1e-10, max_iters=500, x0=guess, r0=b - a @ guess
    )
    assert bool(ok) and bool(ok_warm) and int(warm) < int(cold)
    np.testing.assert_allclose(np.asarray(x_warm), np.linalg.solve(a, b), rtol=1e-8)
    np.testing.assert_allclose(np.asarray(r), np.asarray(b - a @ x_warm), atol=1e-10)


def _decay(solver, max_steps=10_000):
    """y' = −A y of `_stiff_linear_system` from 0 to 1 with `solver`, and the exact y(1)."""
    q, lam, c = _stiff_linear_system()
    a = jnp.asarray(q @ np.diag(lam) @ q.T)
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(lambda t, y, args: -a @ y),
        solver,
        0.0,
        1.0,
        None,
        jnp.asarray(q @ c),
        stepsize_controller=diffrax.PIDController(rtol=1e-8, atol=1e-10),
        saveat=diffrax.SaveAt(t1=True, solver_state=True),
        max_steps=max_steps,
        throw=False,
    )
    return sol, q @ (np.exp(-lam) * c)


@pytest.mark.parametrize("start", ["stages", "previous"])
def test_cg_stage_starts_change_the_work_not_the_solution(start):
    """Rodas4's CG started from earlier stages (and steps) takes fewer iterations than from
    zero and lands on the same exact solution of y' = −A y."""
    run = lambda stage_start: _decay(
        Rodas4(linear_solver="cg", symmetric=True, stage_start=stage_start)
    )
    (zero, _), (started, exact) = run("zero"), run(start)
    assert started.result == diffrax.RESULTS.successful
    np.testing.assert_allclose(np.asarray(started.ys[-1]), exact, atol=1e-8)
    assert int(started.solver_state["iters"]) < int(zero.solver_state["iters"])


def test_an_unknown_stage_start_is_refused():
    with pytest.raises(ValueError, match="stage_start"):
        Rodas4(stage_start="warm")


def test_a_stage_cg_cannot_solve_falls_back_to_the_dense_factorisation():
    """CG capped at 2 iterations cannot solve 20-dimensional stage systems with eigenvalues over
    seven decades: without a fallback every step fails until the steps are too small to reach
    t = 1; with one (P ≤ `fallback_max`) such a step is solved densely instead, and the solve
    lands on the exact solution."""

    def run(fallback_max):
        solver = Rodas4(
            linear_solver="auto",
            dense_max=0,  # CG at every size
            symmetric=True,
            cg_max_iters=2,
            preconditioner_rank=0,
            fallback_max=fallback_max,
        )
        return _decay(solver, max_steps=2_000)

    without, _ = run(0)
    assert without.result == diffrax.RESULTS.max_steps_reached
    assert int(without.solver_state["factorizations"]) == 0
    fallen, exact = run(1024)
    assert fallen.result == diffrax.RESULTS.successful
    np.testing.assert_allclose(np.asarray(fallen.ys[-1]), exact, atol=1e-8)
    dense_steps = int(fallen.solver_state["factorizations"])
    assert 0 < dense_steps <= int(fallen.stats["num_steps"])
    assert int(fallen.solver_state["iters"]) > 0  # CG was tried first


class _ScaledIdentity:
    """A structured preconditioner r ↦ r/shift that asks to be rebuilt at every step."""

    refresh_budget = -1

    def init(self, y, args):
        return jnp.zeros(())

    def build(self, y, args, shift):
        return jnp.zeros(())

    def apply(self, state, shift, r):
        return r / shift


def test_a_structured_preconditioner_is_not_rebuilt_while_the_steps_stay_dense():
    """After a fallback the steps stay dense and run no CG, so they build no preconditioner:
    one build (the first step's), then one dense factorisation per step (per accepted step:
    diffrax keeps no solver state from a rejected one)."""
    solver = Rodas4(
        linear_solver="auto",
        dense_max=0,
        symmetric=True,
        cg_max_iters=2,
        preconditioner=_ScaledIdentity(),
        fallback_max=1024,
        fallback_hold=10**6,  # dense from the first failure to the end
    )
    sol, exact = _decay(solver, max_steps=2_000)
    assert sol.result == diffrax.RESULTS.successful
    np.testing.assert_allclose(np.asarray(sol.ys[-1]), exact, atol=1e-8)
    assert int(sol.stats["num_rejected_steps"]) > 0  # the count below leaves them out
    assert int(sol.solver_state["factorizations"]) == int(sol.stats["num_accepted_steps"]) + 1


def test_the_rounding_gain_is_what_the_error_estimate_makes_of_stage_rounding():
    """With zero curvature the stages solve K = hγ·n + γ·C K (C the c_ij, strictly lower), so
    the error estimate K_s = h·eᵀn with e = γ·[(I − γC)⁻¹]_s: the gain is Σ|e_i|, and Σ e_i = 0
    (a constant field is integrated exactly by both the method and its embedded pair)."""
    from gflow.engine._rosenbrock import TABLEAUS, rounding_gain

    for name, tableau in TABLEAUS.items():
        s, gamma = tableau.stages, tableau.gamma
        c = np.zeros((s, s))
        for (i, j), value in tableau.c.items():
            c[i - 1, j - 1] = value
        e = gamma * np.linalg.inv(np.eye(s) - gamma * c)[s - 1]
        assert abs(e.sum()) < 1e-12, name
        assert rounding_gain(tableau) == pytest.approx(np.abs(e).sum(), rel=1e-12), name
    assert rounding_gain(TABLEAUS["rodas4p2"]) == pytest.approx(2.8995, abs=1e-4)


def _gradient_extended(layers, target, mask):
    """The gradient of ½‖M∘(X − X*)‖² in NumPy's extended precision (64-bit significand on
    x86: rounding 2048× below float64's), the layers taken exactly as given."""
    from gflow.model import partial_products

    ws = [np.asarray(w, np.longdouble) for w in layers]
    below, above = partial_products(ws)  # NumPy layers: NumPy (extended) products
    r = np.asarray(mask, np.longdouble) * (above[0] @ ws[0] - np.asarray(target, np.longdouble))
    return [a.T @ r @ b.T for a, b in zip(above, below, strict=True)]


@pytest.mark.skipif(np.finfo(np.longdouble).eps > 1e-18, reason="needs extended precision")
def test_the_gradient_rounding_bound_holds_and_is_tight_where_the_gradient_is_rounding():
    """`gradient_rounding` bounds |computed − exact| for every parameter (exact: extended
    precision), at an init and at a converged point, where the true gradient in most
    directions is far below the rounding; and it is within a modest factor of the rounding
    there, not vacuous."""
    from gflow.engine._compensated import gradient_rounding

    problem = gflow.bernoulli(8, 8, 0.5, 2, jax.random.key(0))
    init = gflow.gaussian([8] * 4, 0.3, jax.random.key(1))
    end = gflow.flow(problem, init).model
    for model in (init, end):
        computed = model.gradient(problem).layers
        exact = _gradient_extended(model.layers, problem.target, problem.mask)
        bound = gradient_rounding(model, problem, None).layers
        pairs = zip(computed, exact, strict=True)
        error = [np.abs(np.asarray(g, np.longdouble) - e) for g, e in pairs]
        for err, b in zip(error, bound, strict=True):
            assert np.all(err <= np.asarray(b)), float(np.max(err / np.asarray(b)))
    # at the endpoint the gradient is rounding: the bound is within 100× of what it bounds
    worst = max(float(np.max(e)) for e in error)
    assert worst > 0 and max(float(np.max(b)) for b in bound) < 100 * worst
