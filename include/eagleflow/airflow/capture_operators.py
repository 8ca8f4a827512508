"""PLACEHOLDER until its issue lands: every class fails loudly at run time."""
from airflow.sdk.exceptions import AirflowFailException
from eagleflow.airflow.base import RunOperator


class StartCaptureServerOperator(RunOperator):
    def __init__(self, *, deferrable: bool = False, **kw):
        super().__init__(**kw)

    def run(self, ctx, context):
        raise AirflowFailException("StartCaptureServerOperator is not built yet")


class CaptureServerReadySensor(RunOperator):
    def __init__(self, *, deferrable: bool = False, **kw):
        super().__init__(**kw)

    def run(self, ctx, context):
        raise AirflowFailException("CaptureServerReadySensor is not built yet")


class ExtractShardOperator(RunOperator):
    def __init__(self, *, shard: int, deferrable: bool = True, **kw):
        super().__init__(**kw)
        self.shard = shard

    def run(self, ctx, context):
        raise AirflowFailException("ExtractShardOperator is not built yet")


class StopCaptureServerOperator(RunOperator):
    def __init__(self, *, deferrable: bool = False, **kw):
        super().__init__(**kw)

    def run(self, ctx, context):
        raise AirflowFailException("StopCaptureServerOperator is not built yet")


class VerifyHiddenStatesOperator(RunOperator):
    def __init__(self, *, deferrable: bool = False, **kw):
        super().__init__(**kw)

    def run(self, ctx, context):
        raise AirflowFailException("VerifyHiddenStatesOperator is not built yet")

