"""Training metrics on disk: JSON lines, and a PNG of the loss and acceptance curves."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from eagleflow.durable import atomic_replace, atomic_write, open_owned


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    rows = []
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a crash
    return rows


def truncate_metrics(path: str | Path, keep_until_step: int) -> None:
    """Drop lines past the resumed step, so a resumed run does not log a step twice."""
    path = Path(path)
    rows = [r for r in read_metrics(path) if int(r.get("step", 0)) <= keep_until_step]
    if not path.exists():
        return
    atomic_write(path, "".join(json.dumps(r) + "\n" for r in rows))


def append_metrics(path: str | Path, row: dict[str, Any]) -> None:
    # appended to, never replaced: not through a link planted at its name (durable.open_owned)
    with os.fdopen(open_owned(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644, narrow=True), "a") as f:
        f.write(json.dumps(row) + "\n")


def plot_curves(metrics_path: str | Path, png_path: str | Path, title: str = "EAGLE-3 draft training") -> Path | None:
    """Loss (total and per TTT step) and acceptance (acc_k, simulated acceptance length) against step, with the
    held-out figures (``eval_*``) where the trainer scored them."""
    rows = read_metrics(metrics_path)
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    k = len([key for key in rows[0] if key.startswith("acc_")])   # eval_acc_* do not start so
    fig, (ax_loss, ax_acc, ax_len) = plt.subplots(1, 3, figsize=(15, 4.2))
    ax_loss.plot(steps, [r["loss"] for r in rows], label="weighted loss (train.loss_normalization)", color="black")
    if any("loss_per_position" in r for r in rows):
        ax_loss.plot(steps, [r.get("loss_per_position", float("nan")) for r in rows], color="tab:red",
                     label="weighted loss per scored position")
    for i in range(k):
        ax_loss.plot(steps, [r.get(f"loss_{i}", float("nan")) for r in rows], label=f"step {i}", alpha=0.5)
        ax_acc.plot(steps, [r.get(f"acc_{i}", float("nan")) for r in rows], label=f"acc_{i}")
    ax_len.plot(steps, [r["accept_length"] for r in rows], color="tab:green", label="training batches")
    held = [r for r in rows if "eval_accept_length" in r]
    if held:   # the held-out records (train.eval_every): where these part from the training lines, it overfits
        hs = [r["step"] for r in held]
        ax_loss.plot(hs, [r.get("eval_loss_per_position", float("nan")) for r in held], "o-", color="tab:purple",
                     label="held-out loss per scored position")
        ax_acc.plot(hs, [r["eval_acc_0"] for r in held], "o-", color="tab:purple", label="held-out acc_0")
        ax_len.plot(hs, [r["eval_accept_length"] for r in held], "o-", color="tab:purple", label="held-out")
        ax_len.legend(fontsize=7)
    ax_loss.set(title="loss", xlabel="step", yscale="log")
    ax_acc.set(title="top-1 agreement with the target", xlabel="step", ylim=(0, 1))
    ax_len.set(title="simulated acceptance length", xlabel="step", ylim=(1, max(k + 1, 2)))
    ax_loss.legend(fontsize=7)
    ax_acc.legend(fontsize=7)
    for ax in (ax_loss, ax_acc, ax_len):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    png_path = Path(png_path)
    try:
        with atomic_replace(png_path) as tmp:
            fig.savefig(tmp, dpi=90, format="png")
    finally:
        plt.close(fig)
    return png_path
