"""What every eagleflow operator shares: its run's config, layout and node."""
from __future__ import annotations

from airflow.sdk import BaseOperator

from eagleflow.airflow.runtime import RunContext


class RunOperator(BaseOperator):
    """An operator of the eagle3 pipeline. Subclasses implement ``run(ctx, context)``."""

    ui_color = "#e8f1fb"

    def execute(self, context):
        ctx = RunContext.from_airflow(context)
        try:
            return self.run(ctx, context)
        finally:
            ctx.close()

    def run(self, ctx: RunContext, context):  # pragma: no cover - abstract
        raise NotImplementedError
