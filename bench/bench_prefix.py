"""What prefix-aware dispatch buys on the Mooncake conversation trace: prefix hit rate, TTFT and the busiest
instance's load, with prefix awareness on and off, side by side.

Replays the bundled ``mooncake-conv`` trace (every request carries the hash ids of its 512-token prompt blocks;
prompts cut to the model's 4,096-token context) through ``sim.runner.run_simulation`` — the code ``hilum sim``
runs — on ``2x8-a100`` (16 Llama-2-7B instances on two 8-GPU A100-80GB nodes: KV memory for about 120 k tokens
per instance, so a cache can hold what dispatch sends it). Prefix caching is on in every engine (vLLM V1's
default); only ``policy.prefix_aware_dispatch`` changes between the two rows of a policy. Per run it prints:

- ``hit %``: prompt tokens the engines reused from their prefix cache over all prompt tokens
  (``PolicySummary.prefix_hit_rate``);
- P50, P99 and mean TTFT, ms;
- ``busiest/fair``: requests dispatch placed on the busiest instance over its fair share (placed requests / 16,
  ``sim.results.busiest_dispatch_share``); 1.0 is an even spread;
- ``moves``: committed migrations; ``to a holder``: those whose destination cached part of the request's prefix;
  ``blocks not copied``: the prefix blocks those destinations held (adopted, not copied).

The figures are simulated, deterministic for a seed (no timing of this machine enters them). Run:

    .venv/bin/python bench/bench_prefix.py [--rates 6,8] [--max-requests 4000] [--policies llumnix,hilum]
"""

from __future__ import annotations

import argparse

from sim.results import busiest_dispatch_share, summarize
from sim.runner import SimSpec, run_simulation

TOPOLOGY = "2x8-a100"
TRACE = "mooncake-conv"
NUM_INSTANCES = 16


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="6,8", help="rate scales of the trace (1 = as recorded, 3.4 req/s)")
    parser.add_argument("--max-requests", type=int, default=4000)
    parser.add_argument("--policies", default="llumnix,hilum")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",") if r]
    policies = [p for p in args.policies.split(",") if p]
    print(f"{TRACE}, first {args.max_requests} requests, on {TOPOLOGY} ({NUM_INSTANCES} instances), seed {args.seed}")
    header = [
        *("rate", "policy", "prefix-aware", "hit %", "TTFT p50", "TTFT p99", "TTFT mean", "busiest/fair"),
        *("moves", "to a holder", "blocks not copied"),
    ]
    print("{:>5} {:<9} {:<12} {:>6} {:>9} {:>9} {:>10} {:>13} {:>6} {:>12} {:>18}".format(*header))
    for rate in rates:
        for policy in policies:
            for aware in (True, False):
                spec = SimSpec(
                    TOPOLOGY,
                    TRACE,
                    policy,
                    rate_scale=rate,
                    max_requests=args.max_requests,
                    seed=args.seed,
                    options={"prefix_aware_dispatch": aware},
                )
                run = run_simulation(spec)
                s = summarize(run)
                ttft = [r.ttft_s for r in run.requests if r.ttft_s is not None]
                mean = sum(ttft) / len(ttft) if ttft else None
                share = busiest_dispatch_share(run.requests, NUM_INSTANCES)
                hit = "-" if s.prefix_hit_rate is None else f"{100 * s.prefix_hit_rate:.1f}"
                moved = [m for m in run.migrations if m.outcome == "committed"]
                to_holder = sum(1 for m in moved if m.skipped_prefix_blocks)
                skipped = sum(m.skipped_prefix_blocks for m in moved)
                print(
                    f"{rate:>5g} {policy:<9} {'on' if aware else 'off':<12} {hit:>6} {_ms(s.ttft_p50_s):>9} "
                    f"{_ms(s.ttft_p99_s):>9} {_ms(mean):>10} {'-' if share is None else f'{share:.2f}':>13} "
                    f"{len(moved):>6} {to_holder:>12} {skipped:>18}"
                )


if __name__ == "__main__":
    main()
