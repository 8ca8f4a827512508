"""Where commands run: LocalNode here, SSHNode over an Airflow SSH connection."""
from .base import (CommandResult, DetachedProcess, JobAlreadyRunning, Node, NodeAnswerError, NodeAnswerRefused,
                   NodeCommandFailed, NodeCommandTimeout, NodeError, NodeFileRefused, NodeUnreachable)
from .local import LocalNode
from .process_record import ProcessRecord, RecordStatus, StopResult
from .ssh import SSHNode

__all__ = ["CommandResult", "DetachedProcess", "JobAlreadyRunning", "Node", "NodeAnswerError", "NodeAnswerRefused",
           "NodeCommandFailed",
           "NodeCommandTimeout", "NodeError", "NodeFileRefused", "NodeUnreachable", "LocalNode", "ProcessRecord", "RecordStatus", "StopResult",
           "node_from_config"]


def node_from_config(cfg) -> Node:
    """LocalNode when ``node.conn_id`` is empty, else SSHNode over that Airflow connection."""
    if not cfg.node.conn_id:
        return LocalNode(name=cfg.node.name, python=cfg.node.python or None)
    return SSHNode(conn_id=cfg.node.conn_id, name=cfg.node.name, python=cfg.node.python or "python3")
