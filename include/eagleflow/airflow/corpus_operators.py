"""PLACEHOLDER until its issue lands: every class fails loudly at run time."""
from airflow.sdk.exceptions import AirflowFailException
from eagleflow.airflow.base import RunOperator


class PrepareCorpusOperator(RunOperator):
    def __init__(self, *, deferrable: bool = False, **kw):
        super().__init__(**kw)

    def run(self, ctx, context):
        raise AirflowFailException("PrepareCorpusOperator is not built yet")


class DeleteOldCachesOperator(RunOperator):
    def __init__(self, *, deferrable: bool = False, **kw):
        super().__init__(**kw)

    def run(self, ctx, context):
        raise AirflowFailException("DeleteOldCachesOperator is not built yet")


class CheckDiskOperator(RunOperator):
    def __init__(self, *, deferrable: bool = False, **kw):
        super().__init__(**kw)

    def run(self, ctx, context):
        raise AirflowFailException("CheckDiskOperator is not built yet")

