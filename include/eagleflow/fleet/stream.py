"""A fleet's streaming store (issue 53): the training node's endpoint handed to each capture node.

The store (``eagleflow store start``) runs on the training node and binds ``stream.host``; every other node of
the run puts its shards' samples into it over the network. Its endpoint reaches a node the way the frozen run
config does (``Node.write_text`` over the node's own connection, from the Airflow worker): written to that
node's ``store_endpoint.<node>.json`` (``RunLayout.store_endpoint_file``, tagged, so nodes sharing a run root never
overwrite the training node's file or each other's). What is written is only what a sink needs (addresses,
ports, the store's incarnation), validated first: the start's answer is a node's text. The pid records stay on
the training node (a capture node's sink never signals the store).
"""
from __future__ import annotations

import json
import re
from typing import Any, Mapping

from eagleflow.config import stream_host_reachable
from eagleflow.fleet.assign import shards_of
from eagleflow.nodes.base import NodeError
from eagleflow.stores.mooncake.master import DEVICE_NAMES, PROTOCOLS

PORT_FIELDS = ("rpc_port", "metadata_port", "metrics_port")
STORE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class EndpointRefused(ValueError):
    """The training node's store answer is not a usable endpoint; the message names the field and value."""


def node_endpoint(answer: Mapping[str, object], stream_host: str, *, source: str, remote: bool) -> dict[str, Any]:
    """The endpoint a capture node's sinks read, from the training node's ``store start`` answer (a node's text:
    every field is checked before use, hence ``Mapping[str, object]``; ``source``
    names it in errors). ``remote``: the node reaches the training node over the network (loopback refused)."""
    def bad(field: str, why: str) -> EndpointRefused:
        return EndpointRefused(f"{source}: {field} {answer.get(field)!r} {why}; restart the run's store "
                               "(eagleflow store start on the training node) and clear start_store")
    host = answer.get("host")
    if not isinstance(host, str) or host != stream_host:
        raise bad("host", f"is not the store's configured address stream.host {stream_host!r}")
    if remote and not stream_host_reachable(host):
        raise bad("host", "is loopback or a wildcard, unreachable from another node: set stream.host to the "
                          "training node's address")
    ports = {}
    for f in PORT_FIELDS:
        v = answer.get(f)
        if not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 65535):
            raise bad(f, "is not a TCP port (1-65535)")
        ports[f] = v
    if len(set(ports.values())) != len(ports):
        raise bad("rpc_port", f"and the other ports {sorted(ports.values())} are not distinct")
    seg = answer.get("segment_bytes")
    if not (isinstance(seg, int) and not isinstance(seg, bool) and seg > 0):
        raise bad("segment_bytes", "is not a positive byte count")
    store_id = answer.get("store_id")
    if not (isinstance(store_id, str) and STORE_ID.match(store_id)):
        raise bad("store_id", "is not a store incarnation id (letters, digits, '_.-', at most 64)")
    # the transport the segment holder uses: each node's sinks must speak it (an answer from an older build has none)
    protocol, devices = answer.get("protocol", "tcp"), answer.get("device_names", "")
    if not isinstance(protocol, str) or protocol not in PROTOCOLS:
        raise bad("protocol", f"is not one of {', '.join(PROTOCOLS)}")
    if not isinstance(devices, str) or (devices and not DEVICE_NAMES.fullmatch(devices)):
        raise bad("device_names", "is not a comma-separated list of RDMA device names")
    return {"host": host, **ports, "segment_bytes": seg, "master_pid_file": "", "segment_pid_file": "",
            "metadata_pid_file": "", "store_id": store_id, "protocol": protocol, "device_names": devices}


def hand_endpoint_to_capture_nodes(ctx, answer: Mapping[str, object], log) -> dict[str, str]:
    """``hand_endpoint_to_nodes`` for every node of the run other than the training node that has extraction
    shards ({} outside a fleet): after the store's start, and again after a restart (a new incarnation's ports)."""
    if not ctx.cfg.is_fleet:
        return {}
    home = ctx.cfg.fleet.training_node
    nodes = [n.name for n in ctx.cfg.nodes_in_use() if n.name != home and shards_of(ctx.cfg, n.name)]
    return hand_endpoint_to_nodes(ctx, answer, nodes, log)


def hand_endpoint_to_nodes(ctx, answer: Mapping[str, object], nodes: list[str], log) -> dict[str, str]:
    """Write the validated endpoint to each of ``nodes`` (their own view of the run); node -> what happened.
    A node not reached is logged and left out: its workers then fail naming the missing endpoint, and the
    training node takes its shards over (``take_over_shards``), so the other nodes go on."""
    home = ctx.cfg.fleet.training_node or ctx.cfg.node.name
    home_conn = next((n.conn_id for n in ctx.cfg.fleet.nodes if n.name == home), None)
    out: dict[str, str] = {}
    for name in nodes:
        other = ctx.for_node(name)
        try:
            ep = node_endpoint(answer, ctx.cfg.stream.host, source=f"the store start answer of node {home}",
                               remote=other.cfg.node.conn_id != home_conn)
            other.node.write_text(str(other.layout.store_endpoint_file), json.dumps(ep, indent=1))
            out[name] = f"written to {other.layout.store_endpoint_file}"
            log(f"store endpoint {ep['host']}:{ep['rpc_port']} (store {ep['store_id']}) handed to node {name}: "
                f"{other.layout.store_endpoint_file}")
        except EndpointRefused:
            raise                       # the same answer for every node: the task fails naming it
        except (NodeError, OSError) as e:   # this node only
            out[name] = f"not reached: {type(e).__name__}: {e}"
            log(f"store endpoint NOT handed to node {name} ({type(e).__name__}: {e}): its workers will fail "
                "naming the missing endpoint and its shards wait for a takeover")
        finally:
            other.close()
    return out
