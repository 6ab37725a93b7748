"""global_coord — the etcd-backed global coordinator (see DESIGN.md, "State in etcd", "Cost model").

Modules: ``approver`` (destination choice, link budgets), ``approval`` (the approval rule),
``coordinator`` / ``server`` / ``cli`` (the process, ``python -m global_coord``), ``wiring`` (topology and
cost model), ``convert`` (protobuf <-> dataclasses at the gRPC edge). The etcd state it shares with every
other tier (sessions, election, fencing, records, the store) is the ``clusterstate`` package.
Import the submodules directly; this package imports nothing so that light users stay light.
"""

__all__: list[str] = []
