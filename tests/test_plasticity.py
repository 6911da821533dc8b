"""Loss of plasticity (docs/theory.md §7) and robustness references (§6b) by the full engine."""

import math

import numpy as np
import pytest

import gflow
import gflow.cli

TABLE_7 = [  # m, warm X₂₁(∞), σ₁, σ₂, stable rank, ‖ΔW‖/‖W‖
    (2.0, 0.705842682347, 1.863679537718, 0.157836855371, 1.0071725629, 0.083),
    (4.0, 0.374335572110, 1.734957838538, 0.360622266428, 1.0432043252, 0.192),
    (16.0, 0.072841357064, 1.638648326204, 0.565806969140, 1.1192243786, 0.299),
    (math.inf, -0.034715573932, 1.608545885528, 0.643261459459, 1.1599219789, 0.338),
]


@pytest.fixture(scope="module")
def two_by_two():
    return gflow.studies.two_by_two_problem()


@pytest.mark.parametrize("m, x21, s1, s2, srank, moved", TABLE_7)
def test_depth2_warm_start_table(two_by_two, m, x21, s1, s2, srank, moved):
    problem, pretrain_mask = two_by_two
    r = gflow.studies.plasticity(problem, pretrain_mask, gflow.identity_family(2, 2, 0.1, m))
    assert r.pretrain.coupling.startswith("decoupled")
    assert r.warm.status == "converged"
    np.testing.assert_allclose(r.warm.unobserved_values["1,0"], x21, rtol=0, atol=1e-8)
    np.testing.assert_allclose(r.warm.singular_values, [s1, s2], rtol=1e-8)
    np.testing.assert_allclose(r.warm.stable_rank, srank, rtol=1e-8)
    np.testing.assert_allclose(r.warm.distance_travelled, moved, atol=5e-4)
    # lazy: the warm start moves little, the cold start from α = 0.1 moves far
    assert r.cold.distance_travelled > 5 * r.warm.distance_travelled


def test_pretraining_does_not_depend_on_alpha(two_by_two):
    problem, pretrain_mask = two_by_two
    ends = []
    for alpha in (0.3, 0.1, 0.01):
        r = gflow.studies.plasticity(
            problem, pretrain_mask, gflow.identity_family(2, 2, alpha, 4.0), judge_trajectory=False
        )
        ends.append(r.warm.unobserved_values["1,0"])
    np.testing.assert_allclose(ends, ends[0], rtol=0, atol=2e-10)


def warm_x21(problem, mask, m):
    r = gflow.studies.plasticity(
        problem, mask, gflow.identity_family(2, 2, 0.1, m), judge_trajectory=False
    )
    return r.warm.unobserved_values["1,0"]


def test_sign_flips_exactly_across_m_star(two_by_two):
    """X₂₁ ends with the wrong sign exactly when m > m* ≈ 49.99 (ρ* = 0.0399947482)."""
    problem, mask = two_by_two
    lo, hi = 40.0, 60.0
    assert warm_x21(problem, mask, lo) > 0 > warm_x21(problem, mask, hi)
    for _ in range(26):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if warm_x21(problem, mask, mid) > 0 else (lo, mid)
    m_star = 0.5 * (lo + hi)
    rho_star = 2 * m_star / (m_star**2 + 1)
    np.testing.assert_allclose(rho_star, 0.0399947482, rtol=1e-6)
    np.testing.assert_allclose(m_star, 49.99, atol=0.01)


@pytest.mark.parametrize(
    "depth, m, values",
    [
        (2, 4.0, [0.866251838439, 0.990282878908, 0.999426671517]),
        (2, math.inf, [0.758014004987, 0.979843093971, 0.998792515423]),
        (3, 4.0, [0.998180610962, 0.999998200954, 0.999999998204]),
    ],
)
def test_cold_starts(two_by_two, depth, m, values):
    problem, _ = two_by_two
    for alpha, want in zip((1e-1, 1e-2, 1e-3), values, strict=True):
        r = gflow.flow(problem, gflow.identity_family(2, depth, alpha, m))
        assert r.status_label == "converged"
        np.testing.assert_allclose(float(r.model.product()[1, 0]), want, rtol=0, atol=1e-8)


def test_depth3_warm_start_recovers_only_after_coupled_pretraining(two_by_two):
    problem, mask = two_by_two
    for alpha, want in ((0.1, 0.991340358239), (0.01, 0.999987387946)):
        r = gflow.studies.plasticity(problem, mask, gflow.identity_family(2, 3, alpha, 4.0))
        assert r.pretrain.coupling == "coupled"
        np.testing.assert_allclose(r.warm.unobserved_values["1,0"], want, atol=1e-8)
    for alpha in (0.1, 0.01):
        r = gflow.studies.plasticity(problem, mask, gflow.identity_family(2, 3, alpha, math.inf))
        assert r.pretrain.coupling.startswith("decoupled")
        np.testing.assert_allclose(r.warm.unobserved_values["1,0"], -0.049488016872, atol=1e-8)


@pytest.mark.parametrize(
    "depth, alpha, x12",
    [
        (2, 0.1, 2 * 8 / 17),
        (2, 0.01, 2 * 8 / 17),
        (3, 0.1, 1.998201915613),
        (3, 0.01, 1.999998565196),
        (3, 0.001, 1.999999998638),
        (4, 0.1, 1.999936110384),
        (4, 0.01, 1.999999993730),
    ],
)
def test_unequal_diagonal_targets(depth, alpha, x12):
    """docs/theory.md §6: w = (1, 4) on the diagonal, init αF₄; rank-1 completion: X₁₂ = 2."""
    problem = gflow.Problem(np.array([[1.0, 2.0], [2.0, 4.0]]), np.eye(2))
    r = gflow.flow(problem, gflow.identity_family(2, depth, alpha, 4.0))
    assert r.status_label == "converged"
    x = np.asarray(r.model.product())
    np.testing.assert_allclose([x[0, 1], x[1, 0]], [x12, x12], rtol=0, atol=1e-8)


def test_noisy_observations_depth_still_lowers_rank():
    ranks = {}
    for depth in (2, 3):
        problem = gflow.diagonal(5, noise=0.05, key=1)
        r = gflow.flow(problem, gflow.identity_family(5, depth, 0.1, 4.0))
        ranks[depth] = gflow.stable_rank(r.model)
    assert ranks[3] < 1.001 < ranks[2]


def test_plasticity_validation(two_by_two):
    problem, _ = two_by_two
    with pytest.raises(ValueError, match="contained"):
        gflow.studies.plasticity(problem, np.ones((2, 2)), gflow.identity_family(2, 2, 0.1, 4.0))
    with pytest.raises(ValueError, match="shape"):
        gflow.studies.plasticity(problem, np.eye(3), gflow.identity_family(2, 2, 0.1, 4.0))


def test_plasticity_cli_2x2(capsys):
    import json

    assert gflow.cli.main(["plasticity", "--depths", "2", "--ms", "2", "inf", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    x21 = [r["warm"]["unobserved_values"]["1,0"] for r in rows]
    np.testing.assert_allclose(x21, [0.705842682347, -0.034715573932], atol=1e-8)


def test_plasticity_notebook_runs_small(tmp_path, monkeypatch):
    import os
    import runpy
    from pathlib import Path

    monkeypatch.setenv("GFLOW_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("GFLOW_NOTEBOOK_OUT", str(tmp_path))
    root = Path(__file__).resolve().parents[1]
    runpy.run_path(os.fspath(root / "notebooks" / "plasticity.py"), run_name="__main__")
    assert (tmp_path / "plasticity_2x2.png").stat().st_size > 10_000
    assert (tmp_path / "plasticity_dxd.png").stat().st_size > 10_000
