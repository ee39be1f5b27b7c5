"""A restored adapter is published again only on the base it was verified on (#47, 6).

After A -> B and adapter Y published for B, rerunning ``serve --lora --model A
--journal J`` republished Y on A: ``policy`` answered through a (base, adapter)
pair nobody published. The restore checked the adapter's digest, not its base.
Now the base's identity the journal committed under Y's base label is compared
(content digests) with the base served now. The engines are
``testing.peft_scorer.peft_vllm`` under the real ``AdapterManager`` and a fake
fleet's replica controller, whose base is updated for real (A -> B).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fleettools import fake_fleet, weights
from helpers.fault_matrix import PromiseRows
from helpers.needs import installed
from rolloutcore.control.adapters import AdapterManager
from rolloutcore.control.journal import Journal, read_journal
from rolloutcore.core.records import Commit
from rolloutcore.core.versions import Provenance

installed("peft")
MATRIX = PromiseRows("tests/test_adapter_restore_base.py",
                     engines="FakeVllm (the tiny model through PEFT) under the real "
                             "AdapterManager; a fake fleet replica's controller")
_fault_matrix = MATRIX.fixture()


@pytest.fixture
def published_on_b(tmp_path: Path, one_torch_thread: None) -> Any:
    """A journal whose adapter was published on base B (rc-1, after A -> B)."""
    from rolloutcore.testing.models import make_adapter, make_checkpoint
    from rolloutcore.testing.peft_scorer import peft_vllm

    base = make_checkpoint(tmp_path / "base", 0)
    make_adapter(base, 1, rank=4).save_pretrained(tmp_path / "a1")
    f = fake_fleet(1)
    f.coord.update(weights(1))                  # A -> B: the base is rc-1 now
    rep = f.coord.replicas["r0"]
    c = rep.controller
    assert c.committed.label != "default"
    jpath = tmp_path / "journal.jsonl"
    j = Journal(jpath)
    j.write(Commit(c.committed, c.identity))    # the gateway's journal has the base's commit
    m = AdapterManager(peft_vllm(base)[1], c, base_model=base, store=tmp_path / "store",
                       listener=j.listener, max_rank=8)
    y = m.update(tmp_path / "a1", Provenance("adapter", "tests", 1)).version
    assert y.base == c.committed.label
    j.close()
    try:
        yield base, jpath, y, f
    finally:
        f.coord.close()


def test_a_restart_on_another_base_does_not_republish_the_adapter(
        published_on_b: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rolloutcore.service.serve import _restore_adapters
    from rolloutcore.testing.peft_scorer import peft_vllm

    base, jpath, y, _ = published_on_b
    g = fake_fleet(1)                           # the restart: the engine on A again
    try:
        c = g.coord.replicas["r0"].controller
        assert c.identity.content_digest != read_journal(jpath)[0].record.identity.content_digest
        fake, eng = peft_vllm(base)
        m = AdapterManager(eng, c, base_model=base, store=tmp_path / "store2", max_rank=8)
        _restore_adapters(m, str(jpath))
        assert m.current is None and fake.loras == {}    # nothing loaded, nothing routed
        assert m.is_adapter(y.name)                        # its name stays refused
        err = capsys.readouterr().err
        assert f"the journal's adapter {y.name} was not published again" in err
        assert f"verified on base {y.base}" in err
        m.close()
    finally:
        g.coord.close()
    MATRIX.row("lora_restore_other_base",
               "a LoRA gateway restarted on its journal with --model A after A -> B and "
               "adapter Y published for B", "Y not republished (its base's content digest "
               "differs from the served base's); policy is the base's until an adapter is "
               "published", "READY (no adapter)", published_unvalidated=0, records_lost=0)


def test_a_restart_on_the_same_base_republishes_it(published_on_b: Any, tmp_path: Path) -> None:
    from rolloutcore.service.serve import _restore_adapters
    from rolloutcore.testing.peft_scorer import peft_vllm

    base, jpath, y, f = published_on_b
    fake, eng = peft_vllm(base)                 # the same base (B): a new engine
    m = AdapterManager(eng, f.coord.replicas["r0"].controller, base_model=base,
                       store=tmp_path / "store3", max_rank=8)
    _restore_adapters(m, str(jpath))
    assert m.current is not None and m.current.content_digest == y.content_digest
    assert set(fake.loras) == {m.current.name}
    m.close()
