"""Two model loads in threads must not leave transformers' process-wide patches behind.

transformers patches ``PreTrainedModel.tie_weights`` and the ``torch.nn.init``
functions while it loads and puts back what it saw on entry: overlapping loads
in threads put back each other's patch (``verification.hf_load``). Every load
RolloutCore does holds ``HF_LOCK``; here two probes are computed from a
checkpoint in two threads at once, several times, and the patched attributes
must be the originals afterwards (a tied checkpoint built after them is tied).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from helpers.needs import installed
from rolloutcore.testing.models import make_checkpoint
from rolloutcore.verification.probe import PolicyProbe

torch = pytest.importorskip("torch")
installed("transformers")


def test_concurrent_loads_leave_tying_and_init_as_they_were(tmp_path: Path) -> None:
    from transformers.modeling_utils import PreTrainedModel

    ckpt = make_checkpoint(tmp_path / "a", 0)
    tie, normal = PreTrainedModel.tie_weights, torch.nn.init.normal_
    errors: list[BaseException] = []
    for _ in range(4):
        gate = threading.Barrier(2)

        def load(gate: threading.Barrier = gate) -> None:
            try:
                gate.wait(10)
                PolicyProbe.from_checkpoint(ckpt, new_tokens=2)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=load) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == []
        assert PreTrainedModel.tie_weights is tie
        assert torch.nn.init.normal_ is normal
    make_checkpoint(tmp_path / "tied", 0, tie_word_embeddings=True)  # raises if untied
