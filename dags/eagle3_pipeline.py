"""eagle3_pipeline: raw chat datasets to a trained EAGLE-3 draft model.

Wiring only; every task body lives in the installed ``eagleflow`` package.
Trigger it from the Airflow UI (the form below) or the REST API with a conf.
"""
from __future__ import annotations

from datetime import timedelta

from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG, Param

from eagleflow.airflow.alerts import pipeline_failure_callbacks
from eagleflow.airflow.approval_operators import ApprovePromotionOperator
from eagleflow.airflow.corpus_operators import CheckDiskOperator, DeleteOldCachesOperator, PrepareCorpusOperator
from eagleflow.airflow.gpu_operators import FreeGpusOperator, GpuIdleSensor
from eagleflow.airflow.held_out_operators import CaptureHeldOutOperator
from eagleflow.airflow.pipeline_operators import WriteRunConfigOperator
from eagleflow.airflow.report_operators import REPORT_TASK_ID, RunReportOperator
from eagleflow.airflow.fleet_operators import (PREPARE_TASK, PrepareNodeOperator, ReceiveCorpusOperator,
                                              ReleaseTakeoverServerOperator, TakeOverShardsOperator)
from eagleflow.airflow.reconcile_operators import RerunShardOperator
from eagleflow.airflow.routing import FleetNodeRoute, fleet_routing
from eagleflow.airflow.runtime import TRIGGER_PATH_PATTERN, allowed_node_conn_ids
from eagleflow.airflow.shard_operators import phase_tasks
from eagleflow.airflow.store_operators import ChooseTrainingStartOperator, StartStoreOperator, StopStoreOperator
from eagleflow.airflow.verify_operators import VerifyHiddenStatesOperator
from eagleflow.airflow.trigger_form import (FROM_CONFIG, config_switch, form_config_path, from_config, optional_choice,
                                            storage_choice)
from eagleflow.airflow.train_operators import EvaluateDraftOperator, ExportDraftOperator, TrainDraftOperator
from eagleflow.engines import names_for
from eagleflow.phases import EXTRACT, GENERATE, KINDS

EXT, GEN = KINDS[EXTRACT], KINDS[GENERATE]   # task ids of each sharded phase, from its descriptor

DOC = __doc__ + """

Phases: write the run config to the node; when generate.enabled, let the
target rewrite the assistant turns of the chosen sources (GPU gates, the
server in serving mode as a setup/teardown pair, generate_responses shards
under the stall watchdog; each record token-exact and faithful to tool calls);
merge, shuffle and tokenise the corpus; check the disk budget (optionally delete old caches); free the GPUs
and verify each is at its idle baseline; start the capture server (setup);
extract every shard under the stall watchdog, then the held-out records the
trainer scores itself on (capture_held_out); stop the server and free the
GPUs (teardowns: they run whatever the shards did); verify every stored
sample (it runs after a failed shard too, and fails the run naming the
shards and counts); check the GPUs idle; train the draft on the node only
on verified data; export it in the format SGLang serves; evaluate it against
the draft in service and promote it when it passes the gate (with
eval.approval, once a person approves it under Required Actions: a rejected
draft is not promoted, and the run report says who rejected it and why). Any
failure ends the run failed: nothing trains or exports on partial data.

A streaming run (the storage Param or stream.storage: mooncake, docs/streaming.md): start_store starts the
run's Mooncake store on the training node before any shard is planned; choose_training_start sends training
beside the extraction shards (train_from_stream) instead of behind verification (gpus_idle_after_capture, skipped),
the trainer drawing samples as they arrive; verify_hidden_states reads the trainer's exactly-once record; stop_store
stops the store however the run went. Offline (disk), start_store and stop_store do nothing and training waits
for verification as before.

A fleet (fleet.nodes in $EAGLEFLOW_CONFIG) gives each node a task group of its own (its queue and pool):
prepare_node (skips a node the run leaves out; probes shared storage), its generation shards (GPU gates, its
generation server; collect_generated copies them to the training node, where the corpus is prepared from
every node's), then receive_corpus (the corpus copied there off shared storage), the GPU gates, its capture
server, its share of the shards, and collect_shards (its verified shard files to the training node, which
verifies every shard of every node before it trains). Shards of either phase that a node left incomplete
(its gate refused, its server failed) are taken over by the training node once that node proves them free of
our workers: take_over_generated before the corpus, take_over_shards before verification.
"""

# The fleet's nodes (one without a fleet), each with its Celery queue and GPU pool and its place in the fleet,
# from $EAGLEFLOW_CONFIG: Airflow fixes them at parse time. The training node runs everything but the other
# nodes' capture.
FLEET = fleet_routing()
NODE = FLEET.training


def node_tasks(node: FleetNodeRoute):
    """One node's work (a task group per node in a fleet): its generation, then (after the corpus) its capture,
    each sharded phase wired by one ``phase_tasks`` call: GPU gates, its server as a setup/teardown pair, its
    share of the shards under the watch (the training node: also the held-out records after its extraction)
    and, off shared storage, their copy to the training node. Generation's tasks are no-ops when
    generate.enabled is off. Returns the tasks the DAG wires."""
    with node.task_group():
        prepare = PrepareNodeOperator(task_id=PREPARE_TASK) if node.grouped else None
        # whatever the node's generation did (all_done), its collection waits for the GPUs freed too: the
        # corpus then refuses an incomplete generation naming the shards and their node, and a node the run
        # leaves out skips without holding it up
        gen = phase_tasks(GEN, node, collect_after_teardown=True)
        receive = ReceiveCorpusOperator(task_id="receive_corpus", prepare_task_id=node.prefix + PREPARE_TASK) \
            if node.ships_to_training else None
        # the held-out records the trainer scores itself on (train.eval_every), apart from the training store
        held_out = (lambda: CaptureHeldOutOperator(task_id="capture_held_out", retries=2, pool=node.pool)) \
            if node.training else None
        ext = phase_tasks(EXT, node, after_shards=held_out)
        if prepare is not None:
            prepare >> gen.first
            prepare >> (receive or ext.first)   # a node the run leaves out skips its capture too
        if receive is not None:
            receive >> ext.first
    generated = [gen.collect] if gen.collect is not None else [gen.shards, gen.free_after]
    return {"first": prepare or gen.first, "generated": generated, "capture_first": receive or ext.first,
            "capture_shards": ext.shards,
            "held_out": ext.last if node.training else None, "free_after": ext.free_after,
            "collect": ext.collect, "plan_task_id": ext.plan_task_id}


with DAG(
    dag_id="eagle3_pipeline",
    description="EAGLE-3 draft: corpus, GPU gates, hidden-state capture under a stall watchdog, training, export",
    doc_md=DOC,
    schedule=None,
    catchup=False,
    max_active_runs=1,
    tags=["eagleflow", "eagle3", "gpu"],
    default_args={
        "owner": "eagleflow",
        "queue": NODE.queue,  # every task talks to the node: its Celery worker runs them
        "retries": 1,
        "retry_delay": timedelta(seconds=30),
        **pipeline_failure_callbacks(),
    },
    params={
        "config_path": Param(form_config_path(), type="string", title="Config file",
                             description="Pipeline config (YAML) on the Airflow machine, relative to the project "
                                         "root ($EAGLEFLOW_HOME), in one of the deployment's config folders "
                                         "($EAGLEFLOW_CONFIG_DIRS, default configs/); every field below left empty "
                                         "takes this file's value."),
        "run_name": Param(None, type=["null", "string"], pattern=r"^(?!\.\.?$)[A-Za-z0-9_.-]+$",
                          title="Run directory name",
                          description="Name of this run's directory under run_root (one plain name, not '.' or "
                                      "'..'). Empty: the Airflow run id."),
        "target_model": Param(None, type=["null", "string"], pattern=TRIGGER_PATH_PATTERN, title="Target model path",
                              description=from_config("Local path of the target model on the node (config, weights, "
                                                      "tokenizer): letters, digits and . _ - + / ~ only.",
                                                      "target_model")),
        "node_conn_id": optional_choice(allowed_node_conn_ids(), title="GPU node SSH connection",
                                        description="Airflow SSH connection id of the GPU node, one of those the "
                                                    "deployment allows ($EAGLEFLOW_NODE_CONN_IDS).",
                                        field="the node's node.conn_id"),
        "capture_backend": optional_choice(names_for("capture_server"), title="Capture backend",
                                           description="sglang or vllm on a GPU node; hf (transformers) on CPU or "
                                                       "for tiny models.", field="capture.backend"),
        "shards": Param(None, type=["null", "integer"], minimum=1, maximum=1024, title="Extraction shards",
                        description=from_config("Number of extraction shards (one worker each).", "capture.shards")),
        "force_free_gpus": Param(False, type="boolean", title="Force-free GPUs (off: as the config says)",
                                 description="On: also kill processes we did not start that hold the selected GPUs. "
                                             "GPU nodes are shared: refused unless the deployment allows it "
                                             "($EAGLEFLOW_ALLOW_FORCE_FREE); leave off unless you own the node. "
                                             f"Off: {FROM_CONFIG}, gpu.force_free (off unless the config sets it)."),
        "delete_old_caches": Param(False, type="boolean", title="Delete old caches (off: as the config says)",
                                   description="On: delete the old hidden-state caches listed in the config "
                                               "(only under disk.cache_root) before the disk check. "
                                               f"Off: {FROM_CONFIG}, disk.delete_old_caches."),
        "max_train_steps": Param(None, type=["null", "integer"], minimum=1, title="Training steps",
                                 description=from_config("Draft training steps.", "train.max_steps")),
        # disk (offline) or a streaming store (mooncake): the stores registry's names (eagleflow.stores.STORES)
        "storage": storage_choice(),
        "generate_enabled": config_switch(title="Regenerate with the target",
                                          description="Let the target rewrite the assistant turns of "
                                                      "generate.sources before tokenising: on or off for this run.",
                                          field="generate.enabled"),
        "generate_temperature": Param(None, type=["null", "number"], minimum=0, maximum=10,
                                      title="Generation temperature",
                                      description=from_config("0 = greedy.", "generate.temperature")),
        "generate_top_p": Param(None, type=["null", "number"], exclusiveMinimum=0, maximum=1,
                                title="Generation top-p",
                                description=from_config("Nucleus sampling's top-p.", "generate.top_p")),
        "generate_max_new_tokens": Param(None, type=["null", "integer"], minimum=1, maximum=131072,
                                         title="Max new tokens per turn",
                                         description=from_config("The target's answer per turn, at most.",
                                                                 "generate.max_new_tokens")),
        "generate_seed": Param(None, type=["null", "integer"], minimum=0, title="Generation seed",
                               description=from_config("Each turn's seed derives from it and the record id.",
                                                       "generate.seed")),
        "generate_reasoning": config_switch(title="Reasoning",
                                            description="Thinking on or off for thinking models (enable_thinking).",
                                            field="generate.reasoning"),
        "fleet_nodes": Param(None, type=["null", "array"], items={"type": "string", "enum": [n.name for n in FLEET]},
                             examples=[n.name for n in FLEET], title="Fleet nodes",
                             description=from_config("The GPU nodes this run spreads its shards over (in proportion "
                                                     "to their GPU slots); the training node always takes part.",
                                                     "all of fleet.nodes")),
        "alert_emails": Param(None, type=["null", "array"], items={"type": "string"}, title="Alert emails",
                              description=from_config("Who is mailed on a stall, a retry and a final failure, one "
                                                      "address per line.", "watchdog.alert_emails")),
    },
) as dag:
    write_config = WriteRunConfigOperator(task_id="write_run_config")
    # per node: generate_responses (the target, serving mode, rewrites the assistant turns; no-ops when
    # generate.enabled is off) behind GPU gates, its server stopped before the capture server starts; then
    # the capture. The corpus waits for every node's generation; it checks itself that each shard is complete
    nodes = {node.name: node_tasks(node) for node in FLEET}
    home = nodes[NODE.name]
    prepare_corpus = PrepareCorpusOperator(task_id="prepare_corpus",
                                           trigger_rule="none_failed" if FLEET.grouped else "all_success")
    delete_caches = DeleteOldCachesOperator(task_id="delete_old_caches")
    check_disk = CheckDiskOperator(task_id="check_disk")
    # all_done: a failed shard is reported by verification (shards, counts), which then fails the run
    verify = VerifyHiddenStatesOperator(task_id="verify_hidden_states", trigger_rule="all_done",
                                        plan_task_id=home["plan_task_id"])
    idle_after = GpuIdleSensor(task_id="gpus_idle_after_capture", pool=NODE.pool)
    # the run's hidden-state store (stream.storage): a streaming store's server started on the training node
    # before the capture workers put into it, stopped however the run went; both no-ops for the disk store
    start_store = StartStoreOperator(task_id="start_store")
    stop_store = StopStoreOperator(task_id="stop_store")
    # when training may start: a streaming run beside the extraction shards (train_from_stream), an offline
    # run behind verification (gpus_idle_after_capture); the path not taken is skipped at once
    train_from_stream = EmptyOperator(task_id="train_from_stream")
    # streaming, the capture server keeps its GPUs while training starts: the trainer's GPUs only are gated (the
    # config refuses a trainer on the server's GPUs: PipelineConfig._stream_trainer_beside_server)
    trainer_idle = GpuIdleSensor(task_id="trainer_gpus_idle", pool=NODE.pool, gpus="trainer")
    choose_start = ChooseTrainingStartOperator(task_id="choose_training_start", stream_task=train_from_stream.task_id,
                                               offline_task=idle_after.task_id)
    # either path: it never runs after a failed one (none_failed), and an offline run's only path is verified
    train = TrainDraftOperator(task_id="train_draft", pool=NODE.pool, trigger_rule="none_failed_min_one_success")
    export = ExportDraftOperator(task_id="export_draft")
    # the evaluation loads the target again (eval.device; eval.backend sglang: a server per configuration):
    # the same GPU gates as the servers before it, and its servers' recorded processes freed however it ends
    eval_free = FreeGpusOperator(task_id="free_gpus_before_evaluation")
    eval_idle = GpuIdleSensor(task_id="gpus_idle_before_evaluation", pool=NODE.pool)
    # the promoted-draft event comes from approve_promotion: at once when the gate alone promotes, after a
    # person's approval when eval.approval asks for one (Required Actions), never for a rejected draft
    evaluate = EvaluateDraftOperator(task_id="evaluate_draft", pool=NODE.pool, outlets=[])
    approve = ApprovePromotionOperator(task_id="approve_promotion")
    eval_free_after = FreeGpusOperator(task_id="free_gpus_after_evaluation")

    for tasks in nodes.values():
        write_config >> tasks["first"]
        tasks["generated"] >> prepare_corpus
    if FLEET.grouped:
        # generation shards another node left incomplete (its gate refused, its server failed), taken over by
        # the training node once that node proves them free of our workers, before the corpus needs them all;
        # a logged no-op when generate.enabled is off or nothing is missing
        take_gen = TakeOverShardsOperator(task_id=GEN.takeover_task, phase=GEN.phase, trigger_rule="all_done")
        take_gen_idle = GpuIdleSensor(task_id="gpus_idle_before_generation_takeover", pool=NODE.pool,
                                      phase=GEN.phase, guards=GEN.takeover_task)
        taken_gen = RerunShardOperator.partial(task_id="take_over_generated_shard", retries=2,
                                               pool=NODE.pool).expand(target=take_gen.output)
        release_gen = ReleaseTakeoverServerOperator(task_id="release_generation_takeover_server", phase=GEN.phase,
                                                    trigger_rule="all_done")
        for tasks in nodes.values():
            tasks["generated"] >> take_gen
        # the corpus checks itself that every generation shard is complete, naming any that is not
        take_gen >> take_gen_idle >> taken_gen >> release_gen >> prepare_corpus
    prepare_corpus >> delete_caches >> check_disk >> start_store
    for cap in nodes.values():
        check_disk >> cap["capture_first"]
        start_store >> dag.get_task(cap["plan_task_id"])   # no shard puts a sample before the store runs
        cap["capture_shards"] >> verify
        if cap["collect"] is not None:
            cap["collect"] >> verify
    if FLEET.grouped:
        # the shards another node left incomplete, taken over by the training node once that node proves
        # them free of our workers (fleet.take_over); the rest wait for their node
        take_over = TakeOverShardsOperator(task_id=EXT.takeover_task, phase=EXT.phase, trigger_rule="all_done")
        # the training node's GPUs checked idle again before the takeover's server (they were freed after
        # its own shards, and a shared node's GPUs may have been taken since)
        take_over_idle = GpuIdleSensor(task_id="gpus_idle_before_takeover", pool=NODE.pool,
                                       guards=EXT.takeover_task)
        taken = RerunShardOperator.partial(task_id="take_over_shard", retries=2,
                                           pool=NODE.pool).expand(target=take_over.output)
        release = ReleaseTakeoverServerOperator(task_id="release_takeover_server", phase=EXT.phase,
                                                trigger_rule="all_done")
        for cap in nodes.values():
            [cap["capture_shards"], cap["free_after"]] >> take_over
            if cap["collect"] is not None:
                cap["collect"] >> take_over
        take_over >> take_over_idle >> taken >> release >> verify
    # offline, training waits for verification too, so it never runs on partial or unverified data; streaming,
    # it starts once the capture is ready and the store runs, and verification reads its exactly-once record
    [home["free_after"], verify, home["held_out"]] >> idle_after >> train >> export >> eval_free >> eval_idle >> evaluate
    [start_store, dag.get_task(home["plan_task_id"])] >> choose_start >> [idle_after, train_from_stream]
    train_from_stream >> trainer_idle >> train
    # the store stopped once nothing uses it any more (the trainer and the verification that reads its record)
    [train, verify] >> stop_store
    evaluate >> eval_free_after.as_teardown(setups=eval_idle)
    evaluate >> approve
    # the run report, written however the run went (all done); as a teardown it never decides the
    # run's outcome: evaluate_draft and the other leaves do, so a failed run stays failed
    # a teardown of write_run_config: it runs however the run went once there is a run (a config); a run
    # whose config was refused has nothing to report and gets no second alert
    # after the approval too: the report shows who approved or rejected the draft, and why
    [evaluate, approve] >> RunReportOperator(task_id=REPORT_TASK_ID).as_teardown(setups=write_config)
