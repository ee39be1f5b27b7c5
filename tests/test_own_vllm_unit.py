"""``serve --upstream`` names what a vLLM the user started lacks (#48, docs/own-vllm.md)."""

from __future__ import annotations

import pytest

from rolloutcore.errors import EngineUnavailable
from rolloutcore.service.own_vllm import check_upstream

GEN = frozenset({"/inference/v1/generate"})


def _info(backend: str | None) -> dict[str, object]:
    wt = None if backend is None else {"backend": backend}
    return {"vllm_config": {"weight_transfer_config": wt}}


def test_the_right_backend_passes() -> None:
    assert check_upstream(_info("rolloutcore_gloo"), GEN, "rolloutcore_gloo") == []


@pytest.mark.parametrize(("backend", "said"), [
    (None, "started without a weight-transfer backend"),
    ("nccl", "started with the weight-transfer backend 'nccl'"),
])
def test_a_missing_or_other_backend_is_named(backend: str | None, said: str) -> None:
    with pytest.raises(EngineUnavailable, match=said) as exc:
        check_upstream(_info(backend), GEN, "rolloutcore_gloo")
    assert "--weight-transfer-config '{\"backend\": \"rolloutcore_gloo\"}'" in str(exc.value)
    assert "docs/own-vllm.md" in str(exc.value)


def test_what_lowers_verification_is_a_warning() -> None:
    w = check_upstream(_info("rolloutcore_gloo"), frozenset(), "rolloutcore_gloo")
    assert len(w) == 1 and "--enable-scale-out" in w[0]
    w = check_upstream(None, GEN, "rolloutcore_gloo")
    assert len(w) == 1 and "no /server_info" in w[0]
