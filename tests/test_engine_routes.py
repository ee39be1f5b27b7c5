"""The route table (``rolloutcore.engine.routes``): complete, consistent, and read."""

from __future__ import annotations

from rolloutcore.engine.routes import (
    DATA_ROUTES,
    NEWEST,
    OLDEST,
    TABLE,
    Routes,
    keyless_routes,
    required_routes,
)
from rolloutcore.engine.support import REQUIRED_ROUTES
from rolloutcore.transports.engine_key import OPEN_ROUTES, is_open


def _names() -> dict[str, str]:
    return {k: v for k, v in vars(Routes).items() if k.isupper()}


def test_every_name_has_one_entry_and_every_entry_a_name() -> None:
    names = _names()
    assert len(set(names.values())) == len(names), "two names for one path"
    assert set(names.values()) == set(TABLE)


def test_entries_are_well_formed() -> None:
    for path, r in TABLE.items():
        assert r.path == path and path.startswith("/") and "?" not in path
        assert r.method in ("GET", "POST"), path
        assert OLDEST <= r.since <= NEWEST, path
        assert r.until is None or r.since <= r.until < NEWEST, path
        assert not (r.keyless and r.mutates), f"{path}: a mutating route is never keyless"
        assert not r.required or r.purpose, f"{path}: a required route says what for"
        if r.keyless:
            assert r.method in r.keyless, path


def test_versions() -> None:
    assert TABLE[Routes.PAUSE].served_by((0, 26))
    assert not TABLE[Routes.WEIGHT_INFO].served_by((0, 26))  # 0.26 has no weight version
    assert TABLE[Routes.WEIGHT_INFO].served_by((0, 34))
    assert not TABLE[Routes.CHECKPOINT_STATUS].served_by((0, 33))
    assert TABLE[Routes.CHECKPOINT_STATUS].served_by((0, 34))
    assert TABLE[Routes.FAULT_TOLERANCE_STATUS].served_by((0, 33))
    assert not TABLE[Routes.FAULT_TOLERANCE_STATUS].served_by((0, 34))
    assert TABLE[Routes.V1_FAULT_TOLERANCE_STATUS].served_by((0, 34))
    for r in TABLE.values():
        if r.required:
            assert all(r.served_by((0, m)) for m in range(OLDEST[1], NEWEST[1] + 1)), r.path


def test_readers_take_the_table() -> None:
    """Support detection and the route guard read the table, not their own lists."""
    assert dict(REQUIRED_ROUTES) == dict(required_routes())
    assert list(REQUIRED_ROUTES) == [Routes.PAUSE, Routes.RESUME, Routes.START_UPDATE,
                                     Routes.UPDATE_WEIGHTS, Routes.FINISH_UPDATE,
                                     Routes.RESET_PREFIX]
    assert dict(OPEN_ROUTES) == dict(keyless_routes())
    assert is_open("GET", Routes.HEALTH) and is_open("POST", Routes.GENERATE)
    assert not is_open("POST", Routes.PAUSE) and not is_open("GET", Routes.WEIGHT_INFO)
    assert not is_open("POST", Routes.LOAD_LORA)
    for path in DATA_ROUTES:
        assert TABLE[path].method == "POST" and not TABLE[path].mutates
