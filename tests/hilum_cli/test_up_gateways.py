"""``hilum up --gateways N``: several gateways in front of one cluster, sharing one port (SO_REUSEPORT; each
also alone on its own port) or each on its own; supervised like every other process; refused by name where
the platform cannot share a port."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from up_harness import TOPOLOGY, UpProcess, alive, start_up

from gateway.cli import main as gateway_main
from hilum_cli.up import UpConfig, plan_ports, run_up
from topology.load import parse_topology

MODEL = "llama-2-7b"


def _topology() -> Any:
    return parse_topology(yaml.safe_load(TOPOLOGY), "test")


def test_shared_gateways_listen_on_one_port_and_each_alone_on_the_next_ones() -> None:
    plan = plan_ports(_topology(), "127.0.0.1", 18000, 0, 17070, etcd_embedded=True, gateways=3)
    assert plan.gateway == 18000 and plan.shared_gateway_port
    assert plan.gateways == {"gateway-0": 18001, "gateway-1": 18002, "gateway-2": 18003}
    assert plan.sinks == {"gateway-0": 17077, "gateway-1": 17078, "gateway-2": 17079}  # after the 4 llumlets
    names = [what for what, _ in plan.named()]
    assert names[:4] == ["gateway HTTP (shared)", "gateway-0 HTTP", "gateway-1 HTTP", "gateway-2 HTTP"]
    assert names[-3:] == ["gateway-0 token sink", "gateway-1 token sink", "gateway-2 token sink"]


def test_separate_gateways_each_take_the_next_port() -> None:
    plan = plan_ports(
        _topology(), "127.0.0.1", 18000, 0, 17070, etcd_embedded=True, gateways=2, gateway_ports="separate"
    )
    assert plan.gateway == 18000 and not plan.shared_gateway_port
    assert plan.gateways == {"gateway-0": 18000, "gateway-1": 18001}
    free = plan_ports(_topology(), "127.0.0.1", 0, 0, 0, etcd_embedded=True, gateways=4, gateway_ports="separate")
    ports = [p for _, p in free.named()]
    assert free.gateway == free.gateways["gateway-0"] and len(set(ports)) == len(ports) and all(ports)


def test_a_lone_gateway_keeps_its_name_and_port() -> None:
    plan = plan_ports(_topology(), "127.0.0.1", 18000, 0, 17070, etcd_embedded=True)
    assert (plan.gateways, plan.sinks, plan.shared_gateway_port) == ({"gateway": 18000}, {"gateway": 17077}, False)


def test_sharing_a_port_without_so_reuseport_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delattr(socket, "SO_REUSEPORT")
    err = io.StringIO()
    cfg = UpConfig(gateways=2, port=0, etcd_port=0, grpc_base_port=0, run_dir=str(tmp_path / "run"))
    assert run_up(cfg, out=io.StringIO(), err=err) == 1
    assert err.getvalue() == (
        "hilum up: error: --gateways 2 on one port needs SO_REUSEPORT, which this platform lacks: pass "
        "--gateway-ports separate (each gateway on its own port)\n"
    )
    assert not (tmp_path / "run").exists()
    # the gateway itself refuses --reuse-port there too (exit 2: a configuration error)
    argv = ["--etcd", "127.0.0.1:1", "--topology", "2x8-a100", "--listen", "127.0.0.1:0", "--reuse-port"]
    assert gateway_main(argv) == 2
    assert "gateway: error: --reuse-port: this platform has no SO_REUSEPORT" in capsys.readouterr().err


def test_bad_gateway_counts_and_modes_are_refused(tmp_path: Path) -> None:
    for cfg, words in [
        (UpConfig(gateways=0), "hilum up: error: --gateways: need at least 1, got 0"),
        (UpConfig(gateways=2, gateway_ports="many"), "--gateway-ports 'many': choose one of shared, separate"),
    ]:
        err = io.StringIO()
        assert run_up(cfg, out=io.StringIO(), err=err) == 2
        assert words in err.getvalue()


# ---- a real cluster of three gateways on one port -------------------------------------------------------
@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    cluster = start_up(tmp_path_factory.mktemp("up-gateways"), "sim", ["--gateways", "3"])
    try:
        yield cluster
    finally:
        err = cluster.stop()
        assert "no process left" in err
        assert [p for p in cluster.read_info()["pids"] if alive(p)] == []


async def _ok_requests(url: str, n: int) -> None:
    """``n`` requests, each on a new connection, each answered whole."""
    connector = aiohttp.TCPConnector(force_close=True)  # a new connection per request: the kernel spreads them
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        for _ in range(n):
            body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "return_token_ids": True}
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["choices"][0]["token_ids"] == [0, 1, 2]


async def _served(url: str) -> float:
    """Completions this gateway answered ok (its own /metrics)."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        page = await resp.text()
    ok = 'hilum_gateway_requests_total{endpoint="completions",outcome="ok"} '
    line = [x for x in page.splitlines() if x.startswith(ok)]
    return float(line[0].split()[-1]) if line else 0.0


def test_three_gateways_share_one_port_and_each_serves_a_share(up: UpProcess) -> None:
    info = up.read_info()
    gateways = info["gateways"]
    assert sorted(gateways) == ["gateway-0", "gateway-1", "gateway-2"] and info["gateway_port_shared"] is True
    assert info["gateway_urls"] == [info["gateway_url"]]
    own = [g["url"] for g in gateways.values()]
    assert len({*own, info["gateway_url"]}) == 4 and len({g["token_sink"] for g in gateways.values()}) == 3
    assert set(info["processes"]) >= set(gateways)

    async def main() -> None:
        before = [await _served(u) for u in own]
        await _ok_requests(info["gateway_url"], 30)
        after = [await _served(u) for u in own]
        shares = [a - b for a, b in zip(after, before, strict=True)]
        assert sum(shares) == 30 and min(shares) > 0, shares  # P(some gateway gets none) = 3 (2/3)^30 < 2e-5

    asyncio.run(main())


def test_a_killed_gateway_is_restarted_and_the_shared_port_serves_meanwhile(up: UpProcess) -> None:
    info = up.read_info()
    victim = info["processes"]["gateway-1"]
    os.kill(victim["pid"], signal.SIGKILL)
    up.wait_stderr(f"gateway-1 (pid {victim['pid']}) was killed by SIGKILL; restarting it")
    asyncio.run(_ok_requests(info["gateway_url"], 12))  # the other two take every new connection
    up.wait_stderr("gateway-1 serves again", timeout_s=120)
    after = up.read_info()["processes"]["gateway-1"]
    assert after["restarts"] == victim["restarts"] + 1 and after["pid"] != victim["pid"]
    assert (victim["state"], after["state"]) == ("running", "running")

    async def health() -> Any:
        url = info["gateways"]["gateway-1"]["url"]
        async with aiohttp.ClientSession() as session, session.get(url + "/health") as resp:
            return resp.status, (await resp.json())["domains"]

    assert asyncio.run(health()) == (200, ["dom-a", "dom-b"])  # on its own port again, seeing every domain
