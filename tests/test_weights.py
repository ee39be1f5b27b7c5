"""WeightSource over a module, a state dict and a checkpoint: one manifest, one digest."""

from __future__ import annotations

from pathlib import Path

import pytest

from rolloutcore.core.versions import ParameterManifest
from rolloutcore.errors import BadInput
from rolloutcore.transports.source import WeightSource, dtype_name

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    return m.to(torch.bfloat16)


def test_three_forms_agree(tmp_path: Path) -> None:
    m = _module()
    sd = {k: v.detach().clone() for k, v in m.state_dict().items()}
    safetensors_torch.save_file(sd, str(tmp_path / "model.safetensors"))
    srcs = [WeightSource.of(m), WeightSource.of(sd), WeightSource.of(tmp_path)]
    man = srcs[0].manifest()
    assert isinstance(man, ParameterManifest)
    assert man.names() == ("0.bias", "0.weight", "1.bias", "1.weight")
    assert [p.dtype for p in man.params] == ["bfloat16"] * 4
    assert all(s.manifest() == man for s in srcs)
    assert len({s.content_digest() for s in srcs}) == 1
    assert all(s.nbytes == (3 + 12 + 3 + 3) * 2 for s in srcs)
    names = [n for n, _ in srcs[2].named_tensors()]
    assert names == list(man.names())


def test_digest_sees_every_byte_and_the_dtype() -> None:
    m = _module()
    src = WeightSource.from_module(m)
    before = src.content_digest()
    with torch.no_grad():
        w = m[0].weight
        w.view(torch.int16)[0, 0] ^= 1  # flip the lowest bit of one element
    assert src.content_digest() != before  # a live module is never cached
    sd32 = {k: v.float() for k, v in m.state_dict().items()}
    assert WeightSource.of(sd32).content_digest() != src.content_digest()
    assert WeightSource.of(sd32).manifest().digest != src.manifest().digest


def test_renamed_tensor_changes_digest() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    a = WeightSource.of({"a": t})
    b = WeightSource.of({"b": t})
    c = WeightSource.of({"a": t.reshape(3, 2)})
    assert len({a.content_digest(), b.content_digest(), c.content_digest()}) == 3


def test_shape_change_after_build_is_refused() -> None:
    sd = {"w": torch.zeros(2, 2)}
    src = WeightSource.of(sd)
    sd["w"] = torch.zeros(3)  # the source snapshotted the mapping, not the values
    assert [t.shape for _, t in src.named_tensors()] == [torch.Size([2, 2])]
    m = torch.nn.Linear(2, 2)
    src = WeightSource.of(m)
    m.weight.data = torch.zeros(5, 5)
    with pytest.raises(BadInput, match="manifest"):
        list(src.named_tensors())


@pytest.mark.parametrize("bad", [
    42, "/nonexistent/dir", {}, {"w": [1, 2]}, {"": torch.zeros(1)}, {3: torch.zeros(1)},
])
def test_bad_input(bad: object) -> None:
    with pytest.raises(BadInput):
        WeightSource.of(bad)


def test_checkpoint_dir_problems(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="no"):
        WeightSource.from_checkpoint(tmp_path)
    (tmp_path / "x.safetensors").write_bytes(b"garbage")
    with pytest.raises(BadInput, match="readable"):
        WeightSource.from_checkpoint(tmp_path)
    (tmp_path / "x.safetensors").unlink()
    safetensors_torch.save_file({"w": torch.zeros(1)}, str(tmp_path / "a.safetensors"))
    safetensors_torch.save_file({"w": torch.ones(1)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(BadInput, match="both"):
        WeightSource.from_checkpoint(tmp_path)


def test_dtype_name() -> None:
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_name(torch.float8_e4m3fn) == "float8_e4m3fn"
