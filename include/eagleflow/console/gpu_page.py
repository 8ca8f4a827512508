"""The GPU view as HTML: a page shell that refreshes itself, and the panel it reloads.

``render_panel`` turns the status documents into one HTML fragment (every value
escaped); ``page_shell`` is the page around it, whose script reloads the panel
every ``refresh_s`` and keeps every "… ago" ticking between reloads (a time is
written once as ``data-ts`` and counted on the client, so it never freezes).
Sparklines are inline SVG over the document's own history. Held GPUs (memory
above the threshold at 0 %) are marked ``held`` with the time they started.
"""
from __future__ import annotations

import html
import json
import time
from typing import Any, Sequence, TypedDict, cast

from eagleflow.health import airflow_health
from eagleflow.health.durations import duration  # one way to say how long: the page and the mails
from eagleflow.health.node_activity import StoreDoc, TrainingDoc, eta_of_training
from eagleflow.health.status_doc import GpuEntry, GpuProcessDoc, GpuSeries, History, StatusDoc, is_held_idle
from eagleflow.watchdog.incidents import MAX_NODE_TIME

HEALTH_DAG_ID = "gpu_node_health"


class HealthDagState(TypedDict, total=False):
    """gpu_node_health as Airflow knows it (airflow/console_app.py reads it); None where it is not loaded."""
    is_paused: bool
    interval_s: float      # its schedule; else the status documents' own


def _e(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _cell(v: Any, unit: str = "") -> str:
    return "n/a" if v is None else _e(f"{v}{unit}")


def _time(ts: Any) -> float | None:
    """``ts`` as seconds when it is a finite time before 2100; else None (a document may hold what a node wrote,
    and one bad value must not take the page down for every node)."""
    try:
        t = float(ts)
    except (TypeError, ValueError, OverflowError):
        return None
    return t if 0 <= t < MAX_NODE_TIME else None


def _utc(ts: float) -> str:
    t = _time(ts)
    return time.strftime("%H:%M UTC", time.gmtime(t)) if t is not None else "an unknown time"


def ago(ts: float | None, now: float) -> str:
    """A span that says how long ago ``ts`` was and keeps counting in the browser."""
    if not ts:
        return "<span>never</span>"
    t = _time(ts)
    if t is None:
        return "<span>at an unknown time</span>"
    return f"<span class='ago' data-ts='{t:.0f}'>{duration(now - t)} ago</span>"


def airflow_line(doc: airflow_health.AirflowHealth | None, now: float) -> str:
    """The "Airflow" line: each part, its status and last heartbeat."""
    if not doc:
        return "<div class='airflow unknown'><b>Airflow</b>: health not read yet</div>"
    if doc.get("error"):
        return (f"<div class='airflow down'><b>Airflow</b>: health endpoint {_e(airflow_health.HEALTH_PATH)} did "
                f"not answer ({_e(doc['error'])}), read {ago(doc.get('read_at'), now)}</div>")
    cells = []
    for p in airflow_health.parts(doc):
        if p["status"] == "not reported":
            continue
        cls = "ok" if p["healthy"] else "gone"
        beat = f", heartbeat {ago(p['heartbeat_at'], now)}" if p["heartbeat_at"] else ""
        cells.append(f"<span class='part {cls}' data-part='{p['part']}' data-status='{_e(p['status'])}'>"
                     f"{p['part']}: {_e(p['status'])}{beat}</span>")
    return f"<div class='airflow'><b>Airflow</b>: {' '.join(cells)}</div>"




def sparkline(ts: Sequence[float], values: Sequence[float | None], *, top: float, now: float, span_s: float,
              label: str, width: int = 150, height: int = 28) -> str:
    """An SVG polyline over the last ``span_s``; gaps where a reading was unknown (never drawn as 0)."""
    if not top or top <= 0:
        return "<span class='nospark'>no history</span>"
    segs: list[list[str]] = []
    cur: list[str] = []
    for t, v in zip(ts, values):
        if t < now - span_s:
            continue
        if v is None:
            if cur:
                segs.append(cur)
            cur = []
            continue
        x = width * (1 - (now - t) / span_s)
        y = height - 1 - (height - 2) * min(float(v), top) / top
        cur.append(f"{x:.1f},{y:.1f}")
    if cur:
        segs.append(cur)
    lines = "".join(f"<polyline points='{' '.join(s)}'/>" if len(s) > 1 else
                    f"<circle cx='{s[0].split(',')[0]}' cy='{s[0].split(',')[1]}' r='1.5'/>" for s in segs)
    return (f"<svg class='spark' width='{width}' height='{height}' viewBox='0 0 {width} {height}' role='img' "
            f"aria-label='{_e(label)}'><title>{_e(label)}</title>{lines}</svg>")


def _process(p: GpuProcessDoc) -> str:
    who = f"{_cell(p.get('program'))} · user {_cell(p.get('user'))} · pid {_cell(p.get('pid'))}"
    mem = f" · {_cell(p.get('used_mib'), ' MiB')}"
    state = f" · state {_e(p['state'])}" if p.get("state") else ""
    if p.get("ours"):
        tag = f"<span class='ours'>ours: run {_e(p.get('run_id'))} · {_e(p.get('task') or p.get('role'))}</span>"
    else:
        tag = "<span class='foreign'>not eagleflow's</span>"
    return f"<li>{tag} {who}{mem}{state}</li>"


def _gpu_row(g: GpuEntry, doc: StatusDoc, now: float) -> str:
    held_since = (doc.get("held_since") or {}).get(g["uuid"])
    held = held_since is not None and is_held_idle(g, int(doc.get("held_threshold_mib") or 1024))
    hist = doc.get("history") or History(t=[], gpus={})
    series = (hist.get("gpus") or {}).get(g["uuid"]) or GpuSeries(mem=[], util=[])
    span = float(doc.get("retention_s") or 3600)
    mem_spark = sparkline(hist.get("t") or [], series.get("mem") or [], top=g.get("memory_total_mib") or 0, now=now,
                          span_s=span, label=f"GPU {g['index']} memory used over the last {duration(span)}")
    util_spark = sparkline(hist.get("t") or [], series.get("util") or [], top=100, now=now, span_s=span,
                           label=f"GPU {g['index']} utilisation over the last {duration(span)}")
    held_txt = (f"<div class='heldtxt'>holds memory at 0 % since {_utc(held_since)} "
                f"(held since {ago(held_since, now)})</div>" if held and held_since is not None else "")
    procs = "".join(_process(p) for p in g.get("processes") or []) or "<li class='none'>no compute process</li>"
    return (f"<tr class='gpu{' held' if held else ''}' data-uuid='{_e(g['uuid'])}'>"
            f"<td>{_cell(g.get('index'))}</td><td>{_cell(g.get('name'))}<div class='uuid'>{_e(g['uuid'])}</div>{held_txt}</td>"
            f"<td>{_cell(g.get('memory_used_mib'))} / {_cell(g.get('memory_total_mib'))} MiB<br>{mem_spark}</td>"
            f"<td>{_cell(g.get('utilization_pct'), ' %')}<br>{util_spark}</td>"
            f"<td>{_cell(g.get('temperature_c'), ' °C')}</td><td>{_cell(g.get('power_w'), ' W')}</td>"
            f"<td>{_cell(g.get('ecc_uncorrected'))}</td><td><ul class='procs'>{procs}</ul></td></tr>")


def _figure(v: Any, fmt: str) -> str | None:
    """A trainer's figure as text, None when the node gave none (never drawn as 0)."""
    return fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def training_line(t: TrainingDoc, now: float) -> str:
    """A run's training: step of steps, rate, ETA, the latest loss, acc_0 and acceptance length, last step ago."""
    step, total = int(t.get("step") or 0), int(t.get("total") or 0)
    pct = f" ({100.0 * step / total:.0f} %)" if total else ""
    eta = eta_of_training(t)
    figures = [f for f in (_figure(t.get("loss"), "loss {:.3f}"), _figure(t.get("acc_0"), "acc_0 {:.3f}"),
                           _figure(t.get("accept_length"), "acceptance length {:.2f}")) if f]
    rate = float(t.get("rate") or 0)
    bits = [f"step {step:,}/{total:,}{pct}", *figures]
    if rate > 0:
        bits.append(f"{rate:.2f} steps/s")
    if eta is not None:
        bits.append(f"ETA {duration(eta)}")
    state = str(t.get("state") or "?")
    return (f"<span class='training {_e(state)}' data-step='{step}' data-total='{total}'>training: "
            f"{_e(', '.join(bits))}; {_e(state)}, last step {ago(t.get('last_progress_at'), now)}</span>")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def store_line(st: StoreDoc) -> str:
    """A streaming run's store: its server running and answering (or what is down), and how much of its buffer it
    holds (a full buffer holds capture back: the trainer is not taking samples fast enough)."""
    label = str(st.get("label") or "store")
    alloc, buf = st.get("allocated_bytes"), st.get("buffer_bytes")
    if not st.get("ok"):
        state, what = "down", f"DOWN: {st.get('detail') or 'not running'}"
    elif st.get("answering") is False:
        state, what = "late", f"running, its master not answering ({st.get('detail') or ''})"
    else:
        state, what = "ok", "master and segment running"
    fill = ""
    if alloc is not None and buf:
        fill = f"; holds {_mib(alloc)} of its {_mib(buf)} buffer ({100.0 * alloc / buf:.0f} %)"
    elif buf:
        fill = f"; buffer {_mib(buf)}"
    return (f"<span class='store {state}' data-allocated='{'' if alloc is None else int(alloc)}' "
            f"data-buffer='{int(buf or 0)}'>store: {_e(label)}, {_e(what)}{_e(fill)}</span>")


def _activity(doc: StatusDoc, now: float) -> str:
    act = doc.get("activity")
    parts = []
    shards_of = (act.get("shards") if act else None) or {}
    training = (act.get("training") if act else None) or {}
    stores = (act.get("stores") if act else None) or {}
    for run_id in sorted(set(shards_of) | set(training) | set(stores)):
        shards = shards_of.get(run_id) or []
        cells = "".join(f"<span class='shard {_e(s.get('state'))}'>shard {int(s['shard'])}: {int(s['done'])}/"
                        f"{int(s['total'])}</span>" for s in shards)
        train = training_line(training[run_id], now) if run_id in training else ""
        store = store_line(stores[run_id]) if run_id in stores else ""
        parts.append(f"<div class='run' data-run='{_e(run_id)}'>run {_e(run_id)}: "
                     f"{cells or ('' if train or store else 'no shard started yet')}{train}{store}</div>")
    for inc in (act.get("incidents") if act else None) or []:
        if inc.get("outcome") == "open":
            parts.append(f"<div class='incident'>open incident {_e(inc.get('id'))}: {_e(inc.get('cause'))} "
                         f"(opened {ago(inc.get('opened_at'), now)})</div>")
    return "".join(parts)


def _node(doc: StatusDoc, now: float) -> str:
    name = _e(doc["node"])
    head = f"<h2>{name}</h2>"
    if doc.get("error"):
        since = doc.get("unreachable_since")
        status = (f"<p class='status unreachable'>unreachable ({_e(doc['error'])}) since {ago(since, now)}; "
                  f"last seen {ago(doc.get('last_seen'), now)}. Readings below are from then.</p>")
    elif not doc.get("has_gpu", True):
        status = f"<p class='status cpu'>CPU-only node (node.has_gpu: false); last seen {ago(doc.get('last_seen'), now)}</p>"
    else:
        status = f"<p class='status ok'>last seen {ago(doc.get('last_seen'), now)}</p>"
    gpus = doc.get("gpus") or []
    table = ""
    if gpus:
        table = ("<table class='gpus'><tr><th>GPU</th><th>model / UUID</th><th>memory</th><th>utilisation</th>"
                 "<th>temp</th><th>power</th><th>ECC</th><th>processes</th></tr>"
                 + "".join(_gpu_row(g, doc, now) for g in gpus) + "</table>")
    elif doc.get("has_gpu", True) and not doc.get("error"):
        table = "<p>no GPU listed by the driver</p>"
    cls = "node unreachable" if doc.get("error") else "node"
    return f"<section class='{cls}' data-node='{name}'>{head}{status}{_activity(doc, now)}{table}</section>"


def health_warnings(docs: list[dict[str, Any]], dag: HealthDagState | None, now: float) -> list[str]:
    """Why the page may be stale: gpu_node_health missing, paused, or not run within two intervals."""
    if dag is None:
        return [f"the {HEALTH_DAG_ID} DAG is not loaded in Airflow: nothing refreshes this page"]
    out = []
    if dag.get("is_paused"):
        out.append(f"{HEALTH_DAG_ID} is paused: these readings are not refreshed (unpause it in the DAG list)")
    interval = float(dag.get("interval_s") or max([float(d.get("interval_s") or 0) for d in docs] + [0]) or 300)
    last = max([float(d.get("checked_at") or 0) for d in docs] + [0])
    if not docs:
        out.append(f"no reading yet: {HEALTH_DAG_ID} has not finished a check")
    elif now - last > 2 * interval + 60:
        out.append(f"{HEALTH_DAG_ID} is late: its last check was {duration(now - last)} ago, "
                   f"it should run every {duration(interval)}")
    return out


def open_incidents(book: dict[str, dict[str, Any]] | None) -> list[dict[str, Any]]:
    """gpu_node_health's incidents a person is being mailed about (open ones, and notices still present)."""
    keep = ("id", "node", "kind", "subject", "state", "opened_at", "reminders", "next_reminder_at", "last_mail_at")
    return sorted(({k: r.get(k) for k in keep} for r in (book or {}).values() if r.get("state") in ("open", "notice")),
                  key=lambda r: float(r.get("opened_at") or 0))


def _incidents(book: dict[str, dict[str, Any]] | None, now: float) -> str:
    rows = open_incidents(book)
    if not rows:
        return "<p class='incidents none'>no open incident</p>"
    items = []
    for r in rows:
        mails = 1 + int(r.get("reminders") or 0)
        nxt = (f"; next reminder in {duration(float(r['next_reminder_at']) - now)}"
               if r.get("state") == "open" and r.get("next_reminder_at") else "")
        items.append(f"<li class='incident {_e(r.get('state'))}' data-node='{_e(r.get('node'))}' "
                     f"data-kind='{_e(r.get('kind'))}'>{_e(r.get('subject'))}: open since {ago(r.get('opened_at'), now)}"
                     f", mailed {mails} time(s){nxt}</li>")
    return f"<div class='incidents'><b>Open incidents ({len(rows)})</b><ul>{''.join(items)}</ul></div>"


def render_panel(docs: list[dict[str, Any]], *, dag: HealthDagState | None, now: float | None = None,
                 incidents: dict[str, dict[str, Any]] | None = None,
                 airflow: airflow_health.AirflowHealth | None = None) -> str:
    """``docs``: the status documents as ``StatusStore.all`` reads them back (each a ``StatusDoc``);
    ``airflow``: Airflow's health (its /api/v2/monitor/health answer, eagleflow.health.airflow_health)."""
    now = time.time() if now is None else now
    nodes = cast(list[StatusDoc], docs)
    warn = "".join(f"<p class='warning'>{_e(w)}</p>" for w in health_warnings(docs, dag, now))
    held = sum(1 for d in nodes for g in d.get("gpus") or []
               if g["uuid"] in (d.get("held_since") or {}) and not d.get("error"))
    summary = (f"<p class='summary' data-nodes='{len(docs)}' data-held='{held}'>{len(docs)} node(s); "
               f"{held} GPU(s) holding memory at 0 %; page read {time.strftime('%H:%M:%S UTC', time.gmtime(now))}</p>")
    return (warn + airflow_line(airflow, now) + summary + _incidents(incidents, now)
            + "".join(_node(d, now) for d in nodes))


_CSS = """
body{font-family:system-ui,sans-serif;margin:12px;color:#222}
h1{font-size:1.3em}h2{font-size:1.1em;margin:.2em 0}
table{border-collapse:collapse;margin:.4em 0}td,th{border:1px solid #ccc;padding:3px 6px;vertical-align:top;font-size:.9em}
.uuid{color:#777;font-size:.8em}.warning{background:#fff3cd;border:1px solid #e0b000;padding:6px}
tr.held{background:#ffe0e0}tr.held td:first-child{border-left:6px solid #d00}.heldtxt{color:#b00;font-weight:bold}
.unreachable .status{color:#b00;font-weight:bold}.cpu{color:#555}.ok{color:#2a7a2a}
.ours{background:#e3f2fd;padding:0 4px}.foreign{background:#ffd8a8;padding:0 4px;font-weight:bold}
ul.procs{margin:0;padding-left:1em}svg.spark{display:block;stroke:#1565c0;fill:#1565c0;stroke-width:1.2}
svg.spark polyline{fill:none}.shard{margin-right:.8em}.training{margin-left:.4em;color:#1565c0}.store{margin-left:.4em;color:#2e7d32}.store.down,.store.late{color:#b00}.incident{color:#b00}.node{margin-bottom:1.2em}
.airflow .part{margin-right:.8em}.part.ok{color:#2a7a2a}.part.gone,.airflow.down{color:#b00;font-weight:bold}
#conn{color:#b00}.incidents{border:1px solid #d00;padding:4px 8px;margin:.4em 0}.incidents.none{border:0;color:#2a7a2a}
"""

_JS = """
const REFRESH_MS = %d, PANEL_URL = %s;
function span(s){s=Math.max(0,Math.floor(s));if(s<120)return s+' s';if(s<7200)return Math.floor(s/60)+' min';
  return Math.floor(s/3600)+' h '+Math.floor(s%%3600/60)+' min';}
function tick(){const now=Date.now()/1000;document.querySelectorAll('.ago').forEach(e=>{
  e.textContent=span(now-parseFloat(e.dataset.ts))+' ago';});}
async function reload(){
  try{const r=await fetch(PANEL_URL,{credentials:'same-origin',cache:'no-store'});
    if(r.status===401||r.status===403){document.getElementById('conn').textContent=
      'not signed in to Airflow any more: reload the page to sign in';return;}
    if(!r.ok)throw new Error('HTTP '+r.status);
    document.getElementById('panel').innerHTML=await r.text();
    document.getElementById('conn').textContent='';
    document.body.dataset.refreshed=String(Date.now());
  }catch(err){document.getElementById('conn').textContent='could not refresh ('+err.message+'); retrying';}
  tick();}
setInterval(reload, REFRESH_MS);setInterval(tick, 1000);
"""


def page_shell(panel_html: str, *, refresh_s: float = 15, panel_url: str = "panel") -> str:
    return ("<!doctype html><html><head><meta charset='utf-8'><title>eagleflow GPU nodes</title>"
            f"<style>{_CSS}</style></head><body data-refreshed='0'><h1>eagleflow: GPU nodes</h1>"
            f"<p>Refreshes every {refresh_s:.0f} s from what {HEALTH_DAG_ID} stored. <span id='conn'></span></p>"
            f"<div id='panel'>{panel_html}</div><script>{_JS % (int(refresh_s * 1000), json.dumps(panel_url))}"
            "</script></body></html>")
