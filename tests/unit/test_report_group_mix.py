"""The report's "Generated vs trained groups" section reads the buffer's buffer/mix/... run counters
of the last step that has them: one row per bucket in numeric order, counts per kind, shares and
the delivered/generated ratio computed by hand below; a run without the counters gets a note."""

from __future__ import annotations

import json
import re
from pathlib import Path

from asyncrl.report import group_mix_table, render


def _rows() -> list[dict]:
    last = {"step": 7,
            "buffer/mix/generated/difficulty/steps1": 10.0, "buffer/mix/generated/difficulty/steps4": 30.0,
            "buffer/mix/generated/difficulty/steps10": 0.0,
            "buffer/mix/delivered/difficulty/steps1": 10.0, "buffer/mix/delivered/difficulty/steps4": 15.0,
            "buffer/mix/dropped_stale/difficulty/steps4": 15.0,
            "buffer/mix/generated/length/16-31": 40.0, "buffer/mix/delivered/length/16-31": 25.0,
            "buffer/mix/generated/len_mean": 21.5, "buffer/mix/delivered/len_mean": 19.25}
    return [{"step": 6, "buffer/mix/generated/difficulty/steps1": 1.0}, last, {"step": 8, "eval/guided_accuracy": 0.5}]


def test_table_by_hand() -> None:
    page = group_mix_table(_rows())
    difficulty = page[page.index("by difficulty"):page.index("by policy tokens")]
    buckets = re.findall(r"<tr><td>([^<]+)</td>", difficulty)
    assert buckets == ["steps1", "steps4", "steps10"]  # numeric order, not text order
    # steps4: generated 30 of 40 = 75.0%, delivered 15 of 25 = 60.0%, 15 / 30 = 0.50 delivered; 15 dropped stale
    assert ("<tr><td>steps4</td><td>30</td><td>15</td><td>15</td><td>0</td>"
            "<td>75.0%</td><td>60.0%</td><td>0.50</td></tr>") in difficulty
    # steps10 generated nothing: no ratio
    assert "<tr><td>steps10</td><td>0</td><td>0</td><td>0</td><td>0</td><td>0.0%</td><td>0.0%</td><td>-</td></tr>" in difficulty
    assert "<tr><td>16-31</td><td>40</td><td>25</td>" in page
    assert "generated 21.5, delivered 19.2" in page and "up to step 7" in page


def test_a_run_without_counters_gets_a_note_and_the_page_has_the_section(tmp_path: Path) -> None:
    assert "No generated/trained group counts" in group_mix_table([{"step": 1, "train/reward_mean": 0.5}])
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in _rows()) + "\n")
    page = render(tmp_path)
    assert 'id="group-mix"' in page and "<td>steps4</td>" in page
