"""llumlet — the per-instance agent (see DESIGN.md, docs/migration.md).

Modules:

- ``engine`` (the engine protocol and the model engine), ``backends`` (engines by name: ``sim``, ``torch``,
  ``vllm``);
- ``agent`` (the :class:`~llumlet.agent.Llumlet`), composed of ``driver`` (the engine loop, requests, token
  pushes, load), ``migration_out`` (the source side of a migration) and ``migration_in`` (the destination
  side); their messages are in ``migration_types``;
- ``server`` (its gRPC service: the only place protobuf meets the llumlet), ``client`` (``LlumletClient``),
  ``convert`` (the protobuf conversions), ``transport`` (local shared-memory and rate-capped gRPC block
  transports), ``tokens`` (token pusher), ``sink`` (``TokenCollector``: a TokenSink that assembles streams
  exactly once), ``procs`` (spawning llumlet processes), ``cli`` (``python -m llumlet``).

Import the submodules directly.
"""

__all__: list[str] = []
