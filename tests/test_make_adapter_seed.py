"""``testing.models.make_adapter``: one seed is one adapter, whatever ran before.

PEFT draws ``lora_A`` from torch's global generator; an adapter that took whatever an
earlier test left there made probe-tolerance tests pass or fail with test order.
"""

from __future__ import annotations

from pathlib import Path

from helpers.needs import installed

installed("peft")


def _lora(m: object) -> dict[str, object]:
    return {n: p.detach().clone() for n, p in m.named_parameters()  # type: ignore[attr-defined]
            if "lora_" in n}


def test_one_seed_is_one_adapter_whatever_the_global_generator_holds(tmp_path: Path) -> None:
    import torch

    from rolloutcore.testing.models import make_adapter, make_checkpoint

    base = make_checkpoint(tmp_path / "base", 1)
    torch.manual_seed(123)
    a = _lora(make_adapter(base, 5, rank=4))
    torch.manual_seed(456)
    state = torch.random.get_rng_state()
    b = _lora(make_adapter(base, 5, rank=4))
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's draws untouched
    c = _lora(make_adapter(base, 6, rank=4))
    assert a.keys() == b.keys() and any("lora_A" in n for n in a)
    assert all(torch.equal(a[n], b[n]) for n in a)  # type: ignore[arg-type]
    assert not all(torch.equal(a[n], c[n]) for n in a if "lora_A" in n)  # type: ignore[arg-type]
