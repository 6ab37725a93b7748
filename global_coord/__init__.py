"""global_coord — the etcd-backed global coordinator (see DESIGN.md, "State in etcd", "Cost model").

Modules: ``session`` (leases kept alive, re-registration), ``election`` (leader election, fencing
token), ``fencing`` (``FencingGuard`` for domain schedulers and llumlets), ``records`` and ``store`` (key
layout, CAS transitions, ``ClusterView``), ``approver`` (destination choice, link budgets),
``approval`` (the approval rule), ``coordinator`` / ``server`` / ``cli`` (the process,
``python -m global_coord``), ``convert`` (protobuf <-> dataclasses at the gRPC edge).
Import the submodules directly; this package imports nothing so that light users stay light.
"""

__all__: list[str] = []
