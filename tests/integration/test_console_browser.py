"""The operator's console in a real Chromium against `airflow standalone` (scheduler, triggerer, API server, UI).

As an operator would: sign in through Airflow's login page; open Browse -> GPU nodes; within one
health interval (gpu_node_health starts unpaused, every minute) the fake 8-GPU node shows its four
held GPUs highlighted, the CPU-only and the unreachable node are listed, no command line is on the
page, and the page refreshes itself; the stalled node's incident is mailed once over many checks and
once more when it is resolved; trigger eagle3_pipeline from the trigger form (no `null` in it), see the
GPU view show the training's step and loss on the pipeline's node while its `train_draft` runs, and see
the run succeed in the UI, with no failed run on a fresh deployment; the run waits for a person
(eval.approval: always): Approve clicked on its Required Actions page promotes the draft; open its run
report and the metrics; a second run, rejected on that page with a reason, keeps the draft in service
(promoted.json unchanged, the report names who and why); the incident mail's link opens the GPU view.
Screenshots go to the test's folder (and to docs/ with EAGLEFLOW_UPDATE_SCREENSHOTS=1).
"""
from __future__ import annotations

import json
import os
import shutil
import time
import re
import urllib.error
from pathlib import Path
from urllib.parse import quote

import pytest

from eagleflow.airflow.deploy import standalone
from tests.fixtures.api_server import rest, trigger_run, wait_for as api_wait_for
from tests.fixtures.browser import chromium  # noqa: F401  (fixture)
from tests.fixtures.console_nodes import HELD, STALLED_CMD, write_console_nodes
from tests.fixtures.gpu_scenarios import gpu, write_scenario
from tests.fixtures.pipeline_config import write_short_config
from tests.fixtures.smtp import SmtpSink, body_text

pytestmark = [pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
NO_COMMAND_LINE = ("--model-path", "sglang.launch_server", "sk-console-test", "/models/kimi")


def wait_for(what: str, check, timeout_s: float, every_s: float = 2.0):
    # any exception: the page is being replaced under us, look again
    return api_wait_for(what, check, timeout_s, every_s, retry_on=(Exception,))


def find(driver, by: str, selector: str, timeout_s: float = 90):
    """The first element matching, once the React UI has rendered it."""
    return wait_for(f"element {selector}", lambda: (driver.find_elements(by, selector) or [None])[0], timeout_s, 0.5)


def sign_in(driver, base: str, password: str) -> None:
    from selenium.webdriver.common.by import By
    driver.get(base + "/")
    wait_for("Airflow's login page", lambda: "/auth/login" in driver.current_url, 60)
    find(driver, By.NAME, "username").send_keys("admin")
    driver.find_element(By.NAME, "password").send_keys(password)
    driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait_for("signed in", lambda: "/auth/login" not in driver.current_url and driver.get_cookie("_token"), 60)


def check_gpu_view(driver, base: str, shots: Path, health_interval_s: float) -> float:
    """Checks the view; returns when the held GPUs were first seen highlighted (unix time)."""
    from selenium.webdriver.common.by import By
    driver.get(base + "/")
    find(driver, By.CSS_SELECTOR, "button[aria-label='Browse']").click()
    find(driver, By.XPATH, "//*[@role='menuitem'][normalize-space()='GPU nodes'] | //a[normalize-space()='GPU nodes']"
         ).click()  # the plugin's menu entry
    wait_for("the GPU view in its iframe", lambda: driver.find_elements(By.CSS_SELECTOR, "iframe[src*='eagleflow-gpu']"), 60)
    driver.switch_to.frame(driver.find_element(By.CSS_SELECTOR, "iframe[src*='eagleflow-gpu']"))
    # gpu_node_health runs unpaused from its creation: the held GPUs appear within one interval
    held = wait_for("4 held GPUs highlighted", lambda: [
        e.get_attribute("data-uuid") for e in driver.find_elements(By.CSS_SELECTOR, "tr.gpu.held")
        if e.get_attribute("data-uuid")] if len(driver.find_elements(By.CSS_SELECTOR, "tr.gpu.held")) == len(HELD)
        else None, health_interval_s + 120)
    seen_at = time.time()
    assert sorted(held) == [f"GPU-{i:08x}-1111-2222-3333-444455556666" for i in HELD]
    assert len(driver.find_elements(By.CSS_SELECTOR, "[data-node='gpu-node-stalled'] tr.gpu")) == 8
    wait_for("CPU-only and unreachable nodes listed", lambda: "CPU-only node" in driver.page_source
             and "unreachable (" in driver.page_source, health_interval_s + 60)
    text = driver.find_element(By.TAG_NAME, "body").text
    assert "held since" in text and "not eagleflow's" in text
    page = driver.page_source
    for arg in NO_COMMAND_LINE:
        assert arg not in page, f"command-line fragment {arg!r} on the GPU view"
    first = driver.find_element(By.TAG_NAME, "body").get_attribute("data-refreshed")
    wait_for("the page refreshes itself", lambda: driver.find_element(By.TAG_NAME, "body")
             .get_attribute("data-refreshed") not in (first, "0"), 30, 1)
    driver.switch_to.default_content()
    driver.save_screenshot(str(shots / "gpu-view.png"))
    return seen_at


def page_text_with(driver, *needles: str) -> str | None:
    """The page's visible text once it holds every needle; None before."""
    from selenium.webdriver.common.by import By
    text = driver.find_element(By.TAG_NAME, "body").text
    return text if all(n in text for n in needles) else None


def check_training_in_gpu_view(driver, base: str, token: str, run_id: str, run_name: str, node: str, total: int,
                               shot: Path) -> str:
    """While the run's train_draft runs, the GPU view (as the incident mail links it) shows its training line on the
    pipeline's node: step of steps and the latest loss, read by gpu_node_health from the trainer's heartbeat.
    train_draft runs while its task is running (starting the trainer) or deferred (the triggerer watching it)."""
    from selenium.webdriver.common.by import By
    runs = ("running", "deferred")
    state = wait_for("train_draft running", lambda: (
        "running" if task_state(base, token, run_id, "train_draft") in runs else
        run_state(base, token, run_id) if run_state(base, token, run_id) in ("success", "failed") else None), 900, 2)
    assert state == "running", f"the run ended {state} before train_draft ran"
    driver.get(base + "/plugin/eagleflow-gpu")
    driver.switch_to.frame(find(driver, By.CSS_SELECTOR, "iframe[src*='eagleflow-gpu']", 60))
    deadline = time.time() + 600
    line = None
    asked = 0.0
    while line is None and time.time() < deadline:
        if time.time() - asked > 20:
            # a check while the training runs, whatever its speed: the scheduled one a minute can fall before and
            # after a fast machine's whole training; one more run of the health DAG when none is queued or running
            asked = time.time()
            active = rest(base, "/api/v2/dags/gpu_node_health/dagRuns?state=queued&state=running", token)
            if not active["total_entries"]:
                trigger_run(base, token, "gpu_node_health", {"logical_date": None})
        try:
            spans = driver.find_elements(By.CSS_SELECTOR, f"[data-node='{node}'] [data-run='{run_name}'] span.training")
            line = next((e.text for e in spans if int(e.get_attribute("data-step") or 0) > 0
                         and "running" in (e.get_attribute("class") or "").split()), None)
        except Exception:   # the panel is being replaced by its refresh: look again
            line = None
        if line is None:
            # seen only while train_draft runs: its end (the trainer's pid record gone) ends the wait as a failure
            assert task_state(base, token, run_id, "train_draft") in runs, \
                "train_draft ended before the GPU view showed its training"
            time.sleep(1)
    assert line is not None, "the GPU view did not show the training within 600 s"
    still = task_state(base, token, run_id, "train_draft")
    driver.switch_to.default_content()
    driver.save_screenshot(str(shot))
    print(f"[console] GPU view during train_draft ({still}): {line}")
    assert still in runs, f"train_draft {still} when the training line was read"
    m = re.search(r"training: step (\d+)/([\d,]+) \(\d+ %\), loss (\d+\.\d{3})", line)
    assert m and 0 < int(m.group(1)) <= total and int(m.group(2).replace(",", "")) == total, line
    return line


def trigger_from_form(driver, base: str, run_name: str, shots: Path) -> None:
    from selenium.webdriver.common.by import By
    driver.get(base + "/dags/eagle3_pipeline")
    find(driver, By.CSS_SELECTOR, "button[aria-label='Trigger Dag']").click()
    name = find(driver, By.NAME, "element_run_name")
    name.send_keys(run_name)
    form = wait_for("the trigger form's fields", lambda: page_text_with(driver, "Config file", "Capture backend"),
                    30, 0.5)
    assert not re.search(r"\bnull\b", form), f"the trigger form shows null:\n{form}"
    driver.save_screenshot(str(shots / "trigger-form.png"))
    driver.find_elements(By.XPATH, "//button[normalize-space()='Trigger']")[-1].click()


def task_state(base: str, token: str, run_id: str, task_id: str) -> str | None:
    return rest(base, f"/api/v2/dags/eagle3_pipeline/dagRuns/{quote(run_id)}/taskInstances/{task_id}", token)["state"]


def run_state(base: str, token: str, run_id: str) -> str:
    return rest(base, f"/api/v2/dags/eagle3_pipeline/dagRuns/{quote(run_id)}", token)["state"]


def answer_in_ui(driver, base: str, token: str, run_id: str, option: str, reason: str, shot: Path) -> str:
    """A person's answer on approve_promotion's Required Actions page: the evaluation table read, a reason
    typed, Approve or Reject clicked. Returns the page's text as the person saw it."""
    from selenium.webdriver.common.by import By
    state = wait_for("approve_promotion waiting for a person", lambda: (
        "awaiting_input" if task_state(base, token, run_id, "approve_promotion") == "awaiting_input" else
        run_state(base, token, run_id) if run_state(base, token, run_id) in ("success", "failed") else None), 900, 3)
    assert state == "awaiting_input", f"the run ended {state} before asking for approval"
    driver.get(f"{base}/dags/eagle3_pipeline/runs/{quote(run_id, safe='')}/tasks/approve_promotion/required_actions")
    text = wait_for("the evaluation table on the Required Actions page",
                    lambda: page_text_with(driver, "acceptance length", option), 90, 1)
    find(driver, By.NAME, "element_reason").send_keys(reason)
    driver.save_screenshot(str(shot))
    # a person reads the table first: an answer within seconds of the task parking can reach Airflow 3.3 before
    # its executor reports the parked try, and the scheduler retries the task (approve_promotion then takes the
    # recorded answer: ApprovePromotionOperator._earlier_answer); this test clicks as a reader would
    time.sleep(10)
    find(driver, By.XPATH, f"//button[normalize-space()='{option}']").click()
    wait_for("the answer taken", lambda: task_state(base, token, run_id, "approve_promotion") != "awaiting_input",
             120, 2)
    return text


def open_incidents_shown(driver, base: str) -> list[str]:
    """The nodes whose open incidents the GPU view lists (its panel, as the page's refresh loads it)."""
    from selenium.webdriver.common.by import By
    driver.get(base + "/eagleflow-gpu/panel")
    return sorted(e.get_attribute("data-node") for e in driver.find_elements(By.CSS_SELECTOR, "li.incident.open"))


def check_incident_mails(smtp: SmtpSink, scenario: str, base_url: str, driver, base: str, pipeline_node: str) -> str:
    """The console's fake nodes' incidents, mailed and listed. The pipeline's own node is checked too (its training
    line on the GPU view); a finding there (a watch gone silent under load) is its own thread: not counted here."""
    def about(node: str):
        return [m for m in list(smtp.messages) if f" {node}" in m["Subject"]]

    def fake_nodes_open() -> list[str]:
        return [n for n in open_incidents_shown(driver, base) if n != pipeline_node]
    opened = smtp.wait_for(lambda m: "gpu-node-stalled: 4 GPUs hold 88 GiB each at 0 % for" in m["Subject"], 30)
    # at least two more checks (one a minute) of the same finding before counting
    time.sleep(max(0.0, smtp.received_at[smtp.messages.index(opened)] + 130 - time.time()))
    assert [m["Subject"] for m in about("gpu-node-stalled")] == [opened["Subject"]], "one incident, one mail"
    body = body_text(opened)
    assert base_url + "/plugin/eagleflow-gpu" in body
    for arg in NO_COMMAND_LINE:
        assert arg not in body, f"command-line fragment {arg!r} in the incident mail"
    # unreachable from the start: one mail once that lasted 60 s, none on later checks
    down = smtp.wait_for(lambda m: "gpu-node-gone: unreachable (" in m["Subject"], 150)
    assert down["Subject"] in ("[eagleflow] gpu-node-gone: unreachable (connection refused)",
                               "[eagleflow] gpu-node-gone: unreachable (cannot connect)")
    assert fake_nodes_open() == ["gpu-node-gone", "gpu-node-stalled"]
    write_scenario(scenario, {"gpus": [gpu(i) for i in range(8)], "processes": []})   # someone freed the GPUs
    resolved = smtp.wait_for(lambda m: m["Subject"].startswith("[eagleflow] resolved: gpu-node-stalled"), 150)
    assert fake_nodes_open() == ["gpu-node-gone"]
    assert resolved["In-Reply-To"] == opened["Message-ID"]
    assert len(about("gpu-node-stalled")) == 2 and len(about("gpu-node-gone")) == 1
    print(f"[console] incident mails: {[m['Subject'] for m in smtp.messages]}")
    assert not [m for m in about(pipeline_node) if "held" in m["Subject"] or "unreachable" in m["Subject"]], \
        "the pipeline's CPU-only node has no GPU to hold and is local: " + str([m["Subject"] for m in smtp.messages])
    return body


@pytest.mark.timeout(2100)
def test_operator_console_in_a_real_browser(tmp_path, demo_assets, chromium):  # noqa: F811
    from selenium.webdriver.common.by import By
    shots = tmp_path / "screenshots"
    shots.mkdir()
    nodes = write_console_nodes(tmp_path / "nodes", alert_emails=["oncall@example.test"], smtp_conn_id="smtp_test")
    # a person approves each promotion; the second run's draft passes the gate against the first whatever its
    # figures (tolerance), so that a person, not the gate, keeps the draft in service
    # training long enough that a gpu_node_health check (every minute) reads the trainer's heartbeat while it runs
    # (about 1-2 s a step on a loaded CPU); checkpoints sparse so that steps, not saves, fill that time
    train_steps = 300
    cfg = write_short_config(tmp_path, demo_assets, eval={"approval": "always", "tolerance": 10.0},
                             train={"max_steps": train_steps, "checkpoint_every": 50})
    home, port = tmp_path / "airflow_home", standalone.free_port()
    smtp = SmtpSink().__enter__()   # a real SMTP server for gpu_node_health's incident mails
    # the pipeline's node among the checked ones: the GPU view's training line comes from its check
    env = {**nodes["env"], "EAGLEFLOW_HEALTH_CONFIGS": os.pathsep.join([*nodes["configs"], str(cfg)]),
           "EAGLEFLOW_CONFIG": str(cfg), "EAGLEFLOW_GPU_HEALTH_EVERY_MIN": "1", "EAGLEFLOW_GPU_VIEW_REFRESH_S": "5",
           "EAGLEFLOW_GPU_HELD_WINDOW_S": "30", "EAGLEFLOW_GPU_UNREACHABLE_AFTER_S": "60", **smtp.airflow_conn_env("smtp_test")}
    info = None
    try:
        info = standalone.start(home, port, wait_s=300, extra_env=env)
        up_at = time.time()
        # the deployment a user starts with `make airflow` (this test is also the standalone test)
        assert info["password"], "standalone did not generate an admin password"
        assert os.stat(home / "standalone.json").st_mode & 0o077 == 0, "standalone.json (the password) is not 0600"
        base = f"http://127.0.0.1:{port}"
        with pytest.raises(urllib.error.HTTPError) as e:  # no login, no GPU data
            rest(base, "/eagleflow-gpu/api/status")
        assert e.value.code == 401
        sign_in(chromium, base, info["password"])
        # a fresh deployment: its first gpu_node_health run (unpaused on creation, due at once) ends before any
        # finding can be made (held 30 s, unreachable 60 s) and nothing has failed; a later check fails by
        # design once it finds incidents (HealthIncidentsOpen), so this is looked at now
        token = rest(base, "/auth/token", method="POST",
                     body={"username": "admin", "password": info["password"]})["access_token"]
        first = wait_for("the first health check done", lambda: [r for r in rest(
            base, "/api/v2/dags/gpu_node_health/dagRuns?order_by=start_date", token)["dag_runs"]
            if r["state"] in ("success", "failed")][:1], 120, 1)[0]
        failed = rest(base, "/api/v2/dags/~/dagRuns?state=failed", token)
        assert first["state"] == "success" and failed["total_entries"] == 0, \
            [(r["dag_id"], r["dag_run_id"]) for r in failed["dag_runs"]]
        chromium.get(base + "/")
        time.sleep(3)   # the dashboard's counts load after the page
        chromium.save_screenshot(str(shots / "home.png"))
        seen_at = check_gpu_view(chromium, base, shots, health_interval_s=60)
        print(f"[console] held GPUs highlighted {seen_at - up_at:.0f} s after the API server answered "
              "(gpu_node_health every 60 s, unpaused on creation)")

        trigger_from_form(chromium, base, "browser_run", shots)
        runs = wait_for("the run the form created", lambda: rest(
            base, "/api/v2/dags/eagle3_pipeline/dagRuns", token)["dag_runs"], 60)
        run_id = runs[0]["dag_run_id"]
        assert rest(base, "/api/v2/dags/eagle3_pipeline", token)["is_paused"] is False  # the form unpaused it
        check_training_in_gpu_view(chromium, base, token, run_id, "browser_run", "local", train_steps,
                                   shots / "gpu-view-training.png")
        # eval.approval: always: the draft waits for a person, who approves it in the UI
        promoted = tmp_path / "runs" / "promoted.json"
        seen = answer_in_ui(chromium, base, token, run_id, "Approve", "first draft, nothing in service",
                            shots / "approval.png")
        assert "Promote the draft of run browser_run?" in seen and "3/1/4" in seen and "held_out" in seen, seen
        state = wait_for("the run to finish", lambda: (s := run_state(base, token, run_id)) in ("success", "failed")
                         and s, 900, 5)
        tis = rest(base, f"/api/v2/dags/eagle3_pipeline/dagRuns/{run_id}/taskInstances", token)["task_instances"]
        summary = {(t["task_id"], t.get("map_index")): t["state"] for t in tis}
        assert state == "success", summary
        assert summary[("approve_promotion", -1)] == "success", summary
        in_service = promoted.read_text()
        assert json.loads(in_service)["draft"] == str(tmp_path / "runs" / "browser_run" / "draft" / "export")
        # both shards of the short config extracted, each once (what the REST-only standalone test checked)
        assert summary[("extract_shard", 0)] == summary[("extract_shard", 1)] == "success", summary
        assert ("extract_shard", 2) not in summary, summary
        chromium.get(f"{base}/dags/eagle3_pipeline/runs/{run_id}")
        wait_for("the UI shows the run succeeded", lambda: "success" in chromium.find_element(By.TAG_NAME, "body")
                 .text.lower(), 90)
        chromium.save_screenshot(str(shots / "pipeline-run.png"))

        chromium.get(f"{base}/eagleflow-gpu/report/eagle3_pipeline/{run_id}")  # the run_report task's link
        report = chromium.find_element(By.TAG_NAME, "body").text
        assert "samples stored per shard" in report and "training loss" in report
        assert "--speculative-algorithm EAGLE3" in report and "browser_run/draft/export" in report
        assert "approved by admin" in report and "first draft, nothing in service" in report, report
        chromium.save_screenshot(str(shots / "run-report.png"))
        assert (tmp_path / "runs" / "browser_run" / "report.html").is_file()

        chromium.get(f"{base}/eagleflow-gpu/metrics")  # the UI's cookie authenticates a scrape from the browser
        metrics = chromium.find_element(By.TAG_NAME, "body").text
        assert 'DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-00000000-1111-2222-3333-444455556666"' in metrics
        assert 'Hostname="gpu-node-stalled"} 90000' in metrics and STALLED_CMD not in metrics

        # the stalled node, checked every minute all along: exactly one mail, then one when it is resolved
        mail = check_incident_mails(smtp, nodes["scenario"], f"http://localhost:{port}", chromium, base, "local")

        # a second run, its draft rejected in the UI: the draft in service stays
        second = trigger_run(base, token, "eagle3_pipeline",
                             {"logical_date": None, "conf": {"run_name": "browser_reject", "max_train_steps": 12}}
                             )["dag_run_id"]   # its training is not looked at: short
        seen = answer_in_ui(chromium, base, token, second, "Reject", "keep the one in service",
                            shots / "rejection.png")
        assert str(tmp_path / "runs" / "browser_run" / "draft" / "export") in seen, seen   # against it
        state = wait_for("the second run to finish", lambda: (s := run_state(base, token, second)) in
                         ("success", "failed") and s, 600, 5)
        assert state == "success" and task_state(base, token, second, "approve_promotion") == "skipped"
        assert promoted.read_text() == in_service, "a rejected draft was promoted"
        chromium.get(f"{base}/eagleflow-gpu/report/eagle3_pipeline/{second}")
        report = chromium.find_element(By.TAG_NAME, "body").text
        assert "rejected by admin" in report and "keep the one in service" in report, report
        chromium.save_screenshot(str(shots / "run-report-rejected.png"))

        # the incident mail's link, opened as the person woken by it would: the GPU view with the stalled node
        link = re.search(r"http://localhost:\d+/plugin/eagleflow-gpu[^\s\"'<>)]*", mail).group(0)
        sign_in(chromium, f"http://localhost:{port}", info["password"])   # the mail's host: its own sign-in
        chromium.get(link)
        frame = find(chromium, By.CSS_SELECTOR, "iframe[src*='eagleflow-gpu']", 60)
        chromium.switch_to.frame(frame)
        find(chromium, By.CSS_SELECTOR, "[data-node='gpu-node-stalled']", 60)
        chromium.switch_to.default_content()
        chromium.save_screenshot(str(shots / "mail-link.png"))
    finally:
        smtp.__exit__(None, None, None)
        stopped = standalone.stop(home, grace_s=20)
        if os.environ.get("EAGLEFLOW_UPDATE_SCREENSHOTS") == "1":
            for p in shots.glob("*.png"):
                shutil.copy(p, REPO / "docs" / f"console-{p.name}")
    assert stopped and info is not None and not standalone._group_alive(info["pgid"])
