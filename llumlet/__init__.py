"""llumlet — the per-instance agent (see DESIGN.md, docs/migration.md).

Modules: ``engine`` (the engine protocol and the model engine), ``backends`` (engines by name: ``sim``,
``torch``), ``agent`` (the :class:`~llumlet.agent.Llumlet`: engine loop, requests, token pushes, load,
migration), ``server`` (its gRPC service), ``client`` (``LlumletClient``), ``transport`` (local shared-memory
and rate-capped gRPC block transports), ``tokens`` (token pusher), ``sink`` (``TokenCollector``: a TokenSink
that assembles streams exactly once), ``convert`` (protobuf edge), ``procs`` (spawning llumlet processes),
``cli`` (``python -m llumlet``). Import the submodules directly.
"""

__all__: list[str] = []
