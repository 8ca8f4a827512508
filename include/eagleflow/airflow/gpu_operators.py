"""PLACEHOLDER until its issue lands: every class fails loudly at run time."""
from airflow.sdk.exceptions import AirflowFailException
from eagleflow.airflow.base import RunOperator


class FreeGpusOperator(RunOperator):
    def __init__(self, *, deferrable: bool = False, **kw):
        super().__init__(**kw)

    def run(self, ctx, context):
        raise AirflowFailException("FreeGpusOperator is not built yet")


class GpuIdleSensor(RunOperator):
    def __init__(self, *, deferrable: bool = False, **kw):
        super().__init__(**kw)

    def run(self, ctx, context):
        raise AirflowFailException("GpuIdleSensor is not built yet")

