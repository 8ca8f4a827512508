"""The demo ends with what to do next (issue 50), and the section of docs/demo.md it points at exists."""
from __future__ import annotations

from pathlib import Path

from eagleflow.demo import next_steps

REPO = Path(__file__).resolve().parents[2]


def test_the_demo_says_what_next_with_the_reports_path(tmp_path):
    (tmp_path / "report.html").write_text("<html></html>")
    text = "\n".join(next_steps(tmp_path))
    assert f"open the run report in a browser: {tmp_path / 'report.html'}\n" in text + "\n"
    assert "`make airflow`" in text and "unpause eagle3_pipeline" in text and "Trigger" in text
    assert "(not produced)" in "\n".join(next_steps(tmp_path / "missing"))
    assert "'Which figures vary'" in text
    assert "## Which figures vary" in (REPO / "docs" / "demo.md").read_text()
