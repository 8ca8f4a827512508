"""The trigger form's alert_emails: one plain address per entry, in the deployment's mail domains."""
import pytest

from eagleflow.airflow.runtime import alert_domains, checked_alert_emails
from eagleflow.config import ConfigError

CONFIG = ["ml-oncall@corp.example", "lead@Research.example"]


def test_domains_come_from_the_deployment_else_from_the_configs_recipients(monkeypatch):
    monkeypatch.delenv("EAGLEFLOW_ALERT_DOMAINS", raising=False)
    assert alert_domains(CONFIG) == ["corp.example", "research.example"]
    assert alert_domains([]) == []
    monkeypatch.setenv("EAGLEFLOW_ALERT_DOMAINS", " ml.example.com, Ops.Example.com ")
    assert alert_domains(CONFIG) == ["ml.example.com", "ops.example.com"]


def test_addresses_in_those_domains_pass_others_are_refused_naming_the_way_out(monkeypatch):
    monkeypatch.delenv("EAGLEFLOW_ALERT_DOMAINS", raising=False)
    assert checked_alert_emails([" me@corp.example", "x@RESEARCH.example"], CONFIG) == \
        ["me@corp.example", "x@RESEARCH.example"]
    with pytest.raises(ConfigError, match=r"'a@evil\.example' is refused.*corp\.example, research\.example"):
        checked_alert_emails(["a@evil.example"], CONFIG)
    with pytest.raises(ConfigError, match=r"'a@evil\.example' is refused: .*\(none;"):
        checked_alert_emails(["a@evil.example"], [])      # no config recipients, no deployment list: none


@pytest.mark.parametrize("bad", ["me@corp.example, a@evil.example", "me@corp.example\r\nBcc: a@evil.example",
                                 "Me <me@corp.example>", "me@corp", "@corp.example", "me@corp.example.", ""])
def test_one_plain_address_per_entry(bad, monkeypatch):
    monkeypatch.delenv("EAGLEFLOW_ALERT_DOMAINS", raising=False)
    with pytest.raises(ConfigError, match="not one plain mail address"):
        checked_alert_emails([bad], CONFIG)


def test_not_a_list_is_refused():
    with pytest.raises(ConfigError, match="expected a list"):
        checked_alert_emails("me@corp.example", CONFIG)
