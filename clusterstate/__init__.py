"""clusterstate — the shared state library every tier uses (DESIGN.md, "State in etcd").

Modules: ``etcd`` (the one etcd client of a process, retryable errors), ``endpoints`` (the ``--etcd HOST:PORT,...``
lists and the other addresses of a command line, each checked by one rule), ``options`` (the ``--prefix`` and
``--log-level`` every daemon takes, one rule each), ``backoff`` (jittered exponential
backoff), ``session`` (leases kept alive, registrations bound to them), ``election`` (leader election,
fencing token), ``fencing`` (``FencingGuard`` for domain schedulers and llumlets), ``records`` (the values
stored in etcd and their JSON encoding) and ``store`` (key layout, compare-and-swap transitions, the watched
``ClusterView``, the rate-limited ``SummaryPublisher``).

The coordinator (``global_coord``), the domain schedulers (``rack_sched``), the llumlets and the gateway all
import it; it imports nothing of theirs. Import the submodules directly; this package imports nothing so
that light users stay light.
"""

__all__: list[str] = []
