import math

import jax.numpy as jnp
import numpy as np
import pytest

import gflow


def test_block_diagonal_layout():
    p = gflow.block_diagonal(3, 2, value=2.5)
    assert p.shape == (6, 6)
    np.testing.assert_array_equal(np.asarray(p.mask), np.kron(np.eye(3), np.ones((2, 2))))
    np.testing.assert_array_equal(np.asarray(p.target), np.full((6, 6), 2.5))
    assert p.target.dtype == jnp.float64
    assert gflow.diagonal(4).num_observed == 4


def test_bernoulli_rank_and_density():
    p = gflow.bernoulli(30, 20, 0.4, 2, key=7)
    assert np.linalg.matrix_rank(np.asarray(p.target)) == 2
    assert 0.25 < p.num_observed / 600 < 0.55
    again = gflow.bernoulli(30, 20, 0.4, 2, key=7)
    np.testing.assert_array_equal(np.asarray(p.mask), np.asarray(again.mask))


def test_noise_only_touches_observed_entries():
    clean = gflow.block_diagonal(2, 2)
    noisy = gflow.block_diagonal(2, 2, noise=0.1, key=3)
    diff = np.asarray(noisy.target - clean.target)
    assert np.all(diff[np.asarray(clean.mask) == 0] == 0)
    assert np.any(diff[np.asarray(clean.mask) == 1] != 0)


@pytest.mark.parametrize(
    "target, mask, message",
    [
        (np.ones((3, 3)), np.ones((3, 2)), "does not match"),
        (np.ones(3), np.ones(3), "2-D"),
        (np.full((2, 2), np.nan), np.eye(2), "non-finite"),
        (np.ones((2, 2)), np.zeros((2, 2)), "empty"),
        (np.ones((2, 2)), 0.5 * np.eye(2), "only 0 and 1"),
    ],
)
def test_problem_validation(target, mask, message):
    with pytest.raises(ValueError, match=message):
        gflow.Problem(target, mask)


def test_unobserved_nan_is_allowed():
    target = np.ones((2, 2))
    target[0, 1] = np.nan
    gflow.Problem(target, np.eye(2))


def test_unknown_unobserved_entries_never_reach_the_flow():
    """Real data: nan off the mask. Loss, residual and gradient are those of any finite
    completion of the target (they once read nan: 0·nan); the completion error scores the
    known unobserved entries (a held-out set) only."""
    from gflow.model import loss_and_gradient

    known = gflow.bernoulli(6, 5, 0.5, 2, key=0)
    mask = np.asarray(known.mask)
    target = np.asarray(known.target)
    held_out = (mask == 0) & (np.arange(30).reshape(6, 5) % 2 == 0)
    partial = gflow.Problem(np.where((mask == 1) | held_out, target, np.nan), mask)
    model = gflow.gaussian([5, 4, 6], 0.7, key=1)
    x = model.product()
    np.testing.assert_array_equal(partial.residual(x), known.residual(x))
    loss, grad = loss_and_gradient(model, partial)
    loss_known, grad_known = loss_and_gradient(model, known)
    assert float(loss) == float(loss_known) and np.isfinite(float(loss))
    for g, g_known in zip(grad.layers, grad_known.layers, strict=True):
        np.testing.assert_array_equal(g, g_known)
    scored = gflow.unobserved_error(x, partial)
    assert scored["count"] == held_out.sum() < (mask == 0).sum()
    err = (np.asarray(x) - target)[held_out]
    assert scored["abs"] == pytest.approx(np.linalg.norm(err), rel=1e-14)
    assert scored["rel"] == pytest.approx(scored["abs"] / np.linalg.norm(target[held_out]))
    blind = gflow.Problem(np.where(mask == 1, target, np.nan), mask)
    unknown = gflow.unobserved_error(x, blind)
    assert unknown["count"] == 0 and math.isnan(unknown["abs"]) and math.isnan(unknown["rel"])
    assert "unobserved_error" not in gflow.endpoint_quantities(model, blind)
    assert "unobserved_error" in gflow.endpoint_quantities(model, partial)


def test_load_problem_roundtrip(tmp_path):
    p = gflow.bernoulli(5, 4, 0.5, 1, key=1)
    np.save(tmp_path / "t.npy", np.asarray(p.target))
    np.save(tmp_path / "m.npy", np.asarray(p.mask))
    q = gflow.load_problem(tmp_path / "t.npy", tmp_path / "m.npy")
    np.testing.assert_array_equal(np.asarray(q.target), np.asarray(p.target))


def test_identity_family_values():
    f = gflow.identity_family(3, depth=4, alpha=0.2, m=4.0)
    assert f.depth == 4 and f.widths == (3, 3, 3, 3, 3)
    expected = 0.2 * (0.75 * np.eye(3) + 0.25 * np.ones((3, 3)))
    for w in f.layers:
        np.testing.assert_allclose(np.asarray(w), expected, rtol=0, atol=1e-16)
    np.testing.assert_array_equal(
        np.asarray(gflow.identity_family(3, 2, 0.5, math.inf).layers[0]), 0.5 * np.eye(3)
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(alpha=0.0), "alpha"),
        (dict(alpha=-1.0), "alpha"),
        (dict(alpha=math.nan), "alpha"),
        (dict(depth=0), "depth"),
        (dict(m=1.0), "m must be > 1"),
        (dict(m=0.5), "m must be > 1"),
    ],
)
def test_identity_family_validation(kwargs, message):
    args = dict(d=3, depth=2, alpha=0.1, m=4.0) | kwargs
    with pytest.raises(ValueError, match=message):
        gflow.identity_family(**args)


def test_random_inits_are_seeded_and_scaled():
    a = gflow.gaussian([50, 40, 30], 0.5, key=3)
    b = gflow.gaussian([50, 40, 30], 0.5, key=3)
    assert a.widths == (50, 40, 30)
    np.testing.assert_array_equal(np.asarray(a.layers[1]), np.asarray(b.layers[1]))
    # entries ~ α·N(0, 1/d_in)
    assert abs(np.std(np.asarray(a.layers[0])) - 0.5 / math.sqrt(50)) < 0.01
    q = gflow.orthogonal([6, 6, 6], 2.0, key=1)
    w = np.asarray(q.layers[0])
    np.testing.assert_allclose(w @ w.T, 4.0 * np.eye(6), atol=1e-13)
    with pytest.raises(ValueError, match="widths"):
        gflow.gaussian([4], 0.1, key=0)


def test_load_init_npy_and_npz(tmp_path):
    stack = np.random.default_rng(0).normal(size=(3, 4, 4))
    np.save(tmp_path / "w.npy", stack)
    f = gflow.load_init(tmp_path / "w.npy")
    assert f.depth == 3
    np.testing.assert_array_equal(np.asarray(f.layers[2]), stack[2])
    layers = {f"W{i + 1}": np.ones((i + 2, i + 1)) for i in range(11)}
    np.savez(tmp_path / "w.npz", **layers)
    g = gflow.load_init(tmp_path / "w.npz")
    assert g.widths == tuple(range(1, 13))  # natural order: W10 after W9
    with pytest.raises(ValueError, match="stack"):
        np.save(tmp_path / "bad.npy", np.ones((4, 4)))
        gflow.load_init(tmp_path / "bad.npy")


def test_model_validation():
    with pytest.raises(ValueError, match="do not chain"):
        gflow.Factorization([np.ones((3, 2)), np.ones((3, 4))])
    with pytest.raises(ValueError, match="does not match|problem is"):
        gflow.flow(gflow.diagonal(3), gflow.identity_family(4, 2, 0.1))


@pytest.mark.parametrize(
    "problem_kind, init_kind", [("bernoulli", "gaussian"), ("diagonal", "orthogonal")]
)
def test_one_seed_means_the_same_problem_and_init_everywhere(problem_kind, init_kind):
    """`gflow run --seed K`, a sweep's seed axis and the API with `gflow.seed_keys(K)` build the
    same problem (mask, target, noise) and the same init, bit for bit."""
    from gflow.cli import build_model, build_problem, make_parser
    from gflow.sweeps._build import build
    from gflow.sweeps._spec import DEFAULTS

    seed, noise = 3, 0.1
    problem_key, init_key = gflow.seed_keys(seed)
    if problem_kind == "bernoulli":
        api_problem = gflow.bernoulli(5, 5, 0.5, 2, problem_key, noise=noise)
        cli_problem = ["--problem", "bernoulli", "--dim", "5", "--density", "0.5", "--rank", "2"]
    else:
        api_problem = gflow.diagonal(5, noise=noise, key=problem_key)
        cli_problem = ["--problem", "diagonal", "--dim", "5"]
    init = {"gaussian": gflow.gaussian, "orthogonal": gflow.orthogonal}[init_kind]
    api_model = init([5] * 4, 0.1, init_key)
    args = make_parser().parse_args(
        ["run", *cli_problem, "--noise", str(noise), "--init", init_kind, "--alpha", "0.1"]
        + ["--depth", "3", "--seed", str(seed)]
    )
    cli_problem = build_problem(args)
    cli_model = build_model(args, cli_problem)
    point = DEFAULTS | dict(dim=5, density=0.5, rank=2, noise=noise, alpha=0.1, depth=3, seed=seed)
    sweep_problem, sweep_model = build(point, problem_kind, init_kind)
    for problem in (cli_problem, sweep_problem):
        np.testing.assert_array_equal(problem.target, api_problem.target)
        np.testing.assert_array_equal(problem.mask, api_problem.mask)
    for model in (cli_model, sweep_model):
        for got, want in zip(model.layers, api_model.layers, strict=True):
            np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        gflow.seed_keys(-1)


def test_the_cli_uses_the_defaults_of_sweeps_and_flow_options():
    from gflow.cli import make_parser
    from gflow.sweeps._spec import DEFAULTS

    args = make_parser().parse_args(["run"])
    for name in ("dim", "blocks", "block_size", "density", "rank", "value", "noise", "depth"):
        assert getattr(args, name) == DEFAULTS[name], name
    assert (args.alpha, args.m, args.seed) == (DEFAULTS["alpha"], DEFAULTS["m"], DEFAULTS["seed"])
    options = gflow.FlowOptions()
    assert (args.rtol, args.t_max, args.max_steps, args.clock) == (
        options.rtol,
        options.t_max,
        options.max_steps,
        options.clock,
    )
    assert (args.tail_scale, args.rosenbrock) == (options.tail_scale, options.rosenbrock)
