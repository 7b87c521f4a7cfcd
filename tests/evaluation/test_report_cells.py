"""ascend_vlm.evaluation.report.accuracy_cells: a benchmark row's accuracy table cells."""

from __future__ import annotations

from ascend_vlm.data.statistics import paired_accuracies
from ascend_vlm.evaluation.report import accuracy_cells


def test_a_baseline_has_blank_comparison_cells():
    assert accuracy_cells({"accuracy": 0.75}) == ["0.750", "", ""]


def test_a_paired_comparison_gives_points_with_its_interval_and_p():
    paired = paired_accuracies([True, True, False, True], [True, False, False, True])
    row = {
        "accuracy": paired["second_accuracy"],
        "difference": paired["difference"],
        "interval": tuple(paired["ci95"]),
        "mcnemar_p": paired["mcnemar_p"],
    }
    low, high = paired["ci95"]
    assert accuracy_cells(row) == [
        "0.500",
        f"-25.0 pts [{100 * low:+.1f}, {100 * high:+.1f}]",
        f"{paired['mcnemar_p']:.3g}",
    ]
