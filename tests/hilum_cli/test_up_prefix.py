"""Prefix-aware dispatch live (issue 15): ``hilum up --engine sim`` with one NVLink domain of two instances,
requests sharing a long system prompt through the official ``openai`` client. The gateway hashes each prompt,
the sim llumlets cache prefixes by those ids and report what they hold, and the domain scheduler sends the
requests to the instance holding the prefix while the load gap is within ``policy.prefix_affinity_margin``;
a burst of long requests with the same prefix spreads over both instances (affinity yields to load). The
gateway's ``/metrics`` shows each instance's prefix-cache hits.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from up_harness import TOPOLOGY as HARNESS_TOPOLOGY
from up_harness import UpProcess, openai_client, running_up

from hilum_proto.v1 import rack_sched_pb2, rack_sched_pb2_grpc

pytest.importorskip("openai")
pytestmark = pytest.mark.slow

MODEL = "llama-2-7b"
TOPOLOGY = HARNESS_TOPOLOGY.split("  - id: dom-b")[0]  # the harness's first domain alone: a0, a1, no fabric
# The sim gateway's byte tokenizer: one token per byte. The 600 bytes of system prompt they share hold 9 full
# hash blocks of 64 tokens (prefix_cache.blocks_per_hash 4 x 16-token blocks) = 576 tokens.
SYSTEM = ("You are a careful assistant for the hilum test suite. " * 20)[:600]
SHARED_HIT_TOKENS = 9 * 64


def _until(check: Callable[[], Any], what: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)
    return got


def _metric(url: str, name: str, instance: str) -> float:
    page = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    m = re.search(rf'^hilum_gateway_{name}{{domain="dom-a",instance="{instance}"}} (\S+)$', page, re.MULTILINE)
    return float(m.group(1)) if m else -1.0


def _domain_state(info: dict[str, Any]) -> Any:
    """The domain scheduler's view of its instances (their last load reports)."""

    async def state() -> Any:
        async with grpc.aio.insecure_channel(info["domain_schedulers"]["dom-a"]) as channel:
            return await rack_sched_pb2_grpc.RackSchedulerStub(channel).GetDomainState(
                rack_sched_pb2.GetDomainStateRequest(), timeout=5
            )

    return asyncio.run(state())


def _prefix_hashes_seen(info: dict[str, Any]) -> dict[str, int]:
    """Prefix hash ids in each instance's last load report, as the domain scheduler holds it."""
    return {i.instance_id: i.num_prefix_hashes for i in _domain_state(info).instances}


def _idle(info: dict[str, Any]) -> bool:
    """The domain scheduler's last reports show no request on either instance."""
    return all(i.num_running == 0 and i.num_waiting == 0 for i in _domain_state(info).instances)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    with running_up(tmp_path_factory.mktemp("up-prefix"), "sim", kv_blocks=1024, topology=TOPOLOGY) as cluster:
        yield cluster


def test_requests_sharing_a_system_prompt_land_where_it_is_cached(up: UpProcess) -> None:
    with openai_client(up, timeout_s=60) as client:

        def ask(i: int, max_tokens: int = 4) -> Any:
            return client.completions.create(model=MODEL, prompt=f"{SYSTEM} Question {i}: why?", max_tokens=max_tokens)

        first = ask(0)
        assert first.usage.prompt_tokens == 601 + len("Question 0: why?")
        home = first.model_extra["hilum"]["instance_id"]
        other = ({"a0", "a1"} - {home}).pop()
        held = _until(lambda: {i: n for i, n in _prefix_hashes_seen(up.info).items() if n}, "a prefix reported")
        assert set(held) == {home} and held[home] == 9  # its 9 full hash blocks; the other holds nothing
        for i in range(1, 5):
            # one after another, each once the scheduler saw the last one finish: no load gap at all (with the
            # last one still running there the holder's batch would be twice the other's, the margin's edge)
            _until(lambda: _idle(up.info), "the domain idle")
            assert ask(i).model_extra["hilum"]["instance_id"] == home
        hits = _until(
            lambda: (h := _metric(up.url, "instance_prefix_hit_tokens", home)) >= 4 * SHARED_HIT_TOKENS and h,
            "the home instance's hits on /metrics",
        )
        assert hits == 4 * SHARED_HIT_TOKENS  # every later request reused the 9 shared hash blocks there
        assert _metric(up.url, "instance_prefix_query_tokens", other) == 0  # none went to the other instance

        # a burst of long requests with the same prefix: affinity yields to load, both instances take some
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda i: ask(100 + i, max_tokens=300), range(8)))
        assert all(o.usage.completion_tokens == 300 for o in outs)
        where = [o.model_extra["hilum"]["instance_id"] for o in outs]
        assert where.count(home) >= 1 and where.count(other) >= 1, where
        assert _until(lambda: _metric(up.url, "instance_prefix_query_tokens", other) > 0, "the other instance used")
