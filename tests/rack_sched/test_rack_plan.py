"""Pure parts of the domain scheduler: demand, drains, the cross-domain move, the published summary, and the
conversions at its gRPC edge. Values are computed by hand in the comments."""

from __future__ import annotations

import random

import pytest

from clusterstate.etcd import EtcdError
from clusterstate.records import DrainKind
from hilum_proto.v1 import llumlet_pb2
from policy.domain import DomainSummary
from policy.load import InstanceLoad, RequestLoad
from policy.summarize import summarize_domain
from policy.types import PolicyConfig
from rack_sched.convert import load_from_pb, prompt_length
from rack_sched.plan import drained_instances, plan_cross_domain
from rack_sched.types import DomainTakenError

CFG = PolicyConfig()


def test_drained_instances() -> None:
    ids = ["a", "b", "c"]
    intents = [(DrainKind.INSTANCE, "b"), (DrainKind.INSTANCE, "elsewhere"), (DrainKind.DOMAIN, "other")]
    assert drained_instances("d", ids, intents) == {"b"}
    assert drained_instances("d", ids, [*intents, (DrainKind.DOMAIN, "d")]) == {"a", "b", "c"}
    assert drained_instances("d", ids, []) == frozenset()


def _summary(domain_id: str, freeness: float, largest_free: int, draining: bool = False) -> DomainSummary:
    return DomainSummary(domain_id, 1, 100, 100 - largest_free, freeness, largest_free, 100, 1, 0, draining)


def test_cross_domain_move_only_when_paired_as_source() -> None:
    # Source a0: 2 requests (58 and 40 blocks) of 100: F = 2 / 2 = 1 < 3. Domain summary of "a" the same.
    a0 = InstanceLoad("a0", 100, 98, (RequestLoad("big", 58, num_tokens=900), RequestLoad("small", 40, num_tokens=630)))
    mine = summarize_domain("a", [a0], CFG)
    assert mine.freeness == 1.0
    # Domain b: freest instance has 80 of 100 free -> stand-in V = 20; V_a0 - 20 = 78 > 40: "small" moves first.
    move = plan_cross_domain(mine, [_summary("b", 40.0, 80)], [a0], CFG, random.Random(0))
    assert move is not None
    got = (move.src_instance_id, move.request_id, move.request.blocks, move.request.num_tokens, move.dst_domain_id)
    assert got == ("a0", "small", 40, 630, "b")
    # b with only 30 free blocks: nothing of a0 fits there (both requests hold more).
    assert plan_cross_domain(mine, [_summary("b", 30.0, 30)], [a0], CFG, random.Random(0)) is None
    # b not free enough to be a destination (F 2 < 3): no pair, no move.
    assert plan_cross_domain(mine, [_summary("b", 2.0, 80)], [a0], CFG, random.Random(0)) is None
    # An instance of a's own that is freer than b's stand-in takes the move inside the domain instead.
    a1 = InstanceLoad("a1", 100, 0)
    both = summarize_domain("a", [a0, a1], CFG)
    both_low = DomainSummary("a", 2, 200, 98, 1.0, 100, 100, 2, 0, False)  # pretend the domain is paired
    assert both.freeness > 3
    assert plan_cross_domain(both_low, [_summary("b", 40.0, 80)], [a0, a1], CFG, random.Random(0)) is None


def test_drained_domain_moves_everything_out() -> None:
    a0 = InstanceLoad("a0", 100, 10, (RequestLoad("r", 10, num_tokens=150),), draining=True)
    mine = summarize_domain("a", [a0], CFG)
    assert mine.draining
    move = plan_cross_domain(mine, [_summary("b", 2.0, 50)], [a0], CFG, random.Random(0))
    assert move is not None and (move.request_id, move.dst_domain_id) == ("r", "b")


def test_load_report_conversion() -> None:
    report = llumlet_pb2.LoadReport(
        instance_id="i0",
        total_blocks=100,
        used_blocks=40,
        reserved_blocks=10,
        cached_blocks=7,
        running=[
            llumlet_pb2.RunningRequest(
                request_id="a", blocks=30, priority=1, num_tokens=470, in_decode=True, output_tokens=70, max_tokens=200
            ),
            llumlet_pb2.RunningRequest(request_id="b", blocks=10, num_tokens=150, in_decode=False),
        ],
        num_waiting=1,
        head_demand_blocks=4,
        queued_demand_blocks=4,
        preempting=True,
        recent_step_s=0.031,
    )
    load = load_from_pb(report, "i0", "d")
    assert (load.capacity_blocks, load.used_blocks, load.free_blocks) == (100, 50, 50)  # reserved held, cached free
    assert load.running == (
        RequestLoad("a", 30, 1, 470, True, output_tokens=70, max_tokens=200),
        RequestLoad("b", 10, 0, 150, False),
    )
    assert load.decode_step_s == 0.031  # every engine reports its recent step time
    assert (load.num_waiting, load.head_demand_blocks, load.preempting, load.draining) == (1, 4, True, False)
    with pytest.raises(ValueError, match="load report of i1: it names instance 'i0'"):
        load_from_pb(report, "i1", "d")


def test_prompt_length_validation() -> None:
    ok = llumlet_pb2.SubmitRequest(
        request_id="r", prompt_token_ids=[1, 2, 3], sampling=llumlet_pb2.Sampling(max_tokens=4)
    )
    assert prompt_length(ok) == 3
    bad = llumlet_pb2.SubmitRequest(
        request_id="r", prompt_tokens=5, prompt_token_ids=[1], priority=-1, sampling=llumlet_pb2.Sampling()
    )
    with pytest.raises(ValueError) as err:
        prompt_length(bad)
    assert str(err.value) == (
        "SubmitRequest 'r': priority must be >= 0, got -1; sampling.max_tokens must be >= 1, got 0; "
        "prompt_tokens is 5 but prompt_token_ids has 1 tokens"
    )


def test_instance_flags_become_registrations() -> None:
    from rack_sched.cli import static_instances
    from topology.load import load_topology

    topo = load_topology("2x8-a100")
    domain = topo.domains[0]
    first = domain.instances[0]
    (reg,) = static_instances([f"{first.instance_id}=10.0.0.5:7001"], topo, domain.domain_id)
    assert (reg.instance_id, reg.domain_id, reg.node_id, reg.address, reg.model, reg.capacity_blocks) == (
        first.instance_id,
        domain.domain_id,
        first.node_id,
        "10.0.0.5:7001",
        first.model,
        first.kv_capacity_blocks,
    )
    other = topo.domains[1].instances[0].instance_id
    for item, message in [
        ("x", "expected ID=HOST:PORT"),
        (f"{first.instance_id}=h:70000", r"expected ID=HOST:PORT \(port 1-65535\)"),  # was accepted
        ("nope=h:1", "not in topology"),
        (f"{other}=h:1", f"in domain {topo.domains[1].domain_id}, not {domain.domain_id}"),
    ]:
        with pytest.raises(ValueError, match=message):
            static_instances([item], topo, domain.domain_id)
    with pytest.raises(ValueError, match="given twice"):
        static_instances([f"{first.instance_id}=h:1", f"{first.instance_id}=h:2"], topo, domain.domain_id)


def test_cli_reports_an_unknown_domain(capsys: pytest.CaptureFixture[str]) -> None:
    from rack_sched.cli import main

    args = ["--domain-id", "nope", "--listen", "127.0.0.1:0", "--etcd", "127.0.0.1:1", "--topology", "1x8-a100"]
    assert main(args) == 2
    err = capsys.readouterr().err
    # printed as written: a plain KeyError's str() put the whole message in quotes
    assert err.splitlines()[-1] == (
        "rack_sched: error: 1x8-a100.yaml: no domain 'nope'; 1 domain: node-0; did you mean 'node-0'?"
    )


@pytest.mark.parametrize(
    ("error", "status", "words"),
    [
        (TimeoutError("the etcd session was lost"), 1, "etcd at 127.0.0.1:1 stopped answering while the domain"),
        (EtcdError("etcd is gone"), 1, "etcd at 127.0.0.1:1 stopped answering while the domain"),
        (DomainTakenError("domain node-0 already has a live domain scheduler"), 1, "already has a live domain"),
        (ValueError("--ttl must be >= 1"), 2, "--ttl must be >= 1"),
    ],
)
def test_cli_exit_status_tells_the_clusters_state_from_a_bad_configuration(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], error: Exception, status: int, words: str
) -> None:
    # 1: a state a restart may outlast (systemd restarts it); 2: a bad option or file (RestartPreventExitStatus=2)
    import rack_sched.cli

    async def failing(*_: object) -> None:
        raise error

    monkeypatch.setattr(rack_sched.cli, "_serve", failing)
    args = ["--domain-id", "node-0", "--listen", "127.0.0.1:0", "--etcd", "127.0.0.1:1", "--topology", "1x8-a100"]
    assert rack_sched.cli.main(args) == status
    err = capsys.readouterr().err
    assert err.startswith("rack_sched: error: ") and words in err
