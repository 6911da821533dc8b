"""How many digits of an endpoint are real: the identity family's reduced flow against the
implicit equations and the full flow, and endpoint sensitivity where the family's invariant
set is unstable (s > 1) and where it is not (s = 1)."""

import dataclasses
import math

import numpy as np
import pytest

import gflow

# The case of the finding: blocks 3×2, L = 3, α = 0.02, m = 3 (σ_B = 5.456920381773e-6, ×2).
BLOCKS = dict(depth=3, n=3, s=2, alpha=0.02, m=3.0)


def _rel(log_measured, log_predicted):
    return abs(math.expm1(log_measured - log_predicted))


@pytest.mark.parametrize(
    "depth, n, s, alpha, m",
    [
        (2, 4, 1, 1e-3, 4.0),
        (3, 4, 1, 1e-2, 4.0),
        (3, 3, 2, 0.02, 3.0),
        (6, 4, 1, 1e-4, 4.0),  # plateau ~2.7e14, σ_B ~ 1.9e-25
        (10, 2, 1, 1e-4, 4.0),  # σ_B ~ 6e-42
        (4, 3, 1, 0.5, 2.0),
        (3, 4, 1, 1e-2, math.inf),
    ],
)
def test_the_reduced_flow_ends_on_the_implicit_equations(depth, n, s, alpha, m):
    run = gflow.family_flow(depth, n, s, alpha, m)
    limit = gflow.family_limit(depth, n, s, alpha, m)
    assert run.status == "converged"
    assert _rel(run.log_sigma_a, math.log(float(limit.sigma_a))) < 1e-11
    assert _rel(run.log_sigma_b, float(limit.log_sigma_b)) < 1e-11


def test_the_reduced_flow_escapes_when_the_theory_says():
    run = gflow.family_flow(6, 4, 1, 1e-4, 4.0)
    # the blow-up time of the plateau; the true escape comes O(1) later on a scale of 2.7e14
    assert abs(run.escape_time / float(gflow.escape_time(6, 4, 1, 1e-4, 4.0)) - 1) < 1e-9
    assert run.t_end > run.escape_time


def test_the_reduced_flow_trajectory_matches_the_reference_checkpoints():
    """The reference values of the shared theory notes (T5), also held by `reduced_flow`."""
    run = gflow.family_flow(4, 2, 2, 0.2, 4.0, ts=[0.0, 1.0, 5.0])
    lam = np.exp(run.log_lambda_ts)
    np.testing.assert_allclose(lam[1:, 0], [4.8835313329596e-01, 1.4141482233369e00], rtol=1e-11)
    np.testing.assert_allclose(lam[1:, 1], [1.5718482043633e-01, 1.6488718486048e-01], rtol=1e-11)
    np.testing.assert_allclose(lam[1:, 2], [1.4999829147436e-01, 1.4999145873375e-01], rtol=1e-11)
    np.testing.assert_allclose(lam[0], [0.2 * 1.75, 0.2 * 0.75, 0.2 * 0.75], rtol=1e-15)


def _full_against_reduced(depth, n, s, alpha, m, ts):
    problem = gflow.block_diagonal(n, s) if s > 1 else gflow.diagonal(n)
    model = gflow.identity_family(n * s, depth, alpha, m)
    full = gflow.flow(problem, model, save_ts=tuple(ts), save_layers=True, rtol=1e-12)
    config = gflow.FamilyConfig(depth, n, s, alpha, m)
    return full, gflow.compare_family_trajectory(full, config)


def test_full_and_reduced_flows_agree_along_the_trajectory_s1():
    """Plateau, escape and convergence of the full 4×4 depth-3 flow, λ_A and λ_B measured
    from its layers, against the reduced flow: 1e-10 relative at every sample."""
    ts = [0.0, 1.0, 10.0, 30.0, 50.0, 55.0, 56.0, 57.0, 58.0, 60.0, 62.0]
    full, cmp = _full_against_reduced(3, 4, 1, 1e-2, 4.0, ts)
    assert full.status_label == "converged" and cmp["modes"] == ["a", "b"]
    np.testing.assert_array_equal(cmp["t"], ts)
    assert cmp["max_relerr"] < 1e-10, cmp["relerr"]
    # the comparison can fail: the reduced flow of another α is far off
    other = gflow.family_flow(3, 4, 1, 2e-2, 4.0, ts=ts).log_lambda_ts[:, :2]
    assert np.abs(np.expm1(cmp["log_lambda_full"] - other)).max() > 1e-2


def test_full_and_reduced_flows_agree_on_the_blocks_case_before_mode_c_decays():
    """s = 2: before mode C has decayed the full flow follows the reduced one, σ_B included."""
    ts = [0.0, 5.0, 9.0, 10.0, 12.0, 20.0]
    _, cmp = _full_against_reduced(**BLOCKS, ts=ts)
    assert cmp["modes"] == ["a", "b", "c"]
    assert cmp["max_relerr"] < 1e-10, cmp["relerr"]
    limit = gflow.family_limit(**BLOCKS)
    assert _rel(3 * cmp["log_lambda_reduced"][-1, 1], float(limit.log_sigma_b)) < 1e-9


def test_compare_family_judges_only_what_is_well_conditioned(blocks_sensitivity):
    problem = gflow.block_diagonal(3, 2)
    model = gflow.identity_family(6, 3, 0.02, 3.0)
    config = gflow.FamilyConfig(**{k: BLOCKS[k] for k in ("depth", "n", "s", "alpha", "m")})
    result = gflow.flow(problem, model)
    row = gflow.compare_family(result, config)
    # σ_B's relative error here is ~1e-5 to 1e-4: it would fail a 1e-8 check, for no fault
    assert row["sigma_b_relerr"] > 1e-8 and row["sigma_a_relerr"] < 1e-8
    assert row["ill_conditioned"] == ["sigma_b", "sigma_c"]
    assert row["verdict"] == "agrees" and "not judged" in row["note"]
    assert "agrees: sigma_a;" in row["note"]
    judged = gflow.compare_family(result, config, blocks_sensitivity)
    assert judged["sigma_b_digits"] == blocks_sensitivity.digits["sigma_b"] <= 6
    assert judged["verdict"] == "agrees to its reproducible digits", judged["note"]
    # a wrong prediction is caught, with the reason
    wrong = gflow.compare_family(result, dataclasses.replace(config, alpha=0.021))
    assert wrong["verdict"] == "differs" and "sigma_a off by" in wrong["note"]
    # s = 1 (stable): everything judged, to 1e-8
    s1 = gflow.FamilyConfig(3, 4, 1, 1e-2, 4.0)
    plain = gflow.compare_family(
        gflow.flow(gflow.diagonal(4), gflow.identity_family(4, 3, 1e-2, 4.0)), s1
    )
    assert plain["ill_conditioned"] == [] and plain["verdict"] == "agrees"
    assert plain["note"] == "agrees: sigma_a, sigma_b"


def test_reproducible_digits():
    assert gflow.reproducible_digits([1.0, 1.0, 1.0]) == 15
    assert gflow.reproducible_digits([1.0, 1.0 + 3e-9]) == 8
    assert gflow.reproducible_digits([5.4579e-6, 5.4572e-6]) == 3
    assert gflow.reproducible_digits([1.0, 2.0, 0.5]) == 0
    assert gflow.reproducible_digits([1.0, math.nan]) == 0


@pytest.fixture(scope="module")
def blocks_sensitivity():
    problem = gflow.block_diagonal(3, 2)
    model = gflow.identity_family(6, 3, 0.02, 3.0)
    return gflow.sensitivity(problem, model, k=4, eps=1e-14, family=(3, 2))


def test_sensitivity_finds_the_unstable_digits_of_the_blocks_case(blocks_sensitivity):
    """A 1e-14 change of the init moves σ_B in its 5th digit: its last digits are rounding,
    though every member converged; σ_A (= σ₁) keeps at least 9 digits."""
    sens = blocks_sensitivity
    assert sens.all_converged and len(sens.statuses) == 5
    assert sens.digits["sigma_b"] <= 6
    assert sens.digits["sigma_2"] <= 6 and sens.digits["sigma_3"] <= 6
    assert sens.digits["sigma_a"] >= 9 and sens.digits["sigma_1"] >= 9
    assert sens.spread("sigma_b") > 1e3 * 1e-14 * sens.values["sigma_b"][0]
    rows = {r["quantity"]: r for r in sens.rows()}
    assert rows["sigma_b"]["digits"] == sens.digits["sigma_b"]
    assert "sigma_b" in sens.format() and "5 converged" in sens.format()


def test_sensitivity_of_the_stable_s1_family_keeps_its_digits():
    problem = gflow.diagonal(4)
    model = gflow.identity_family(4, 3, 1e-2, 4.0)
    sens = gflow.sensitivity(problem, model, k=3, eps=1e-12, family=(4, 1))
    assert sens.all_converged
    assert sens.digits["sigma_a"] >= 12 and sens.digits["sigma_b"] >= 8
    assert sens.digits["unobserved_error"] >= 7


def test_sensitivity_says_nothing_of_flows_that_did_not_converge():
    problem = gflow.diagonal(4)
    model = gflow.identity_family(4, 3, 1e-2, 4.0)
    sens = gflow.sensitivity(problem, model, k=1, eps=1e-12, max_steps=5)
    assert not sens.all_converged
    assert all(d is None for d in sens.digits.values())
    assert "max_steps" in sens.format()


@pytest.mark.parametrize(
    "kwargs, message", [({"k": 0}, "k"), ({"eps": 0.0}, "eps"), ({"eps": math.nan}, "eps")]
)
def test_sensitivity_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        gflow.sensitivity(gflow.diagonal(2), gflow.identity_family(2, 2, 0.1, 4.0), **kwargs)


def test_gflow_run_reports_the_reproducible_digits(capsys):
    import json

    import gflow.cli

    argv = ["run", "--problem", "diagonal", "--dim", "3", "--depth", "3", "--alpha", "0.1"]
    assert gflow.cli.main([*argv, "--m", "4", "--sensitivity", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    sens = report["sensitivity"]
    assert sens["eps"] == 1e-12 and sens["statuses"] == ["converged"] * 3
    rows = {r["quantity"]: r for r in sens["quantities"]}
    assert rows["sigma_a"]["digits"] >= 10 and rows["sigma_1"]["digits"] >= 10
    assert abs(rows["sigma_a"]["value"] / report["family_spectrum"]["sigma_a"] - 1) < 1e-9
    assert gflow.cli.main([*argv, "--sensitivity", "-1"]) == 2
    assert "--sensitivity K needs K >= 1" in capsys.readouterr().err
