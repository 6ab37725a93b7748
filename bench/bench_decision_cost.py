"""Decision cost per tier against cluster size: flat Llumnix vs hilum's two tiers, measured side by side.

For clusters of 16 to 4096 instances (8 per NVLink domain) with random loads, times the decisions each
design makes, all with hilum's own policy code (``policy/``):

* dispatch of one request:
  - flat (``llumnix``): one central ``DispatchView`` over every instance;
  - hilum: the gateway's ``DomainDispatchView`` over domain summaries, then the chosen domain's
    ``DispatchView`` over its 8 instances;
* one rescheduling round:
  - flat: ``plan_migrations`` over every instance;
  - hilum, per domain scheduler: ``plan_migrations`` over its 8 instances and ``summarize_domain`` of
    them (domain schedulers run in parallel, each on its own node), plus the coordinator's round:
    ``pair_domains`` over the published summaries.
* refreshing the central view from load reports (flat: every instance's report; hilum's gateway: one
  summary per domain).

Prints microseconds per decision and the flat / hilum ratio. Run:

    .venv/bin/python bench/bench_decision_cost.py [--sizes 16,256,4096] [--repeat 200]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from policy.dispatch import DispatchView, DomainDispatchView
from policy.load import InstanceLoad, RequestLoad
from policy.migration import pair_domains, plan_migrations
from policy.summarize import summarize_domain
from policy.types import PolicyConfig

DOMAIN_SIZE = 8
CAPACITY_BLOCKS = 7_000


def random_loads(num_instances: int, rng: random.Random) -> list[InstanceLoad]:
    """Instances with 0..60 running requests of 10..200 blocks each, some with a queue."""
    loads = []
    for i in range(num_instances):
        running: list[RequestLoad] = []
        used = 0
        for j in range(rng.randint(0, 60)):
            blocks = rng.randint(10, 200)
            if used + blocks > CAPACITY_BLOCKS:
                break
            used += blocks
            running.append(RequestLoad(f"i{i}-r{j}", blocks, priority=int(rng.random() < 0.1), num_tokens=blocks * 16))
        waiting = rng.choice((0, 0, 0, 2))
        loads.append(
            InstanceLoad(
                instance_id=f"i{i}",
                capacity_blocks=CAPACITY_BLOCKS,
                used_blocks=used,
                running=tuple(running),
                num_waiting=waiting,
                head_demand_blocks=120 if waiting else 0,
                queued_demand_blocks=240 if waiting else 0,
                domain_id=f"d{i // DOMAIN_SIZE}",
            )
        )
    return loads


def per_call_us(fn: Callable[[], object], repeat: int) -> float:
    """Mean wall time of ``fn()`` in microseconds over ``repeat`` calls (after one warm-up call)."""
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e6


def measure(num_instances: int, repeat: int) -> dict[str, float]:
    rng = random.Random(num_instances)
    cfg = PolicyConfig()
    loads = random_loads(num_instances, rng)
    domains: dict[str, list[InstanceLoad]] = {}
    for load in loads:
        domains.setdefault(load.domain_id, []).append(load)
    one_domain = next(iter(domains.values()))
    summaries = [summarize_domain(d, ls, cfg) for d, ls in domains.items()]

    flat_view = DispatchView(loads, cfg, random.Random(1))
    gateway = DomainDispatchView(summaries, cfg, random.Random(1))
    domain_view = DispatchView(one_domain, cfg, random.Random(1))

    def hilum_dispatch() -> None:
        gateway.pick(100)
        domain_view.pick(100)

    def flat_refresh() -> None:
        for load in loads:
            flat_view.update(load)

    def gateway_refresh() -> None:
        for summary in summaries:
            gateway.update(summary)

    def domain_round() -> None:  # each domain scheduler, in parallel on its own node
        plan_migrations(one_domain, cfg, random.Random(2))
        summarize_domain(one_domain[0].domain_id, one_domain, cfg)

    slow = max(1, repeat // max(1, num_instances // 64))
    return {
        "dispatch_flat_us": per_call_us(lambda: flat_view.pick(100), repeat),
        "dispatch_hilum_us": per_call_us(hilum_dispatch, repeat),
        "refresh_flat_us": per_call_us(flat_refresh, slow),
        "refresh_hilum_us": per_call_us(gateway_refresh, slow),
        "round_flat_us": per_call_us(lambda: plan_migrations(loads, cfg, random.Random(2)), slow),
        "round_domain_us": per_call_us(domain_round, repeat),
        "round_coordinator_us": per_call_us(lambda: pair_domains(summaries, cfg), slow),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", default="16,64,256,1024,4096", help="cluster sizes in instances, comma-separated (multiples of 8)"
    )
    parser.add_argument("--repeat", type=int, default=200, help="timed calls per decision and size (default 200)")
    args = parser.parse_args()
    header = (
        f"{'instances':>9} | {'dispatch flat':>13} {'hilum':>8} {'ratio':>7} | {'refresh flat':>12} {'hilum':>8} "
        f"{'ratio':>7} | {'round flat':>11} {'domain':>8} {'coord':>8} {'ratio':>7}"
    )
    print("microseconds per decision (ratio = flat / hilum; hilum round = one domain + coordinator)")
    print(header)
    print("-" * len(header))
    for n in (int(x) for x in args.sizes.split(",")):
        m = measure(n, args.repeat)
        hilum_round = m["round_domain_us"] + m["round_coordinator_us"]
        print(
            f"{n:>9} | {m['dispatch_flat_us']:>13.1f} {m['dispatch_hilum_us']:>8.1f} "
            f"{m['dispatch_flat_us'] / m['dispatch_hilum_us']:>6.1f}x | {m['refresh_flat_us']:>12.1f} "
            f"{m['refresh_hilum_us']:>8.1f} {m['refresh_flat_us'] / m['refresh_hilum_us']:>6.1f}x | "
            f"{m['round_flat_us']:>11.1f} {m['round_domain_us']:>8.1f} {m['round_coordinator_us']:>8.1f} "
            f"{m['round_flat_us'] / hilum_round:>6.1f}x"
        )


if __name__ == "__main__":
    main()
