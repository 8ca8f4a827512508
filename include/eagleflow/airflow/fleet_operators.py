"""The tasks a fleet node's task group adds around its generation and capture: prepare the node, receive the
corpus, collect its shards.

``prepare_node`` (first of the group, right after ``write_run_config``): skips a node the run does not use
or gives no shards of either phase; checks the run's inputs on the node (the target model and the
generation sources at the config's paths: they are not copied); writes the node's view of the frozen
config there (its own file, so nodes that share a run root never read each other's); writes a probe file
with a fresh token in the node's run dir and reads it back on the training node: found, the run roots are
one filesystem and nothing moves; not found, files are copied (``eagleflow.fleet.transfer``, resumable).
``fleet.storage: shared`` fails a run whose probe is not found, ``copy`` copies whatever the probe says.

``collect_generated`` (after the node's generation shards): copies each of its generation shard folders to
the training node, where ``prepare_corpus`` reads every node's generated records. ``receive_corpus``
(after ``check_disk``): copies the corpus to the node before its extraction shards; it skips the node's
capture when the node has no extraction shard.

``collect_shards`` (after the node's shards, whatever they did): copies each of the node's shard folders
to the training node, files before the manifest, each checked against the source's digest. Verification
on the training node (``verify_hidden_states``) then gates training over every shard of every node.

``take_over_shards`` (on the training node, after every node's group): a shard another node left
incomplete on the training node is handed over to it once that node proves it free of our workers
(``eagleflow reconcile hand-over`` there: reachable, the shard's worker lock taken, no live worker; its
worker refuses the shard from then on). The mapped ``take_over_shard`` tasks extract those on the
training node (``reconcile claim --taken-from``) under the same watch, and ``release_takeover_server``
stops the capture server they started. An unreachable node or a held lock keeps its shards: they wait
for their node, and verification fails the run naming them. Generation shards the same way, before the
corpus (``take_over_generated``, ``take_over_generated_shard``, ``release_generation_takeover_server``):
a node that failed its generation gate no longer fails the corpus when it can prove its shards free.
``collect_shards`` and ``collect_generated`` never copy a shard the node handed over: the training node
completes it in its own run dir, and the node's partial copy would overwrite it.
"""
from __future__ import annotations

import secrets

from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from eagleflow.airflow.base import RunOperator
from eagleflow.airflow.pipeline_operators import check_inputs_on_node
from eagleflow.fleet.assign import shards_of
from eagleflow.nodes.base import NodeError
from eagleflow.phases import EXTRACT, GENERATE, ShardKind, kind_of
from eagleflow.protocol import ClaimAnswer, HandOverAnswer, ShardStates, one_line
from eagleflow.fleet.takeover import hand_over_mark, mark_of
from eagleflow.fleet.transfer import copy_dir
from eagleflow.stores import store_for

PREPARE_TASK = "prepare_node"


def handed_over_on_node(ctx, shard: int, kind: ShardKind) -> str | None:
    """The fleet node this run's node handed ``shard`` of the phase over to (its mark, read on the node), or
    None while the shard is this node's (always outside a fleet: nothing is handed over there)."""
    if not ctx.cfg.is_fleet:
        return None
    text = ctx.node.read_text(str(hand_over_mark(ctx.layout, shard, kind.phase)))
    return None if text is None else one_line(str(mark_of(text).get("to")))   # the node's text: logs, messages


def skip_if_handed_over(ctx, shard: int, kind: ShardKind) -> None:
    """A shard task of a node's group run again after its node handed the shard over: it skips, saying where
    the shard went (its worker would refuse it anyway: ``fleet.takeover.refuse_if_handed_over``)."""
    taken_by = handed_over_on_node(ctx, shard, kind)
    if taken_by is not None:
        raise AirflowSkipException(f"{kind.phase} shard {shard} of run {ctx.layout.run_id}: node "
                                   f"{ctx.cfg.node.name} handed it over to {taken_by}, which works on it (see "
                                   f"{kind.takeover_task}); nothing to do here")


def node_in_use(cfg, name: str) -> bool:
    return name in [n.name for n in cfg.nodes_in_use()]


class PrepareNodeOperator(RunOperator):
    """A fleet node ready for its shards, or skipped (its whole group with it) when the run leaves it out."""

    def run(self, ctx, context):
        cfg, name = ctx.cfg, ctx.cfg.node.name
        training = cfg.fleet.training_node or name
        if not node_in_use(cfg, name):
            raise AirflowSkipException(f"node {name} is not among this run's nodes (fleet_nodes "
                                       f"{cfg.fleet.use}): its group skips")
        shards, generate = shards_of(cfg, name), shards_of(cfg, name, GENERATE)
        if not shards and not generate and name != training:
            raise AirflowSkipException(f"node {name} gets none of the run's {cfg.capture.shards} shard(s) "
                                       f"(GPU slots {[(n.name, n.gpu_slots) for n in cfg.nodes_in_use()]})")
        ready = {"node": name, "shared": True, "shards": shards, "generate_shards": generate}
        if name == training:   # write_run_config checked its inputs and wrote its config already
            return ready
        check_inputs_on_node(ctx, self.log)
        ctx.write_run_config()
        home = ctx.for_node(training)
        try:
            shared = self._probe(ctx, home)
        finally:
            home.close()
        if cfg.fleet.storage == "shared" and not shared:
            raise AirflowFailException(
                f"fleet.storage is 'shared', but the probe node {name} wrote in its run dir "
                f"({ctx.layout.fleet_probe_dir}) is not in the training node {training}'s run dir "
                f"({home.layout.fleet_probe_dir}): the run roots are not one filesystem. Mount the same "
                "storage at both run roots, or set fleet.storage to auto or copy")
        shared = shared and cfg.fleet.storage != "copy"
        if not shared and shards and store_for(cfg.stream.storage).streaming:
            # the trainer finds each sample through its shard's manifest in the training node's run dir while
            # capture runs; a manifest copied only after the node's shards would leave the trainer blind to them
            # and capture waiting on a full buffer: manifests relayed during capture are not built
            raise AirflowFailException(
                f"stream.storage is {cfg.stream.storage!r} (streaming), but node {name}'s run root is not the "
                f"training node {training}'s (fleet.storage {cfg.fleet.storage!r}): the "
                "trainer reads every shard's manifest in its own run dir while capture runs. Mount one filesystem "
                "at every node's run root (fleet.storage: shared), or use stream.storage disk")
        self.log.info("node %s ready: extraction shard(s) %s, generation shard(s) %s; storage %s", name, shards,
                      generate, "shared with the training node" if shared else
                      f"its own (the corpus copied here, its shards to {training})")
        return {**ready, "shared": shared}

    def _probe(self, ctx, home) -> bool:
        """Whether a token written in this node's run dir is read in the training node's run dir."""
        token = secrets.token_hex(16)
        probe = f"{ctx.cfg.node.name}.token"
        ctx.node.write_text(str(ctx.layout.fleet_probe_dir / probe), token)
        seen = home.node.read_text(str(home.layout.fleet_probe_dir / probe))
        self.log.info("storage probe: wrote %s on %s, read %r on %s", ctx.layout.fleet_probe_dir / probe,
                      ctx.node.name, seen, home.node.name)
        return (seen or "").strip() == token


def _prepared(context, task_id: str, name: str, what: str) -> dict:
    """What the node's prepare_node returned, or this task skips (the node was not prepared)."""
    ready = context["ti"].xcom_pull(task_ids=task_id)
    if not ready:
        raise AirflowSkipException(f"node {name} was not prepared ({task_id} did not succeed): {what}")
    return ready


class ReceiveCorpusOperator(RunOperator):
    """The corpus copied to the node before its extraction shards (nothing on shared storage); skips the node's
    capture when it has no extraction shard."""

    def __init__(self, *, prepare_task_id: str = PREPARE_TASK, **kw):
        super().__init__(**kw)
        self.prepare_task_id = prepare_task_id

    def run(self, ctx, context):
        name = ctx.cfg.node.name
        ready = _prepared(context, self.prepare_task_id, name, "no corpus for it")
        if not ready.get("shards"):
            raise AirflowSkipException(f"node {name} extracts none of the run's {ctx.cfg.capture.shards} shard(s): "
                                       "its capture skips")
        if ready.get("shared"):
            self.log.info("node %s shares the training node's storage: the corpus is already there", name)
            return {"node": name, "copied": 0}
        home = ctx.for_node(ctx.cfg.fleet.training_node)
        try:
            report = copy_dir(home.node, str(home.layout.corpus_dir), ctx.node, str(ctx.layout.corpus_dir),
                              log=self.log.info)
        finally:
            home.close()
        self.log.info("corpus copied %s -> %s: %s", home.node.name, name, report)
        return {"node": name, "copied": report.files_copied}


def _phase(phase: str) -> str:
    return kind_of(phase).phase   # refuses an unknown phase, naming the known ones


class CollectShardsOperator(RunOperator):
    """Copies the node's shard folders of one phase (extract: hidden states; generate: generated records) to
    the training node (nothing on shared storage); resumable."""

    def __init__(self, *, prepare_task_id: str = PREPARE_TASK, phase: str = EXTRACT, **kw):
        super().__init__(**kw)
        self.prepare_task_id, self.phase = prepare_task_id, _phase(phase)

    def run(self, ctx, context):
        name = ctx.cfg.node.name
        ready = _prepared(context, self.prepare_task_id, name, "nothing of it to collect")
        if ready.get("shared"):
            self.log.info("node %s shares the training node's storage: its shards are already there", name)
            return {"node": name, "copied": 0}
        kind = kind_of(self.phase)
        home = ctx.for_node(ctx.cfg.fleet.training_node)
        copied, problems = {}, []
        try:
            for shard in ready.get(kind.prepared_key) or []:
                taken_by = handed_over_on_node(ctx, shard, kind)
                if taken_by is not None:   # the taking node works on it in its own run dir: this copy is stale
                    self.log.warning("%s shard %d: node %s handed it over to %s; not copied (its copy here would "
                                     "overwrite the shard %s completes)", self.phase, shard, name, taken_by, taken_by)
                    continue
                try:
                    rep = copy_dir(ctx.node, str(kind.shard_dir(ctx.layout, shard)), home.node,
                                   str(kind.shard_dir(home.layout, shard)), log=self.log.info, last=kind.copy_last,
                                   skip=kind.copy_skip)
                except (NodeError, RuntimeError) as e:   # the others still move; the task fails at the end
                    problems.append(f"{self.phase} shard {shard}: {e}")
                    continue
                copied[shard] = rep.files_copied
                self.log.info("%s shard %d: %s -> %s: %s", self.phase, shard, name, home.node.name, rep)
        finally:
            home.close()
        if problems:
            raise RuntimeError(f"node {name}: {len(problems)} shard(s) not collected on the training node (a "
                               "retry resumes what was copied):\n" + "\n".join(f"  - {p}" for p in problems))
        return {"node": name, "copied": copied}


class TakeOverShardsOperator(RunOperator):
    """The shards of one phase (extract, generate) other nodes left incomplete, handed over to the training
    node where proven free (the input of the mapped ``take_over_shard`` / ``take_over_generated_shard``); the
    others wait for their node."""

    def __init__(self, *, phase: str = EXTRACT, **kw):
        super().__init__(**kw)
        self.phase = _phase(phase)

    def run(self, ctx, context):
        cfg = ctx.cfg
        training = cfg.fleet.training_node or cfg.node.name
        kind = kind_of(self.phase)
        if not kind.enabled(cfg):
            self.log.info("%s is off: no %s to take over", kind.enabled_field, kind.label)
            return []
        unit = kind.unit
        todo = []
        for node in cfg.nodes_in_use():
            shards = shards_of(cfg, node.name, self.phase)
            if node.name == training or not shards:
                continue
            here = self._states_here(ctx, node.name, shards)
            if here is None:
                continue
            # a generation shard also counts as missing until its final heartbeat says complete
            missing = [s for s in shards if here[s]["stored"] < here[s]["expected"] or not here[s]["finished"]]
            if not missing:
                self.log.info("node %s: its %s shards %s are all on the training node", node.name, self.phase,
                              shards)
                continue
            if not cfg.fleet.take_over:
                self.log.warning("node %s left %s shards %s incomplete here; fleet.take_over is off: they wait "
                                 "for it", node.name, self.phase, missing)
                continue
            other = ctx.for_node(node.name)
            try:
                answer = other.node.run_json(other.eagleflow_argv("reconcile", "hand-over", "--phase", self.phase,
                                                                  "--shards", ",".join(map(str, missing)),
                                                                  "--to", training),
                                             HandOverAnswer, timeout=120)
            except NodeError as e:   # not proven free: never a second worker on a shard that may still run
                self.log.warning("node %s could not prove its %s shards %s free of our workers (%s): they wait "
                                 "for it; clear its group once it is back", node.name, self.phase, missing, e)
                continue
            finally:
                other.close()
            if answer.node != node.name:   # the answer of another node's config: not proof about this one
                self.log.warning("node %s answered the hand-over of %s shards %s as node %r: refused, they wait for "
                                 "it (is its run config this run's?)", node.name, self.phase, missing, answer.node)
                continue
            stray = sorted({s for s in answer.handed_over if s not in missing}
                           | {int(k) for k in answer.kept if int(k) not in missing})
            if stray:   # only what was asked is handed over: never a shard another node or nobody was asked for
                self.log.warning("node %s answered the hand-over of %s shards %s with shard(s) %s it was not asked "
                                 "about: those are ignored", node.name, self.phase, missing, stray)
            for shard, why in sorted(answer.kept.items()):
                if int(shard) in missing:
                    self.log.warning("node %s keeps %s shard %s: %s", node.name, self.phase, shard, why)
            for shard in sorted(set(answer.handed_over) & set(missing)):
                st = here[shard]
                self.log.info("node %s handed %s shard %d over to %s (%d/%d %s here)", node.name, self.phase,
                              shard, training, st["stored"], st["expected"], unit)
                todo.append({"run_id": ctx.layout.run_id, "phase": self.phase, "shard": shard,
                             "run_config": ctx.run_config_path, "stored": st["stored"], "expected": st["expected"],
                             "taken_from": node.name})
        self.log.info("%d %s shard(s) to take over on %s", len(todo), self.phase, training)
        return todo

    def _states_here(self, ctx, name: str, shards: list[int]) -> dict[int, dict] | None:
        """Shard -> its state on the training node, for exactly the node's ``shards``; None (warned) when the
        answer is not about exactly those: that node's shards wait, the other nodes go on."""
        answer = ctx.node.run_json(ctx.eagleflow_argv("reconcile", "states", "--phase", self.phase,
                                                      "--shards", ",".join(map(str, shards))),
                                   ShardStates, timeout=300)
        here = {st.shard: st.model_dump() for st in answer.shards}
        if sorted(here) != sorted(shards) or len(answer.shards) != len(shards):
            self.log.warning("node %s: the training node %s answered the states of %s shards %s for %s shards "
                             "%s: refused, they wait for it", name, ctx.node.name, self.phase,
                             [st.shard for st in answer.shards], self.phase, shards)
            return None
        return here


class ReleaseTakeoverServerOperator(RunOperator):
    """After the taken-over shards, whatever they did: stop the server their claims started (the capture
    server, or the generation server for generation shards)."""

    def __init__(self, *, takeover_task_id: str | None = None, phase: str = EXTRACT, **kw):
        super().__init__(**kw)
        self.phase = _phase(phase)
        self.takeover_task_id = takeover_task_id or kind_of(self.phase).takeover_task

    def run(self, ctx, context):
        if not context["ti"].xcom_pull(task_ids=self.takeover_task_id):
            raise AirflowSkipException("no shard was taken over: no server to release")
        released = ctx.node.run_json(ctx.eagleflow_argv("reconcile", "release", "--phase", self.phase),
                                     ClaimAnswer, timeout=300)
        self.log.info("%s of the takeover: %s (%s)", kind_of(self.phase).server, released.action, released.reason)
        return {"action": released.action, "reason": released.reason}
