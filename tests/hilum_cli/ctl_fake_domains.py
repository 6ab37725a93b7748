"""Stand-in for the domain schedulers in the hilumctl tests: a real process that writes what they would.

    python ctl_fake_domains.py --etcd HOST:PORT --prefix P

Reads JSON commands from stdin, one per line, and answers each with one JSON line on stdout once it is
applied (``{"ok": N}``, N = the command's number) — or at once (``{"scheduled": N}``) when it has a
``delay_s``, which runs it later in the background:

- ``{"op": "domain", "record": {DomainRegistration fields}}`` and ``{"op": "instance", "record": {...}}``:
  registrations under this process's lease (``clusterstate.session.Registrar``), as rack_sched/llumlets do;
- ``{"op": "summary", "record": {DomainSummary fields, instances: [InstanceBrief fields]}}``: published, as
  the domain's one summary, through ``clusterstate.store.SummaryPublisher`` (answered after the put);
- ``{"op": "commit", "migration_id": ID}``: approved -> committed by compare-and-swap (``Store.transition``),
  as the destination's domain scheduler does after the last copy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from typing import Any

from clusterstate.etcd import connect
from clusterstate.records import (
    DomainRegistration,
    InstanceRegistration,
    MigrationState,
    SummaryRecord,
    decode,
    encode,
)
from clusterstate.session import Registrar
from clusterstate.store import Keys, Store, SummaryPublisher


def _summary(raw: dict[str, Any]) -> SummaryRecord:
    # ±inf arrive as JSON's Infinity (Python's json reads and writes it); the record codec checks every field
    return decode(SummaryRecord, json.dumps({"domain_id": raw["domain_id"], "summaries": [raw]}).encode(), "fake")


async def main(etcd: str, prefix: str) -> None:
    client = connect([etcd])
    await client.connect()
    keys = Keys(prefix)
    store = Store(client, keys)
    registrar = Registrar(client, 10, rng=random.Random(0), name="fake-domains")
    stop = asyncio.Event()
    tasks = [asyncio.create_task(registrar.run(stop))]
    await registrar.registered.wait()
    publishers: dict[str, SummaryPublisher] = {}

    async def apply(cmd: dict[str, Any]) -> None:
        op = cmd["op"]
        if op == "domain":
            reg = DomainRegistration(**cmd["record"])
            await registrar.set(keys.domain(reg.domain_id), encode(reg))
        elif op == "instance":
            inst = InstanceRegistration(**cmd["record"])
            await registrar.set(keys.instance(inst.instance_id), encode(inst))
        elif op == "summary":
            summary = _summary(dict(cmd["record"]))
            pub = publishers.get(summary.domain_id)
            if pub is None:
                pub = publishers[summary.domain_id] = SummaryPublisher(
                    registrar, keys, summary.domain_id, min_interval_s=0.02
                )
                tasks.append(asyncio.create_task(pub.run(stop)))
            puts = pub.puts
            pub.offer(summary)
            while pub.puts == puts:
                await asyncio.sleep(0.01)
        elif op == "commit":
            current = await store.get_migration(cmd["migration_id"])
            assert current is not None, cmd
            result = await store.transition(cmd["migration_id"], current[1], MigrationState.COMMITTED, reason="done")
            assert result.ok, result
        else:
            raise ValueError(f"unknown op {op!r}")

    async def later(delay_s: float, cmd: dict[str, Any]) -> None:
        await asyncio.sleep(delay_s)
        await apply(cmd)

    n = 0
    while line := await asyncio.to_thread(sys.stdin.readline):
        n += 1
        cmd = json.loads(line)
        if cmd.get("delay_s"):
            tasks.append(asyncio.create_task(later(float(cmd["delay_s"]), cmd)))
            print(json.dumps({"scheduled": n}), flush=True)
        else:
            await apply(cmd)
            print(json.dumps({"ok": n}), flush=True)
    stop.set()
    await asyncio.gather(*tasks)
    await client.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--etcd", required=True)
    p.add_argument("--prefix", required=True)
    ns = p.parse_args()
    asyncio.run(main(ns.etcd, ns.prefix))
