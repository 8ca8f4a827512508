"""The skeletons every sharded phase runs on, each taking the phase's descriptor: ``worker`` (the loop around the
heartbeat), ``commands`` (the node commands every phase has) and ``lifecycle`` (its server and workers on a node).

A layer above the registry (``eagleflow.phases``: the descriptors, read by the watchdog, the fleet and the node
protocol) and below the phases' folders: the skeletons use the watchdog's sentinel and the fleet's hand-over
records, which read the descriptors, so they cannot sit beside the descriptors without a circle.
"""
