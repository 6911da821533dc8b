"""The theory module against the shared theory notes' tables and 60-digit mpmath solutions."""

import itertools
import math

import mpmath as mp
import numpy as np
import pytest

import gflow

T1 = {  # n = d = 4, s = 1, m = 4: σ_B for α = 1e-1, 1e-2, 1e-3, 1e-4
    2: [9 / 19] * 4,
    3: [1.7813549033e-03, 2.2058180127e-06, 2.2553872817e-09, 2.2604255901e-12],
    4: [4.7155218457e-05, 4.7477441342e-09, 4.7480680173e-13, 4.7480712563e-17],
    5: [2.7196130696e-06, 2.7205156907e-11, 2.7205165935e-16, 2.7205165944e-21],
    6: [1.8737661009e-07, 1.8738026217e-13, 1.8738026254e-19, 1.8738026254e-25],
}
T2 = {  # n = d = 4, s = 1, α = 1e-2: σ_B for m = 1.5, 2, 16, 1000
    2: [4.7619047619e-02, 1.4285714286e-01, 8.6872586873e-01, 9.9799800601e-01],
    3: [5.2362402374e-08, 2.4127945422e-07, 8.1273228237e-05, 6.1752443557e-01],
    4: [1.2656107618e-10, 6.7815074249e-10, 5.4415218650e-08, 1.5523487509e-04],
    6: [1.3720557849e-15, 1.5662575134e-14, 1.4196931088e-12, 4.9780865366e-10],
}
T3 = [  # 2×2: (L, m, [σ_B at α = 1e-1, 1e-2, 1e-4])
    (3, 2, [3.546849118e-04, 4.144298588e-07, 4.217996694e-13]),
    (3, 4, [4.346370321e-03, 6.306048320e-06, 6.588854800e-12]),
    (3, 16, [1.136895684e-01, 4.209799685e-04, 5.050644710e-10]),
    (4, 2, [7.878787342e-06, 7.909841635e-10, 7.910156219e-18]),
    (4, 4, [7.629632095e-05, 7.723801894e-09, 7.724761867e-17]),
    (4, 16, [1.490293913e-03, 1.574262386e-07, 1.575146015e-15]),
    (6, 2, [1.591878719e-08, 1.591888237e-14, 1.591888238e-26]),
    (6, 4, [2.191665841e-07, 2.191741118e-13, 2.191741126e-25]),
    (6, 16, [2.746161441e-06, 2.746670349e-12, 2.746670399e-24]),
]
T4 = [  # (L, n, s, m, α, σ_A, σ_B)
    (2, 2, 2, 4, 0.1, 3.379310344828, 6.2068965517e-01),
    (3, 2, 2, 4, 0.1, 3.998218523789, 1.7814762111e-03),
    (3, 2, 2, 4, 0.01, 3.999997794182, 2.2058180327e-06),
    (4, 3, 2, 2, 0.1, 5.999987000843, 6.4995786606e-06),
    (5, 2, 3, 16, 0.01, 5.999999999846, 1.5414121306e-10),
]


def close(a, b, digits):
    """Equal to the digits a table prints (the tables give 10–11 significant digits)."""
    return abs(a / b - 1) <= 0.51 * 10.0 ** (1 - digits)


@pytest.mark.parametrize("depth", sorted(T1))
def test_table_t1(depth):
    lim = gflow.family_limit(depth, 4, 1, [1e-1, 1e-2, 1e-3, 1e-4], 4.0)
    for got, want in zip(lim.sigma_b, T1[depth], strict=True):
        assert close(got, want, 11)
    np.testing.assert_allclose(lim.sigma_a, 4 - 3 * lim.sigma_b, rtol=1e-15)


def test_table_t1_exact_values_and_ranks():
    np.testing.assert_allclose(gflow.family_limit(2, 4, 1, 0.5, 4.0).sigma_a, 49 / 19, rtol=1e-15)
    np.testing.assert_allclose(
        gflow.family_limit(3, 4, 1, 0.1, 4.0).sigma_a, 3.99465593529012, rtol=1e-14
    )
    lim2 = gflow.family_limit(2, 4, 1, 0.1, 4.0)
    srank, erank = gflow.family_ranks(lim2.sigma_a, lim2.sigma_b, 0.0, 4, 1)
    assert close(srank, 1.1012078301, 11) and close(erank, 2.8318790577, 11)
    lim3 = gflow.family_limit(3, 4, 1, 0.1, 4.0)
    srank, erank = gflow.family_ranks(lim3.sigma_a, lim3.sigma_b, 0.0, 4, 1)
    assert close(srank - 1, 5.9657e-07, 5) and close(erank, 1.0117127902, 11)


@pytest.mark.parametrize("depth", sorted(T2))
def test_table_t2(depth):
    lim = gflow.family_limit(depth, 4, 1, 1e-2, [1.5, 2.0, 16.0, 1000.0])
    for got, want in zip(lim.sigma_b, T2[depth], strict=True):
        assert close(got, want, 11)


@pytest.mark.parametrize("depth, m, values", T3)
def test_table_t3(depth, m, values):
    lim = gflow.family_limit(depth, 2, 1, [1e-1, 1e-2, 1e-4], m)
    for got, want in zip(lim.sigma_b, values, strict=True):
        assert close(got, want, 10)
    np.testing.assert_allclose(lim.sigma_a, 2 - lim.sigma_b, rtol=1e-15)


def test_table_t3_depth2_closed_form():
    for m in (2.0, 4.0, 16.0):
        np.testing.assert_allclose(
            gflow.family_limit(2, 2, 1, 0.3, m).sigma_b, 1 - 2 * m / (m * m + 1), rtol=1e-14
        )


@pytest.mark.parametrize("row", T4)
def test_table_t4(row):
    depth, n, s, m, alpha, sigma_a, sigma_b = row
    lim = gflow.family_limit(depth, n, s, alpha, m)
    assert close(float(lim.sigma_a), sigma_a, 13)
    assert close(float(lim.sigma_b), sigma_b, 11)


def test_table_t4_sigma_c_example():
    lam_c = math.exp(gflow.analysis._theory.log_lambda_c_at(3, 2, 2, 0.1, 4.0, 1000.0))
    assert close(lam_c, 0.0727985016532, 12)
    assert close(float(gflow.sigma_c_at(3, 2, 2, 0.1, 4.0, 1000.0)), 3.858045295e-4, 10)


def test_escape_time_example():
    assert close(float(gflow.escape_time(6, 4, 1, 1e-4, 4.0)), 2.6656e14, 5)


def mp_limit(depth, n, s, alpha, m, w):
    """60-digit reference: bracketed root of σ_A + (n−1)σ_B(σ_A) = d w on [s w, d w]."""
    with mp.workdps(60):
        alpha, w = mp.mpf(alpha), mp.mpf(w)
        d = n * s
        if m == math.inf:
            return float(s * w), float(mp.log(s * w))
        m = mp.mpf(m)
        c_a, c_b = 1 + (d - 1) / m, 1 - 1 / m
        if depth == 2:
            rho2 = (c_a / c_b) ** 2
            sb = d * w / (rho2 + n - 1)
            return float(d * w - (n - 1) * sb), float(mp.log(sb))
        q = depth - 2
        p = mp.mpf(q) / depth
        k = alpha ** (-q) * (c_a ** (-q) - c_b ** (-q))

        def log_sb(sa):
            return -mp.log(sa ** (-p) - k) / p

        f = lambda sa: sa + (n - 1) * mp.exp(log_sb(sa)) - d * w
        sa = mp.findroot(f, (s * w, d * w), solver="anderson")
        return float(sa), float(log_sb(sa))


def test_limit_solver_against_mpmath_on_1200_configs():
    grid = list(
        itertools.product(
            range(2, 11),
            [1.5, 2.0, 4.0, 16.0, 1e3, 1e6, math.inf],
            [1.0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-6, 1e-8],
            [0.3, 1.0, 2.5],
            [(2, 1), (4, 1), (5, 1), (10, 1), (3, 2), (2, 3), (2, 5)],
        )
    )
    rng = np.random.default_rng(0)
    picks = rng.choice(len(grid), size=1200, replace=False)
    worst_a = worst_b = 0.0
    for k in picks:
        depth, m, alpha, w, (n, s) = grid[k]
        lim = gflow.family_limit(depth, n, s, alpha, m, w)
        assert np.isfinite(lim.sigma_a) and np.isfinite(lim.log_sigma_b)
        ref_a, ref_log_b = mp_limit(depth, n, s, alpha, m, w)
        worst_a = max(worst_a, abs(float(lim.sigma_a) / ref_a - 1))
        worst_b = max(worst_b, abs(float(lim.log_sigma_b) - ref_log_b))
    assert worst_a <= 1e-12 and worst_b <= 1e-12, (worst_a, worst_b)


def test_limit_solver_is_finite_at_the_extremes():
    alphas = np.geomspace(1e-8, 1.0, 50)
    for depth in (2, 3, 6, 10, 16):
        for m in (1.0001, 1.5, 4.0, 1e12, math.inf):
            lim = gflow.family_limit(depth, 10, 1, alphas, m, 2.5)
            assert np.all(np.isfinite(lim.sigma_a)) and np.all(np.isfinite(lim.log_sigma_b))
            assert np.all(lim.sigma_a >= 2.5 - 1e-12)
    deep = gflow.family_limit(40, 10, 1, 1e-8, 4.0)
    assert deep.log_sigma_b < math.log(1e-300)  # σ_B underflows; its log does not
    ref_a, ref_log_b = mp_limit(40, 10, 1, 1e-8, 4.0, 1.0)
    assert abs(float(deep.log_sigma_b) - ref_log_b) <= 1e-12 * abs(ref_log_b)


def test_family_limit_validation():
    with pytest.raises(ValueError, match="depth"):
        gflow.family_limit(1, 2, 1, 0.1, 4.0)
    with pytest.raises(ValueError, match="alpha"):
        gflow.family_limit(3, 2, 1, 0.0, 4.0)
    with pytest.raises(ValueError, match="m must be"):
        gflow.family_limit(3, 2, 1, 0.1, 1.0)


def test_reduced_ode_matches_theory_checkpoints_t5():
    """the reference table T5 (shared theory notes) by the independent 3-scalar integrator."""
    cases = [
        (
            (2, 4, 1, 4, 0.1),
            [1, 5],
            [[4.5861961293716e-01, 1.9655126268735e-01], [1.6028853394462e00, 6.8695085976265e-01]],
        ),
        (
            (4, 2, 2, 4, 0.2),
            [1, 5],
            [[4.8835313329596e-01, 1.5718482043633e-01], [1.4141482233369e00, 1.6488718486048e-01]],
        ),
    ]
    for (depth, n, s, m, alpha), ts, want in cases:
        lam = gflow.reduced_flow(depth, n, s, alpha, m, 1.0, [0.0] + ts)
        for k, (la, lb) in enumerate(want):
            np.testing.assert_allclose(lam[k + 1, :2], [la, lb], rtol=1e-11)
    lam = gflow.reduced_flow(4, 2, 2, 0.2, 4.0, 1.0, [0.0, 1.0, 5.0])
    np.testing.assert_allclose(lam[1:, 2], [1.4999829147436e-01, 1.4999145873375e-01], rtol=1e-11)
    loss = gflow.analysis._theory.reduced_loss(4, 2, 2, 1.0, lam[1:])
    np.testing.assert_allclose(loss, [3.8858517774e00, 2.5617233733e-07], rtol=1e-9)
