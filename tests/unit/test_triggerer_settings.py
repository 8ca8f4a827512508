"""The deployment's triggerer settings (issue 52 item 7): a killed triggerer's watches are handed to the restarted
one within a minute, in `make airflow` and in docker compose alike (tests/unit/test_docker_compose.py holds compose
to ``scaleout.celery_env``; tests/integration/test_triggerer_resume.py measures the hand-over for real)."""
from eagleflow.airflow.deploy import standalone
from eagleflow.airflow.deploy.home import TRIGGERER_SETTINGS, WATCH_RESUME_BOUND_S
from eagleflow.airflow.deploy.scaleout import celery_env


def test_the_deployment_hands_a_dead_triggerers_watches_over_within_a_minute(monkeypatch, tmp_path):
    for k in TRIGGERER_SETTINGS:
        monkeypatch.delenv(k, raising=False)
    env = standalone.standalone_env(tmp_path / "airflow_home", 8080)
    compose = celery_env(sql_alchemy_conn="x", broker_url="x", result_backend="x", execution_api_url="x")
    for k, v in TRIGGERER_SETTINGS.items():
        assert env[k] == v and compose[k] == v, k
    heartbeat = float(TRIGGERER_SETTINGS["AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC"])
    threshold = float(TRIGGERER_SETTINGS["AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD"])
    # a loaded triggerer may miss a few beats without being taken for dead; the hand-over leaves most of the
    # minute for the new triggerer's start and the first look
    assert threshold >= 4 * heartbeat and threshold <= WATCH_RESUME_BOUND_S / 3
