"""What the gateway learns from the llumlets' registrations: the sampling features every instance of a model
honours (the intersection), and "not known" when any registration does not say."""

from __future__ import annotations

from clusterstate.records import InstanceRegistration
from gateway.cluster import features_by_model


def reg(iid: str, model: str, engine: str, *features: str) -> InstanceRegistration:
    return InstanceRegistration(iid, "d", "n", f"h:{iid}", model, 100, engine, tuple(features))


def test_features_are_the_intersection_per_model() -> None:
    regs = [
        reg("a", "m", "torch", "logprobs", "penalties", "top_k"),
        reg("b", "m", "sim", "penalties", "top_k", "min_tokens"),
        reg("c", "other", "torch", "logprobs"),
        reg("d", "old", ""),  # a llumlet that does not say
        reg("e", "old", "torch", "logprobs"),
    ]
    assert features_by_model(regs) == {
        "m": frozenset({"penalties", "top_k"}),  # a request lands on either: only what both do
        "other": frozenset({"logprobs"}),
        "old": None,
    }
    assert features_by_model([]) == {}
