"""rack_sched — the domain scheduler: one per NVLink domain (DESIGN.md; docs/control-plane.md, "Domain scheduler").

Dispatch, the intra-domain rescheduling loop, domain summaries, cross-domain proposals and drains over the
exact, pushed loads of the domain's llumlets. The decisions are the pure core ``rack_sched.core`` (which the
simulator runs too; with ``rack_sched.plan``); ``rack_sched.scheduler`` is its async service shell,
``rack_sched.server`` its gRPC service, ``rack_sched.convert`` the protobuf edge, ``python -m rack_sched``
runs one (``rack_sched.cli``). Import the submodules directly; this package imports nothing so that light
users (the simulator, the configuration) stay light.
"""

__all__: list[str] = []
