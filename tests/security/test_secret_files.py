"""Issue 26, break 2's last part: files with secrets that eagleflow writes are its user's only."""
from __future__ import annotations

import json
import os
import stat

from eagleflow.airflow.deploy import standalone
from eagleflow.airflow.deploy.home import airflow_env


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_standalone_state_and_the_admin_password_file_are_0600(tmp_path):
    home = tmp_path / "airflow_home"
    env = airflow_env(home)                      # a home eagleflow creates: 0700 (DB, passwords)
    assert env["AIRFLOW_HOME"] == str(home) and _mode(home) == 0o700
    sf = standalone.state_file(home)
    standalone._write_state(sf, {"pid": 1, "password": "s3cret", "token": "t"})
    assert _mode(sf) == 0o600 and json.loads(sf.read_text())["password"] == "s3cret"
    generated = home / "simple_auth_manager_passwords.json.generated"
    generated.write_text(json.dumps({"admin": "s3cret"}))
    generated.chmod(0o644)                       # as Airflow writes it
    assert standalone.admin_password(home) == "s3cret" and _mode(generated) == 0o600
