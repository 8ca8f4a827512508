"""Operators that belong to the pipeline as a whole rather than one phase."""
from __future__ import annotations

import json

from airflow.sdk.exceptions import AirflowFailException

from eagleflow.airflow.base import RunOperator
from eagleflow.airflow.routing import routing_mismatches
from eagleflow.config import ConfigError, check_run_name
from eagleflow.phases import ShardKind
from eagleflow.preflight import PreflightReport
from eagleflow.fleet.assign import run_assignment


def unknown_conf_keys(conf: dict | None, params) -> list[str]:
    """Keys of a run's conf that are no Param of the DAG (a typo such as "shardz" would be ignored)."""
    return sorted(k for k in (conf or {}) if k not in params)


class WriteRunConfigOperator(RunOperator):
    """Fail fast on bad input, then write the config (file + Params), paths resolved, into the run dir on the node.

    Checked in seconds, without retry (AirflowFailException), each problem
    naming its field: unknown conf keys (listing the valid ones), the config
    and Params themselves, and on the node the target model directory, every
    source path, run_root and server.dump_dir writable, dump_dir's free space.

    It is the run's first task and freezes the config: every later task, trigger and callback reads
    what it wrote (run-config.json on the node, XCom), never the YAML again.
    """

    freezes_run_config = True

    def execute(self, context):
        run_name = (context.get("params") or {}).get("run_name")
        if run_name:
            try:
                check_run_name(run_name, "DAG Param run_name")
            except ConfigError as e:
                raise AirflowFailException(str(e)) from None
        dag_run = context.get("dag_run")
        conf = getattr(dag_run, "conf", None) or {}
        valid = sorted(self.dag.params.keys()) if self.dag is not None else []
        unknown = unknown_conf_keys(conf, valid)
        if unknown:
            raise AirflowFailException(f"unknown key(s) in the run's conf: {', '.join(map(repr, unknown))}; "
                                       f"the valid keys are: {', '.join(valid)}. Fix the spelling and trigger again")
        try:
            return super().execute(context)
        except ConfigError as e:   # the config file or a Param is wrong: a retry would read the same input
            raise AirflowFailException(str(e)) from None

    def run(self, ctx, context):
        mismatches = routing_mismatches(self.dag, ctx.cfg) if self.dag is not None else []
        if mismatches:
            raise AirflowFailException(
                "this run's config routes its node elsewhere than this DAG does (the DAG takes queue and pool "
                "from $EAGLEFLOW_CONFIG when it is parsed):\n" + "\n".join(f"  - {m}" for m in mismatches)
                + "\nTrigger it with a config for the node this DAG serves, or point $EAGLEFLOW_CONFIG at this "
                  "config for the DAG's processes")
        node = ctx.node
        check_inputs_on_node(ctx, self.log)
        path = ctx.write_run_config()
        self.log.info("run %s on node %s: config written to %s (run dir %s)", ctx.layout.run_id,
                      node.name, path, ctx.layout.run_dir)
        return {"run_dir": str(ctx.layout.run_dir), "run_config": path}


def check_inputs_on_node(ctx, log) -> None:
    """The node's preflight (target model, sources, run_root and dump_dir writable, free space), or the task
    fails at once naming each problem: a retry would find the same."""
    node = ctx.node
    report = node.run_json([node.python, "-m", "eagleflow.preflight", ctx.layout.run_id], PreflightReport,
                           input=json.dumps(ctx.cfg.model_dump(mode="json")), timeout=120)
    for line in report.checked:
        log.info("input OK on node %s: %s", node.name, line)
    if report.problems:
        raise AirflowFailException(
            f"the run's inputs are not usable on node {node.name} ({len(report.problems)} problem(s)); "
            "fix them and trigger again:\n" + "\n".join(f"  - {p.line()}" for p in report.problems))


def plan_node_shards(ctx, kind: ShardKind, log) -> list[int]:
    """This node's share of the phase's shards (eagleflow.fleet.assign): all of them on a single node, logged
    beside the whole plan."""
    plan = run_assignment(ctx.cfg, kind.phase)
    mine = plan.get(ctx.cfg.node.name, [])
    log.info("%s planned as %d shard(s); node %s takes %d: %s (whole plan: %s)", kind.noun,
             sum(len(v) for v in plan.values()), ctx.cfg.node.name, len(mine), mine, plan)
    return mine
