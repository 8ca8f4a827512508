"""One HTML page per run, written into the run directory: what happened, with the numbers.

Built on the node (``eagleflow report``), where the run's files are: corpus
stats per source, each shard's progress over time (the stored files' times,
so a stall shows as a flat line) with the watchdog's incidents marked, the GPU
memory/utilisation during capture (the health checks' history, handed in by
the control plane), the training curves and acceptance, and the export with the
exact SGLang and vLLM commands that serve it. It is written on success and on failure
alike; a missing phase says why it is missing. Self-contained (inline SVG), every
value escaped.
"""
from __future__ import annotations

import html
import os
import time
from pathlib import Path
from typing import Any, Sequence

from eagleflow import bounded_json
from eagleflow.durable import atomic_write
from eagleflow.engines import serving_engines
from eagleflow.train.export_formats import format_dir

REPORT_FILE = "report.html"
_COLORS = ("#1565c0", "#c62828", "#2e7d32", "#ef6c00", "#6a1b9a", "#00838f", "#ad1457", "#4e342e")


def _speed_spread(d: dict) -> str:
    """The paired speed-up's spread, and a mark (with its note) where it is above the acceptance length."""
    spread = d.get("speedup_spread")
    out = f" ({spread[0]:.2f}-{spread[1]:.2f})" if spread else ""
    return out + (f" <b title='{_e(d['speedup_note'])}'>*</b> {_e(d['speedup_note'])}" if d.get("speedup_note") else "")


def _e(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _read_json(path: Path) -> Any:
    try:
        return bounded_json.read(path, max_bytes=bounded_json.MAX_ANSWER_BYTES)
    except (OSError, ValueError):
        return None


def _jsonl(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            e = bounded_json.loads(line, source=str(path))
        except (ValueError, RecursionError):
            continue  # a line being appended while we read, or a damaged one: the report shows the rest
        if isinstance(e, dict):
            out.append(e)
    return out


# ----------------------------------------------------------------------------- gathering (on the node)
def shard_timelines(hidden_states_dir: Path) -> dict[int, dict[str, Any]]:
    """Per shard: (time, samples stored) from each stored file's mtime, plus its heartbeat's state."""
    out: dict[int, dict[str, Any]] = {}
    for d in sorted(hidden_states_dir.glob("shard_*")):
        try:
            shard = int(d.name.split("_")[1])
        except (IndexError, ValueError):
            continue
        times = []
        for entry in _jsonl(d / "manifest.jsonl"):
            try:
                times.append(os.stat(d / str(entry["file"])).st_mtime)
            except (OSError, KeyError):
                continue  # listed but gone: verification reports it
        times.sort()
        hb = _read_json(d / "heartbeat.json") or {}
        out[shard] = {"points": [[t, i + 1] for i, t in enumerate(times)], "done": len(times),
                      "total": hb.get("total"), "state": hb.get("state"), "started_at": hb.get("started_at")}
    return out


def gather(cfg, layout, state_dir: str | os.PathLike) -> dict[str, Any]:
    run_dir = Path(str(layout.run_dir))
    draft = Path(str(layout.draft_dir))
    incidents = [i for i in _jsonl(Path(state_dir) / "incidents" / "incidents.jsonl")]
    ours = {i["id"] for i in incidents if i.get("event") == "opened"
            and any(isinstance(s, dict) and s.get("run_id") == layout.run_id for s in (i.get("shards") or {}).values())}
    export = draft / "export"
    return {
        "run_id": layout.run_id, "run_dir": str(run_dir), "node": cfg.node.name, "has_gpu": cfg.node.has_gpu,
        "corpus": _read_json(Path(str(layout.corpus_dir)) / "stats.json"),
        "shards": shard_timelines(Path(str(layout.hidden_states_dir))),
        "verified": _read_json(Path(str(layout.hidden_states_dir)) / "verified.json"),
        "incidents": [i for i in incidents if i.get("id") in ours],
        "metrics": _jsonl(draft / "metrics.jsonl"),
        "export_dir": str(export) if (export / "config.json").is_file() else None,
        "export_files": sorted(p.name for p in export.iterdir()) if export.is_dir() else [],
        "serve_commands": serve_commands(cfg, export),
        "evaluation": _read_json(run_dir / "eval.json"),
    }


def serve_commands(cfg, export: Path) -> list[dict[str, Any]]:
    """Per engine that serves an exported draft (eagleflow.engines): its format, where that format lies, whether
    it was exported, and the command that serves the target with it."""
    out = []
    for e in serving_engines():
        d = format_dir(export, str(e.draft_format))
        out.append({"engine": e.label, "format": e.draft_format, "dir": str(d),
                    "subdir": d.relative_to(export).as_posix() if d != export else "",
                    "exported": (d / "config.json").is_file(), "command": e.serve_command_for(cfg, str(d))})
    return out


# ----------------------------------------------------------------------------- charts
def thin(points: list, limit: int = 500) -> list:
    """At most ``limit`` points, evenly picked, first and last kept: a 37k-sample shard stays a small page."""
    if len(points) <= limit:
        return points
    step = (len(points) - 1) / (limit - 1)
    return [points[round(i * step)] for i in range(limit)]


def line_chart(series: list[tuple[str, list[tuple[float, float | None]]]], *, title: str, y_label: str,
               x_is_time: bool = True, markers: Sequence[tuple[float, str]] = (), width: int = 720,
               height: int = 220, y_max: float | None = None) -> str:
    pts = [(x, y) for _, s in series for x, y in s if y is not None]
    if not pts:
        return f"<p class='none'>{_e(title)}: no data</p>"
    x0 = min([x for x, _ in pts] + [m for m, _ in markers])
    x1 = max([x for x, _ in pts] + [m for m, _ in markers])
    x1 = x1 if x1 > x0 else x0 + 1
    top = y_max if y_max is not None else max(y for _, y in pts) or 1
    left, bottom = 50, 30
    w, h = width - left - 10, height - bottom - 10

    def px(x: float) -> float:
        return left + w * (x - x0) / (x1 - x0)

    def py(y: float) -> float:
        return 10 + h - h * min(y, top) / top

    parts = [f"<line x1='{left}' y1='{10 + h}' x2='{left + w}' y2='{10 + h}' stroke='#999'/>",
             f"<line x1='{left}' y1='10' x2='{left}' y2='{10 + h}' stroke='#999'/>",
             f"<text x='2' y='16' font-size='10'>{_e(f'{top:.4g}')}</text>",
             f"<text x='2' y='{10 + h}' font-size='10'>0</text>",
             f"<text x='{left}' y='{height - 4}' font-size='10'>{_e(_fmt_x(x0, x_is_time))}</text>",
             # the last tick's label ends at the axis' end (text-anchor end), where its value is
             f"<text x='{left + w}' y='{height - 4}' font-size='10' text-anchor='end'>{_e(_fmt_x(x1, x_is_time))}"
             "</text>"]
    for k, (label, s) in enumerate(series):
        color = _COLORS[k % len(_COLORS)]
        seg: list[str] = []
        for x, y in s + [(None, None)]:
            if y is None or x is None:
                if len(seg) > 1:
                    parts.append(f"<polyline fill='none' stroke='{color}' stroke-width='1.5' points='{' '.join(seg)}'>"
                                 f"<title>{_e(label)}</title></polyline>")
                seg = []
                continue
            seg.append(f"{px(x):.1f},{py(y):.1f}")
    for x, label in markers:
        parts.append(f"<line class='incident' x1='{px(x):.1f}' y1='10' x2='{px(x):.1f}' y2='{10 + h}' stroke='#d00' "
                     f"stroke-dasharray='4 2'><title>{_e(label)}</title></line>")
    legend = " ".join(f"<span style='color:{_COLORS[k % len(_COLORS)]}'>&#9632; {_e(label)}</span>"
                      for k, (label, _) in enumerate(series))
    return (f"<figure><figcaption>{_e(title)} ({_e(y_label)})</figcaption><svg width='{width}' height='{height}' "
            f"role='img' aria-label='{_e(title)}'>{''.join(parts)}</svg><div class='legend'>{legend}</div></figure>")


def _fmt_x(x: float, is_time: bool) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(x)) if is_time else f"{x:g}"


# ----------------------------------------------------------------------------- sections
def _corpus(stats: dict | None) -> str:
    if not stats:
        return "<p class='missing'>No corpus statistics: prepare_corpus did not finish.</p>"
    rows = "".join(f"<tr><td>{_e(name)}</td><td>{int(s.get('read', 0)):,}</td><td>{int(s.get('records', 0)):,}</td>"
                   f"<td>{int(s.get('bad', 0)):,}</td><td>{int(s.get('dropped', 0)):,}</td>"
                   f"<td>{int(s.get('tokens', 0)):,}</td><td>{int(s.get('masked_tokens', 0)):,}</td></tr>"
                   for name, s in sorted((stats.get("per_source") or {}).items()))
    length = stats.get("length") or {}
    return (f"<p>{int(stats.get('records', 0)):,} records, {int(stats.get('tokens', 0)):,} tokens "
            f"({int(stats.get('masked_tokens', 0)):,} in the loss mask); length p50 {_e(length.get('p50'))}, "
            f"p99 {_e(length.get('p99'))}, max {_e(length.get('max'))}.</p>"
            "<table><tr><th>source</th><th>read</th><th>records</th><th>bad</th><th>dropped</th><th>tokens</th>"
            f"<th>loss-mask tokens</th></tr>{rows}</table>")


def _shards(data: dict) -> str:
    shards = data.get("shards") or {}
    if not shards:
        return "<p class='missing'>No shard stored anything: extraction did not start.</p>"
    markers = []
    for inc in data.get("incidents") or []:
        if inc.get("opened_at"):
            markers.append((float(inc["opened_at"]), f"incident {inc.get('id')}: {inc.get('cause')}, shards "
                                                      f"{', '.join(sorted((inc.get('shards') or {}).keys()))}"))
    series = [(f"shard {k}", thin([(float(t), float(n)) for t, n in v["points"]]))
              for k, v in sorted(shards.items(), key=lambda kv: int(kv[0]))]
    rows = "".join(f"<tr><td>{_e(k)}</td><td>{int(v['done']):,}</td><td>{_e(v.get('total') if v.get('total') is not None else 'n/a')}</td>"
                   f"<td>{_e(v.get('state') or 'n/a')}</td></tr>" for k, v in sorted(shards.items(), key=lambda kv: int(kv[0])))
    incidents = "".join(f"<li class='incident'>{_e(time.strftime('%H:%M:%S UTC', time.gmtime(float(i['opened_at']))))}: "
                        f"{_e(i.get('cause'))} on {_e(i.get('node'))}, shards {_e(', '.join(sorted((i.get('shards') or {}).keys())))}"
                        f" ({_e(i.get('id'))})</li>" for i in data.get("incidents") or [] if i.get("opened_at"))
    verified = data.get("verified") or {}
    ver = (f"<p class='ok'>Verified: {int(verified.get('samples') or 0):,} samples in {_e(verified.get('shards'))} "
           f"shard(s) against their manifests{' with digests' if verified.get('digest_checked') else ''}.</p>"
           if verified.get("ok") else "<p class='missing'>Not verified (verify_hidden_states did not pass).</p>")
    return (line_chart(series, title="samples stored per shard", y_label="samples", markers=markers)
            + f"<table><tr><th>shard</th><th>stored</th><th>total</th><th>worker state</th></tr>{rows}</table>"
            + (f"<p>Stall incidents (red dashed lines):</p><ul>{incidents}</ul>" if incidents else
               "<p>No stall incident in this run.</p>") + ver)


def capture_window(data: dict) -> tuple[float, float] | None:
    ts = [float(t) for v in (data.get("shards") or {}).values() for t, _ in v["points"]]
    starts = [float(v["started_at"]) for v in (data.get("shards") or {}).values() if v.get("started_at")]
    if not ts and not starts:
        return None
    return min(ts + starts), max(ts + starts)


def _gpus(data: dict, gpu: dict | None) -> str:
    window = capture_window(data)
    if not data.get("has_gpu", True) or (gpu is not None and not gpu.get("has_gpu", True)):
        return "<p>The node has no GPU (node.has_gpu: false): nothing to show.</p>"
    if gpu is None:
        return "<p class='missing'>No GPU history for this node in Airflow (gpu_node_health has not checked it).</p>"
    if window is None:
        return "<p class='missing'>Capture did not run: no GPU timeline.</p>"
    lo, hi = window[0] - 120, window[1] + 120
    hist = gpu.get("history") or {}
    ts = hist.get("t") or []
    idx = [i for i, t in enumerate(ts) if lo <= t <= hi]
    if not idx:
        kept = (gpu.get("retention_s") or 3600) / 60
        return (f"<p class='missing'>No health check fell inside the capture window; the GPU history keeps the "
                f"last {kept:.0f} min (EAGLEFLOW_GPU_HISTORY_MIN).</p>")
    names = {g["uuid"]: f"GPU {g.get('index')}" for g in gpu.get("gpus") or []}
    mem = [(names.get(u, u), [(ts[i], s["mem"][i]) for i in idx]) for u, s in sorted((hist.get("gpus") or {}).items())]
    util = [(names.get(u, u), [(ts[i], s["util"][i]) for i in idx]) for u, s in sorted((hist.get("gpus") or {}).items())]
    return (line_chart(mem, title="GPU memory used during capture", y_label="MiB")
            + line_chart(util, title="GPU utilisation during capture", y_label="%", y_max=100))


def _training(metrics: list[dict]) -> str:
    if not metrics:
        return "<p class='missing'>No training metrics: train_draft did not run.</p>"
    pts = thin(metrics, 400)
    loss = [("loss", [(float(m["step"]), m.get("loss")) for m in pts])]
    # comparable across batches, beside the B x T figure; on its own axis: it is many times the loss (about 26
    # against 3 in the demo) and would squash the loss' line flat
    per_position = []
    if any("loss_per_position" in m for m in pts):
        per_position.append(("loss per scored position",
                             [(float(m["step"]), m.get("loss_per_position")) for m in pts]))
    acc = [(k, [(float(m["step"]), m.get(k)) for m in pts]) for k in ("acc_0", "acc_1", "acc_2") if k in metrics[-1]]
    accept = [("acceptance length", [(float(m["step"]), m.get("accept_length")) for m in pts])]
    held = [m for m in metrics if "eval_accept_length" in m]   # train.eval_every: where these part, it overfits
    if held:
        per_position.append(("held-out loss per scored position",
                             [(float(m["step"]), m.get("eval_loss_per_position")) for m in held]))
        acc.append(("held-out acc_0", [(float(m["step"]), m.get("eval_acc_0")) for m in held]))
        accept.append(("held-out", [(float(m["step"]), m.get("eval_accept_length")) for m in held]))
    last = metrics[-10:]

    def mean(k: str) -> str:
        vals = [float(m[k]) for m in last if m.get(k) is not None]
        return f"{sum(vals) / len(vals):.3f}" if vals else "n/a"
    return (f"<p>{int(metrics[-1]['step']):,} steps; last 10 steps: loss {mean('loss')}, acc_0 {mean('acc_0')}, "
            f"acceptance length {mean('accept_length')}.</p>"
            + (f"<p>Held-out ({int(held[-1]['eval_samples'])} samples never trained on) at step "
               f"{int(held[-1]['step']):,}: loss per scored position {held[-1].get('eval_loss_per_position', 0):.3f}, "
               f"acc_0 {held[-1]['eval_acc_0']:.3f}, simulated acceptance length "
               f"{held[-1]['eval_accept_length']:.3f}.</p>" if held else "")
            + line_chart(loss, title="training loss", y_label="loss over all B x T positions, SpecForge's",
                         x_is_time=False)
            + (line_chart(per_position, title="loss per scored position", y_label="loss", x_is_time=False)
               if per_position else "")
            + line_chart(acc, title="draft accuracy per step", y_label="accuracy", x_is_time=False, y_max=1)
            + line_chart(accept, title="acceptance length (simulated)", y_label="tokens", x_is_time=False))


def _export(data: dict) -> str:
    if not data.get("export_dir"):
        return "<p class='missing'>No export: export_draft did not finish.</p>"
    serve = ""
    for s in data["serve_commands"]:
        where = f" (the {_e(s['format'])} format in <code>{_e(s['subdir'])}/</code>)" if s["subdir"] else ""
        serve += (f"<p>Serve it with {_e(s['engine'])}{where}:</p><pre class='cmd'>{_e(s['command'])}</pre>"
                  if s["exported"] else f"<p class='missing'>No {_e(s['format'])}-format export for "
                  f"{_e(s['engine'])} (train.export_formats).</p>")
    return (f"<p>Exported draft: <code>{_e(data['export_dir'])}</code> ({_e(', '.join(data['export_files']))})</p>"
            + serve)


def _approval(ev: dict) -> str:
    """A passing draft: promoted by the gate, or what a person decided (eval.approval): who, why, when."""
    a = ev.get("approval") or {}
    state = a.get("state")
    if state in (None, "not_needed"):
        return f"<p class='ok'>Passed the promotion gate; promoted: <code>{_e(ev.get('promoted'))}</code></p>"
    if state == "pending":
        return ("<p class='missing'>Passed the promotion gate; waiting for a person's approval (Airflow: Required "
                "Actions): not promoted yet.</p>")
    who = _e(a.get("by") or ("nobody: no answer in time" if a.get("decision") == "timeout" else "unknown"))
    why = f": &ldquo;{_e(a['why'])}&rdquo;" if a.get("why") else ""
    when = f" at {_e(a['decided_at'])}" if a.get("decided_at") else ""
    if state == "approved":
        return (f"<p class='ok approval'>Passed the promotion gate; approved by {who}{when}{why}; promoted: "
                f"<code>{_e(ev.get('promoted'))}</code></p>")
    verb = "approved, but not promoted" if a.get("decision") == "approve" else "rejected"
    kept = (f"the draft in service stays: <code>{_e(ev.get('baseline_draft'))}</code>" if ev.get("baseline_draft")
            else "nothing is in service")
    return (f"<p class='failed approval'>Passed the promotion gate; {verb} by {who}{when}{why}. Not promoted: "
            f"{kept}" + (f" ({_e(a['stale'])})" if a.get("stale") else "") + ".</p>")


def _evaluation(ev: dict | None) -> str:
    """Held-out speculative decoding (eagleflow.evaluate): configuration x prompt set, the gate's verdict."""
    if not ev:
        return "<p class='missing'>No evaluation: evaluate_draft did not finish.</p>"
    head = ("<tr><th>config (steps/topk/draft tokens)</th><th>prompts</th><th>acceptance length</th>"
            "<th>accepted at position</th><th>tok/s with draft</th><th>tok/s target alone</th><th>speed-up</th>"
            "<th>lossless</th><th>minimum</th><th>baseline</th></tr>")
    rows = ""
    for r in ev.get("results", []):
        d, b = r["draft"], r.get("baseline")
        lossless = ("yes" if d["lossless"] else "NO") + (f" ({d['near_ties']} near-tie)" if d.get("near_ties") else "")
        base = f"{b['accept_length']:.3f}" if b else "-"
        per_pos = " ".join(f"{x:.2f}" for x in d["accepted_at_position"])
        rows += (f"<tr><td>{_e(r['config'])}</td><td>{_e(r['prompt_set'])} ({_e(r['prompts'])})</td>"
                 f"<td>{d['accept_length']:.3f}</td><td>{_e(per_pos)}</td><td>{d['tokens_per_s']:.1f}</td>"
                 f"<td>{d['target_tokens_per_s']:.1f}</td><td>{(d['speedup'] or 0):.2f}x{_speed_spread(d)}</td>"
                 f"<td>{lossless}</td>"
                 f"<td>{r['min_accept_length']:.2f}</td><td>{base}</td></tr>")
    verdict = (_approval(ev) if ev.get("passed") else "<p class='failed'>Refused by the promotion gate (the "
               "export is kept): " + _e("; ".join(ev.get("refused", []))) + "</p>")
    return (f"{verdict}<table>{head}{rows}</table><p>Greedy decoding of held-out prompts, target "
            f"{_e(ev.get('target_dtype'))} on {_e(ev.get('device'))}, up to {_e(ev.get('max_new_tokens'))} new tokens; "
            "acceptance length = tokens per target verify pass (1.0 = the draft never right). Figures: "
            f"<code>{_e(ev.get('eval_file'))}</code></p>")


def _tasks(tasks: dict[str, str] | None) -> str:
    if not tasks:
        return ""
    bad = {t: s for t, s in tasks.items() if s not in ("success", "skipped", None)}
    rows = "".join(f"<tr class='{_e(s)}'><td>{_e(t)}</td><td>{_e(s)}</td></tr>" for t, s in tasks.items())
    head = (f"<p class='failed'>Did not succeed: {_e(', '.join(f'{t} ({s})' for t, s in bad.items()))}</p>" if bad
            else "<p class='ok'>Every task before this report succeeded.</p>")
    return f"<h2>Tasks</h2>{head}<details><summary>all tasks</summary><table>{rows}</table></details>"


def render(data: dict, *, tasks: dict[str, str] | None = None, gpu: dict | None = None,
           now: float | None = None) -> str:
    now = time.time() if now is None else now
    css = ("body{font-family:system-ui,sans-serif;margin:16px;max-width:1000px}table{border-collapse:collapse}"
           "td,th{border:1px solid #ccc;padding:2px 6px;font-size:.9em}.missing{color:#a60}.failed{color:#b00;"
           "font-weight:bold}.ok{color:#2a7a2a}pre.cmd{background:#f4f4f4;padding:8px;white-space:pre-wrap}"
           "figure{margin:.5em 0}figcaption{font-weight:bold;font-size:.9em}.legend{font-size:.8em}")
    return ("<!doctype html><html><head><meta charset='utf-8'>"
            f"<title>eagleflow run {_e(data['run_id'])}</title><style>{css}</style></head><body>"
            f"<h1>eagleflow run {_e(data['run_id'])}</h1>"
            f"<p>node {_e(data['node'])} · run directory <code>{_e(data['run_dir'])}</code> · report written "
            f"{_e(time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(now)))}</p>"
            + _tasks(tasks)
            + "<h2>Corpus</h2>" + _corpus(data.get("corpus"))
            + "<h2>Extraction</h2>" + _shards(data)
            + "<h2>GPUs during capture</h2>" + _gpus(data, gpu)
            + "<h2>Training</h2>" + _training(data.get("metrics") or [])
            + "<h2>Export</h2>" + _export(data)
            + "<h2>Held-out evaluation</h2>" + _evaluation(data.get("evaluation"))
            + "</body></html>")


def write_report(cfg, layout, *, tasks: dict[str, str] | None = None, gpu: dict | None = None) -> Path:
    data = gather(cfg, layout, cfg.node_state_dir())
    path = Path(str(layout.run_dir)) / REPORT_FILE
    atomic_write(path, render(data, tasks=tasks, gpu=gpu))
    return path
