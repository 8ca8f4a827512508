"""PLACEHOLDER until its issue lands: every class fails loudly at run time."""
from airflow.sdk.exceptions import AirflowFailException
from eagleflow.airflow.base import RunOperator


class TrainDraftOperator(RunOperator):
    def __init__(self, *, deferrable: bool = False, **kw):
        super().__init__(**kw)

    def run(self, ctx, context):
        raise AirflowFailException("TrainDraftOperator is not built yet")


class ExportDraftOperator(RunOperator):
    def __init__(self, *, deferrable: bool = False, **kw):
        super().__init__(**kw)

    def run(self, ctx, context):
        raise AirflowFailException("ExportDraftOperator is not built yet")

