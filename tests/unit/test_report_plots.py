"""The run report's training plots (issue 50): the last tick's label ends at the axis' end, and the loss per scored
position (about 26 in the demo, against a loss of about 3) has its own chart instead of squashing the loss flat."""
from __future__ import annotations

import re

from eagleflow.console.run_report import _training, line_chart


def _figures(html: str) -> dict[str, str]:
    return {m.group(1): m.group(0) for m in re.finditer(r"<figure><figcaption>([^<(]+?) \(.*?</figure>", html)}


def test_the_last_tick_ends_at_the_axis_end():
    svg = line_chart([("loss", [(1.0, 5.0), (150.0, 3.0)])], title="t", y_label="y", x_is_time=False, width=720)
    axis = re.search(r"<line x1='(\d+)' y1='(\d+)' x2='(\d+)' y2='\2' stroke='#999'/>", svg)
    assert axis, svg
    end = int(axis.group(3))
    last = re.search(r"<text x='([\d.]+)' y='\d+' font-size='10' text-anchor='end'>150</text>", svg)
    assert last and float(last.group(1)) == end, svg


def test_the_loss_per_scored_position_has_its_own_axis():
    metrics = [{"step": s, "loss": 5.0 - s / 50, "loss_per_position": 26.0 - s / 10, "acc_0": 0.1, "accept_length": 1.1}
               for s in range(1, 151)]
    metrics[49].update(eval_accept_length=1.3, eval_acc_0=0.3, eval_loss_per_position=14.4, eval_samples=6)
    figs = _figures(_training(metrics))
    assert {"training loss", "loss per scored position"} <= set(figs), list(figs)
    loss = figs["training loss"]
    assert "per scored position" not in loss
    top = float(re.search(r"<text x='2' y='16' font-size='10'>([\d.]+)</text>", loss).group(1))
    assert top < 5.0, top   # the loss' own scale, not the per-position one's 26
    per = figs["loss per scored position"]
    assert "held-out loss per scored position" in per
    assert float(re.search(r"<text x='2' y='16' font-size='10'>([\d.]+)</text>", per).group(1)) > 25
