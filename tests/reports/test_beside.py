"""``ernie5 report RUN --beside OTHER``: two models' sub-models matched by the share of the full model
they keep, and for each cut what each model loses first."""

from __future__ import annotations

from reports import build_report
from reports.analysis import analyze
from reports.beside import beside_table, cut_label, cut_shares
from reports.load import load_run
from tests.reports.conftest import write_run


def test_cuts_are_shares_of_the_full_model_whatever_the_absolute_sizes(tmp_path):
    run = load_run(write_run(tmp_path, "a"))
    shares = cut_shares(run)
    assert shares["full"] == (1.0, 1.0, 1.0)
    assert shares["k1"] == (1.0, 1.0, 0.25) and shares["d0.75"] == (0.75, 1.0, 1.0)
    assert shares["d0.75-w0.5-k1"] == (0.75, 0.5, 0.25)
    assert cut_label(shares["d0.75-w0.5-k1"]) == "depth 75.0% + width 50.0% + top-k 25.0%"
    assert cut_label(shares["full"]) == "full"
    real = {"name": "k1", "layers": [0, 1, 2, 3], "experts_per_layer": [8, 8, 8, 8], "top_k": 1}
    full = {"name": "full", "layers": [0, 1, 2, 3], "experts_per_layer": [8, 8, 8, 8], "top_k": 2}
    half = {"name": "d0.5", "layers": [0, 3], "experts_per_layer": [8, None, None, 8], "top_k": 2}
    run.manifest["subnets"] = [full, real, half]  # a real sweep's manifest: lists per layer
    assert cut_shares(run) == {"full": (1.0, 1.0, 1.0), "k1": (1.0, 1.0, 0.5), "d0.5": (0.5, 1.0, 1.0)}


def test_each_cut_names_what_each_model_loses_first(tmp_path):
    ours = write_run(tmp_path, "ours", baseline=True)
    # The other model: under top-k it loses its image understanding first, under depth its speech.
    theirs = write_run(
        tmp_path,
        "theirs",
        seed=1,
        baseline=True,
        shift={("k1", "image_qa"): 0.45, ("d0.75", "asr"): 0.5},
    )
    a, b = load_run(ours), load_run(theirs)
    table = beside_table(a, analyze(a), b, analyze(b)).set_index("cut")
    assert list(table.index) == [
        "top-k 25.0%",
        "depth 75.0%",
        "width 50.0%",
        "depth 75.0% + width 50.0% + top-k 25.0%",
    ]
    assert table.loc["top-k 25.0%", "theirs: loses first"].startswith("image_qa (")
    assert table.loc["depth 75.0%", "theirs: loses first"].startswith("asr (")
    assert table.loc["top-k 25.0%", "ours: subnet"] == "k1"
    for _, row in table.iterrows():  # the order starts with what is lost first
        for who in ("ours", "theirs"):
            assert row[f"{who}: order"].split(" < ")[0] == row[f"{who}: loses first"].split(" (")[0]
    report = build_report(ours, tmp_path / "report", beside=theirs)
    summary = (report / "summary.md").read_text()
    assert "## Beside theirs" in summary
    assert "**top-k 25.0%**: ours loses" in summary and "theirs loses image_qa (" in summary
    assert (report / "tables" / "beside.csv").is_file()
    assert summary.index("## Beside theirs") < summary.index("## Capability seesaw")  # the answer first


def test_a_model_at_chance_everywhere_gets_no_loss_order_but_a_reason(tmp_path):
    ours = write_run(tmp_path, "ours", baseline=True)
    theirs = write_run(tmp_path, "theirs", baseline=True, chance=("text", "image", "audio"))
    report = build_report(ours, tmp_path / "report", beside=theirs)
    summary = (report / "summary.md").read_text()
    assert "no task is answered above chance by both full models" in summary
    assert "theirs: none)" in summary
