"""The gateway's per-instance series follow the registrations (issue 11): a deregistered instance's KV gauges
leave ``/metrics``, and an instance registered again at a new address is followed there (real etcd, in-process
llumlets on real gRPC, the gateway's ``LiveCluster``)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

from clusterstate.etcd import connect, kv_of
from clusterstate.records import InstanceRegistration, encode
from clusterstate.store import Keys
from gateway.cluster import LiveCluster
from gateway.metrics import GatewayMetrics
from llumlet.backends import BackendConfig
from llumlet.engine.types import SamplingParams
from llumlet.sink import TokenCollector
from llumlet.testing import RunningLlumlet, start_llumlet
from topology.load import parse_topology

_MODEL = {
    "name": "llama-2-7b", "num_layers": 32, "num_attention_heads": 32, "num_kv_heads": 32, "head_dim": 128,
    "hidden_size": 4096, "dtype": "float16", "block_size_tokens": 16, "num_params": 6738415616,
    "max_context_tokens": 4096,
}  # fmt: skip
TOPOLOGY = {
    "name": "metrics-test",
    "models": [_MODEL],
    "gpu_types": [{"name": "a100-80gb", "memory_gib": 80, "hbm_gbyte_per_s": 2039, "nvlink_gbyte_per_s": 600}],
    "domains": [
        {
            "id": "d",
            "kind": "node",
            "gpu_type": "a100-80gb",
            "nodes": [{"id": "n", "num_gpus": 2, "nic_gbit_per_s": 100}],
            "instances": [
                {"id": iid, "gpus": [k], "tensor_parallel_size": 1, "model": "llama-2-7b", "kv_capacity_blocks": 100}
                for k, iid in enumerate(("a0", "a1"))
            ],
        }
    ],
}


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.02)


def test_a_deregistered_instance_leaves_metrics_and_a_moved_one_is_followed(etcd: Any, prefix: str) -> None:
    topo = parse_topology(TOPOLOGY, "test")
    keys = Keys(prefix)

    async def register(client: Any, node: RunningLlumlet, iid: str) -> None:
        reg = InstanceRegistration(iid, "d", "n", node.address, "llama-2-7b", 100)
        await kv_of(client).put(keys.instance(iid), encode(reg))

    async def main() -> None:
        client = connect([etcd.endpoint])
        await client.connect()
        col = TokenCollector()
        await col.start()
        nodes = {iid: await start_llumlet(iid, backend=BackendConfig(instance_id=iid, topology=topo))
                 for iid in ("a0", "a1")}  # fmt: skip
        metrics = GatewayMetrics()
        cluster = LiveCluster(topo, client, metrics, random.Random(0), prefix=prefix)
        await cluster.start_services()
        page = lambda: metrics.render().decode()  # noqa: E731
        try:
            for iid, node in nodes.items():
                await register(client, node, iid)
            col.expect("r", nodes["a0"].address)  # a0 holds blocks
            sampling = SamplingParams(max_tokens=1400)
            assert (await nodes["a0"].client.submit("r", col.address, sampling, prompt_tokens=100)).accepted
            used = 'hilum_gateway_instance_kv_used_blocks{domain="d",instance="a0"}'
            await _until(lambda: f"{used} 0.0" not in page() and used in page(), "a0's used blocks shown")
            await kv_of(client).delete(keys.instance("a0"))  # a0 deregistered (its lease expired: it died)
            await _until(lambda: 'instance="a0"' not in page(), "a0's series gone")
            assert 'hilum_gateway_instance_kv_used_blocks{domain="d",instance="a1"} 0.0' in page()
            # a0 comes back at another address, idle: the gateway follows the new one
            await nodes["a0"].stop()
            nodes["a0"] = await start_llumlet("a0", backend=BackendConfig(instance_id="a0", topology=topo))
            await register(client, nodes["a0"], "a0")
            await _until(lambda: f"{used} 0.0" in page(), "the restarted a0 shown idle")
        finally:
            await cluster.close()
            for node in nodes.values():
                await node.stop()
            await col.stop()
            await client.close()

    asyncio.run(main())
