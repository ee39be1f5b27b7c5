"""Version-aware routing (``fleet.routing``), pure: policies, eligibility, balance, groups."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rolloutcore.fleet.routing import (
    FleetView,
    Policy,
    PolicyKind,
    ReplicaView,
    Router,
    RouteRefused,
    eligible,
    group_key,
    request_policy,
)


def view(*reps: tuple[str, bool, int | None, int], newest: int | None = 2,
         closed: str | None = None) -> FleetView:
    labels = {f"fleet-{g}": g for g in range((newest or 0) + 1)} if newest is not None else {}
    return FleetView(tuple(ReplicaView(*r) for r in reps), newest, labels, closed, 2.0)


ROLL = view(("a", True, 2, 0), ("b", True, 1, 0), ("c", False, 2, 0), ("d", True, 0, 0))


@pytest.mark.parametrize("text,kind,value", [
    ("latest", PolicyKind.LATEST, None), ("ANY", PolicyKind.ANY, None),
    (" min-version:3 ", PolicyKind.MIN_VERSION, 3),
    ("max-staleness:0", PolicyKind.MAX_STALENESS, 0),
    ("pinned:fleet-1", PolicyKind.PINNED, "fleet-1"),
])
def test_policies_parse(text: str, kind: PolicyKind, value: object) -> None:
    p = Policy.parse(text)
    assert (p.kind, p.value) == (kind, value)
    assert Policy.parse(str(p)) == p


@pytest.mark.parametrize("text", ["", "newest", "latest:1", "min-version", "min-version:",
                                  "min-version:-1", "min-version:1.5", "min-version:01",
                                  "max-staleness:x", "pinned:", "pinned:bad label", 7, None,
                                  "pinned:" + "x" * 200])
def test_malformed_policies_are_a_400(text: object) -> None:
    with pytest.raises(RouteRefused) as ei:
        Policy.parse(text)
    assert ei.value.status == 400


def test_each_policy_picks_its_replicas() -> None:
    def names(p: str) -> set[str]:
        return {r.name for r in eligible(ROLL, Policy.parse(p))}

    assert names("latest") == {"a"}                 # c holds 2 but is out of the pool
    assert names("any") == {"a", "b", "d"}
    assert names("min-version:1") == {"a", "b"}
    assert names("max-staleness:0") == {"a"}
    assert names("max-staleness:1") == {"a", "b"}
    assert names("pinned:fleet-1") == {"b"}
    assert names("pinned:fleet-0") == {"d"}


@pytest.mark.parametrize("policy,status", [
    ("min-version:3", 409), ("pinned:fleet-9", 404), ("pinned:other", 404)])
def test_requests_that_can_never_be_served_are_4xx(policy: str, status: int) -> None:
    with pytest.raises(RouteRefused) as ei:
        eligible(ROLL, Policy.parse(policy))
    assert ei.value.status == status and ei.value.retry_after_s is None


def test_a_retired_pinned_version_is_gone_and_an_unserved_one_waits() -> None:
    v = view(("a", True, 2, 0), ("b", False, 1, 0), newest=2)
    with pytest.raises(RouteRefused) as ei:
        eligible(v, Policy.parse("pinned:fleet-0"))
    assert ei.value.status == 410
    with pytest.raises(RouteRefused) as ei:
        eligible(v, Policy.parse("pinned:fleet-1"))   # held, but not serving now
    assert ei.value.status == 503 and ei.value.retry_after_s == 2.0


def test_closed_fleet_and_empty_pool_are_503_with_retry_after() -> None:
    for v in (view(("a", True, 2, 0), closed="synchronous update 3"),
              view(("a", False, 2, 0)), view(("a", True, None, 0), newest=None)):
        for p in ("any", "latest"):
            with pytest.raises(RouteRefused) as ei:
                eligible(v, Policy.parse(p))
            assert ei.value.status == 503 and ei.value.retry_after_s == 2.0


def test_router_balances_by_load_and_takes_turns_on_ties() -> None:
    r = Router()
    v = view(("a", True, 2, 3), ("b", True, 2, 1), ("c", True, 2, 1))
    picks = [r.choose(v, Policy.parse("latest")).name for _ in range(4)]
    assert set(picks) == {"b", "c"}


def test_a_group_sticks_to_its_replica_while_it_is_eligible() -> None:
    r = Router()
    v = view(("a", True, 2, 0), ("b", True, 2, 0))
    first = r.choose(v, Policy.parse("any"), group="g:1").name
    busy = view(*[(n, True, 2, 9 if n == first else 0) for n in ("a", "b")])
    assert r.choose(busy, Policy.parse("any"), group="g:1").name == first
    other = "b" if first == "a" else "a"
    gone = view(*[(n, n != first, 2, 0) for n in ("a", "b")])
    assert r.choose(gone, Policy.parse("any"), group="g:1").name == other   # re-stuck
    assert r.choose(v, Policy.parse("any"), group="g:1").name == other


def test_request_policy_from_header_or_body_field() -> None:
    d = Policy.parse("latest")
    assert request_policy(None, {}, d) == d
    assert request_policy("any", {}, d) == Policy.parse("any")
    assert request_policy(None, {"rolloutcore_policy": "min-version:1"}, d).value == 1
    assert request_policy("any", {"rolloutcore_policy": "any"}, d).kind is PolicyKind.ANY
    for h, b in (("any", {"rolloutcore_policy": "latest"}), (None, {"rolloutcore_policy": 3}),
                 ("bogus", {})):
        with pytest.raises(RouteRefused) as ei:
            request_policy(h, b, d)
        assert ei.value.status == 400


def test_group_keys() -> None:
    assert group_key("run7/p3", {}) == "g:run7/p3"
    assert group_key(None, {"rolloutcore_group": "x"}) == "g:x"
    same = group_key(None, {"token_ids": [1, 2], "sampling_params": {"n": 4}})
    assert same and same == group_key(None, {"token_ids": [1, 2], "sampling_params": {"n": 8}})
    assert same != group_key(None, {"token_ids": [1, 3], "sampling_params": {"n": 4}})
    assert group_key(None, {"prompt": "hi", "n": 2}) is not None
    assert group_key(None, {"prompt": "hi", "n": 1}) is None
    for h, b in (("bad group", {}), (None, {"rolloutcore_group": 5}),
                 ("a", {"rolloutcore_group": "b"})):
        with pytest.raises(RouteRefused) as ei:
            group_key(h, b)
        assert ei.value.status == 400


@given(st.lists(st.tuples(st.booleans(), st.one_of(st.none(), st.integers(0, 4)),
                          st.integers(0, 5)), min_size=1, max_size=6),
       st.integers(0, 4), st.sampled_from(["latest", "any", "min-version:2",
                                           "max-staleness:1", "pinned:fleet-3"]))
def test_the_router_never_picks_a_replica_outside_the_pool_or_the_policy(
        reps: list[tuple[bool, int | None, int]], newest: int, policy: str) -> None:
    v = view(*[(f"r{i}", p, g, load) for i, (p, g, load) in enumerate(reps)], newest=newest)
    pol = Policy.parse(policy)
    try:
        got = Router().choose(v, pol)
    except RouteRefused as exc:
        assert exc.status in (404, 409, 410, 503)
        return
    assert got.in_pool and got.generation is not None
    ok = {r.name for r in eligible(v, pol)}
    assert got.name in ok
    low = min(r.load for r in v.replicas if r.name in ok)
    assert got.load == low
