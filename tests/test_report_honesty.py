"""The report never shows a flow that did not converge as an endpoint: built on grids whose deep
flows run out of steps, it marks them, leaves them out of every number, and fails their claims."""

import matplotlib
import numpy as np
import pytest

import gflow
from gflow.studies import _reproduce

matplotlib.use("Agg")

# Depth 2 converges within 20 steps, depth >= 3 does not: a grid with both.
SIZE = dict(_reproduce.SIZES["quick"], options=gflow.FlowOptions(max_steps=20))


class _Bar:
    def update(self, n):
        pass


@pytest.fixture(scope="module")
def sections(tmp_path_factory):
    out = tmp_path_factory.mktemp("honest")
    identity, identity_facts, identity_ds = _reproduce.identity_family_section(SIZE, out, _Bar())
    random, random_facts = _reproduce.random_init_section(SIZE, out, _Bar())
    return identity, identity_facts, identity_ds, random, random_facts, out


def test_identity_section_counts_and_excludes_what_did_not_converge(sections):
    identity, facts, ds, *_ = sections
    status = ds["status"].values
    assert (status[0] == 0).all() and (status[1:] == gflow.Status.MAX_STEPS).all()
    assert facts["converged"] == 3 and facts["flows"] == 9 and not facts["all_converged"]
    # depth >= 3 at the smallest alpha has no endpoint: no number is claimed for it
    assert facts["srank_minus_1_by_depth"] == {
        2: pytest.approx(facts["srank_minus_1_by_depth"][2]),
        3: None,
        5: None,
    }
    assert facts["deep_srank_minus_1"] is None
    assert "6 of 9 flows did not converge (6 max_steps)" in identity.caption


def test_random_section_counts_and_excludes_what_did_not_converge(sections):
    *_, random, facts, out = sections
    assert facts["diagonal"][2] is not None and facts["diagonal"][3] is None
    assert "6 of 12 flows did not converge (6 max_steps)" in random.caption
    assert "L = 3: not converged" in random.caption
    assert (out / random.figure).stat().st_size > 1000


def test_the_panel_draws_non_converged_flows_as_grey_crosses(sections):
    import matplotlib.pyplot as plt

    *_, out = sections
    ds = gflow.load_sweep(out / "random_diagonal.zarr")
    fig, ax = plt.subplots()
    means = _reproduce._random_init_panel(ax, ds, "diagonal")
    crosses = [line for line in ax.lines if line.get_marker() == "x"]
    assert len(crosses) == 1 and crosses[0].get_color() == "0.5"
    assert len(crosses[0].get_xdata()) == int((ds["status"].values != 0).sum()) == 6
    assert "did not converge (not an endpoint)" in [t.get_text() for t in ax.get_legend().texts]
    # the errorbar line of depth 3 has no point at all: none of its flows converged
    plotted = [line for line in ax.lines if line.get_marker() == "o"]
    assert [len(line.get_xdata()) for line in plotted] == [3, 0]
    assert means[3] is None
    plt.close(fig)


def test_identity_figure_marks_non_converged_rows():
    import matplotlib.pyplot as plt

    rows = [
        {"L": 3, "alpha": a, "stable_rank": 1.01, "sigma_a": 4.0, "sigma_b": 0.01, "status": s}
        for a, s in ((0.1, 0), (0.01, 2))
    ]
    fig = gflow.plot_rank_vs_alpha(rows, n=4)
    crosses = [line for line in fig.axes[0].lines if line.get_marker() == "x"]
    assert [list(line.get_xdata()) for line in crosses if len(line.get_xdata())] == [[0.01]]
    labels = [t.get_text() for t in fig.axes[0].get_legend().texts]
    assert "did not converge (not an endpoint)" in labels
    plt.close(fig)


def test_claims_without_an_endpoint_are_not_reproduced(sections):
    _, identity_facts, _, _, random_facts, _ = sections
    coupling = _reproduce.coupling_section()[1]
    row = {
        "L": 2,
        "warm_stable_rank": 1.2,
        "cold_stable_rank": 1.0,
        "warm_distance": 0.1,
        "pretrain_status": "converged",
        "warm_status": "max_steps",  # not an endpoint: the plasticity claim has no evidence
        "cold_status": "converged",
    }
    facts = {
        "identity": identity_facts,
        "random": random_facts,
        "coupling": coupling,
        "plasticity": {
            "rows": [row, dict(row, L=3)],
            "l2_connected_small_alpha_srank": None,
            "l3_minf_warm_x21": float("nan"),
        },
    }
    table, verdicts = _reproduce.claims_table(facts)
    by_row = {v["row"]: v["marks"] for v in verdicts}
    assert by_row["L = 2, general init, disconnected Ω"] == [True, True, False]
    assert by_row["L = 3, general init (m = 4 / Gaussian)"][1:] == [False, False]
    assert by_row["L = 5, general init"][1] is False
    assert table.count("no endpoint") >= 5 and "not converged" in table


def test_status_note_names_counts_and_labels():
    assert _reproduce.status_note([0, 0]) == "all 2 flows converged"
    note = _reproduce.status_note([0, 1, 2, 2, -1])
    assert note.startswith("4 of 5 flows did not converge (2 max_steps, 1 pending, 1 t_max)")
    assert not _reproduce.converged([1, 2, 3, 4, -1]).any()
    assert np.asarray(_reproduce.converged([0])).all()
