"""Operators that belong to the pipeline as a whole rather than one phase."""
from __future__ import annotations

from eagleflow.airflow.base import RunOperator


class WriteRunConfigOperator(RunOperator):
    """Validate the config (file + Params) and write it, paths resolved, into the run dir on the node."""

    def run(self, ctx, context):
        path = ctx.write_run_config()
        self.log.info("run %s on node %s: config written to %s (run dir %s)", ctx.layout.run_id,
                      ctx.node.name, path, ctx.layout.run_dir)
        return {"run_dir": str(ctx.layout.run_dir), "run_config": path}


class PlanShardsOperator(RunOperator):
    """The shard numbers that ``extract_shard`` is mapped over."""

    def run(self, ctx, context):
        n = ctx.cfg.capture.shards
        self.log.info("extraction planned as %d shard(s)", n)
        return list(range(n))
