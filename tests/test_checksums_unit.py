"""Engine-checksum comparison, references and their cache, without an engine.

The comparison (``verification.checksums``) is pure; the cache and the
reference taking (``engine.verify``) run here on files and fakes. The
real ``/weight_checker`` (CPU repacking, rank-prefixed keys, a cold-loaded
reference after a real hot update) is exercised in
``tests/engine/test_checksum_engine.py``. Keys and
digests here have the shape vLLM 0.32 gives them, including a tensor-parallel
layout (two ranks hashing their own shards of the same parameter), which the
CPU engine cannot produce.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from rolloutcore.core.evidence import Check
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.engine.verify import (
    ChecksumCache,
    engine_layout,
    reference_checksums,
    take_reference,
)
from rolloutcore.errors import BadInput, JournalError
from rolloutcore.verification import checksums as vc
from rolloutcore.verification.checksums import (
    EMPTY_SHA256,
    LAYOUT_FIELDS,
    ReferenceChecksums,
    WeightChecksums,
    compare,
    compare_lists,
    layout_digest,
    verify,
)

R0 = "dp0:pp0:pcp0:tp0:"
R1 = "dp0:pp0:pcp0:tp1:"
LAYOUT: dict[str, Any] = {"vllm_version": "0.32.0", "dtype": "torch.bfloat16",
                          "device": "cpu", "tensor_parallel_size": 1, "quantization": None}


def h(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


def engine_map() -> dict[str, str]:
    """Like the CPU engine: embeddings and norms hash, fused linear layers do not."""
    return {R0 + "model.embed_tokens.weight": h("emb"), R0 + "lm_head.weight": h("head"),
            R0 + "model.norm.weight": h("norm"),
            R0 + "model.layers.0.self_attn.qkv_proj.weight": EMPTY_SHA256,
            R0 + "model.layers.0.mlp.gate_up_proj.weight": EMPTY_SHA256}


def ref(checksums: dict[str, str] | None = None, **kw: Any) -> ReferenceChecksums:
    return ReferenceChecksums(h("content"), kw.pop("layout", LAYOUT),
                              checksums or engine_map(), **kw)


# --------------------------------------------------------------------------- verify


def test_identical_checksums_match_on_the_hashable_parameters_only() -> None:
    r = verify(engine_map(), engine_map())
    assert r.passed and r.keyed_by == "raw"
    assert r.engine_params == 5 and r.hashable == 3 and r.compared == 3
    assert set(r.matched) == {R0 + "model.embed_tokens.weight", R0 + "lm_head.weight",
                              R0 + "model.norm.weight"}
    # Both sides say "e3b0..." for the fused layers: that is not a match.
    assert len(r.unverifiable) == 2 and not set(r.unverifiable) & set(r.matched)
    assert r.coverage == pytest.approx(3 / 5)
    assert "3/5 engine parameters matched" in r.detail() and "2 unverifiable" in r.detail()


def test_a_different_checkpoint_mismatches_and_fails() -> None:
    other = engine_map()
    other[R0 + "lm_head.weight"] = h("other head")
    r = verify(engine_map(), other)
    assert not r.passed and r.mismatched == (R0 + "lm_head.weight",)
    assert r.compared == 3 and len(r.matched) == 2
    assert "1 MISMATCHED" in r.detail() and "lm_head" in r.detail()


def test_keys_on_one_side_only_are_counted_and_fail() -> None:
    eng = engine_map()
    reference = engine_map()
    del reference[R0 + "model.norm.weight"]                     # engine has, reference lacks
    reference[R0 + "model.extra.weight"] = h("x")               # reference has, engine lacks
    r = verify(eng, reference)
    assert r.missing_in_reference == (R0 + "model.norm.weight",)
    assert r.missing_in_engine == (R0 + "model.extra.weight",)
    assert r.compared == 2 and not r.mismatched and not r.passed
    assert "1 missing in engine" in r.detail() and "1 without reference" in r.detail()


def test_an_unhashable_parameter_without_reference_is_unverifiable_not_missing() -> None:
    reference = engine_map()
    del reference[R0 + "model.layers.0.self_attn.qkv_proj.weight"]
    r = verify(engine_map(), reference)
    assert r.passed and not r.missing_in_reference
    assert R0 + "model.layers.0.self_attn.qkv_proj.weight" in r.unverifiable


def test_a_zero_byte_reference_never_matches_a_real_hash() -> None:
    reference = engine_map()
    reference[R0 + "lm_head.weight"] = EMPTY_SHA256
    r = verify(engine_map(), reference)
    assert r.unverifiable_reference == (R0 + "lm_head.weight",)
    assert R0 + "lm_head.weight" not in r.matched and r.compared == 2
    assert "unverifiable in the reference" in r.detail()


def test_nothing_compared_never_passes() -> None:
    fused = {k: v for k, v in engine_map().items() if v == EMPTY_SHA256}
    r = verify(fused, fused)
    assert r.compared == 0 and r.coverage == 0.0 and not r.passed
    assert "nothing compared" in r.detail()


def test_tensor_parallel_shards_are_compared_per_rank() -> None:
    eng = {R0 + "lm_head.weight": h("shard0"), R1 + "lm_head.weight": h("shard1")}
    assert verify(eng, dict(eng)).passed
    swapped = {R0 + "lm_head.weight": h("shard1"), R1 + "lm_head.weight": h("shard0")}
    r = verify(eng, swapped)
    assert not r.passed and len(r.mismatched) == 2
    # A reference keyed by bare names cannot say which shard it means.
    with pytest.raises(BadInput, match="several ranks"):
        verify(eng, {"lm_head.weight": h("shard0")})


def test_bare_name_reference_against_one_rank() -> None:
    by_name = {k.removeprefix(R0): v for k, v in engine_map().items()}
    r = verify(engine_map(), by_name)
    assert r.passed and r.keyed_by == "name" and "lm_head.weight" in r.matched


def test_weight_checksums_from_the_client_are_accepted() -> None:
    raw = engine_map()
    cs = WeightChecksums({k.removeprefix(R0): v for k, v in raw.items()},
                         {k.removeprefix(R0): k for k in raw})
    r = verify(cs, ref())
    assert r.passed and r.keyed_by == "raw" and r.coverage == pytest.approx(0.6)


def test_check_states_level_and_coverage() -> None:
    good = verify(engine_map(), engine_map()).to_check()
    assert isinstance(good, Check) and good.passed
    assert good.level is VerificationLevel.ENGINE_CHECKSUM
    assert good.coverage == pytest.approx(0.6) and good.name == "engine_checksum"
    other = engine_map()
    other[R0 + "model.norm.weight"] = h("x")
    bad = verify(engine_map(), other).to_check("ck")
    assert not bad.passed and bad.name == "ck" and "MISMATCHED" in bad.detail


@pytest.mark.parametrize("bad", [{}, {"k": "nothex"}, {"k": 5}, {"": h("x")}, "x", None])
def test_malformed_checksum_maps_are_bad_input(bad: Any) -> None:
    with pytest.raises(BadInput):
        verify(bad, engine_map())
    with pytest.raises(BadInput):
        verify(engine_map(), bad)


def test_to_dict_is_json() -> None:
    d = verify(engine_map(), engine_map()).to_dict()
    assert json.loads(json.dumps(d))["coverage"] == pytest.approx(0.6)
    assert d["passed"] is True and d["hashable"] == 3


# --------------------------------------------------------------------------- references


def test_reference_round_trip_and_properties() -> None:
    r = ref(origin="verified-load", source="ckpt-b")
    back = ReferenceChecksums.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back == r and back.layout_digest == layout_digest(LAYOUT)
    assert len(r.unverifiable) == 2 and r.coverage == pytest.approx(0.6)


@pytest.mark.parametrize("change", [
    {"content_digest": "abc"}, {"origin": "hearsay"}, {"checksums": {}},
    {"layout": {"dtype": object()}}, {"layout": {1: "x"}}, {"taken_wall": float("nan")},
])
def test_invalid_references_cannot_be_built(change: dict[str, Any]) -> None:
    kw: dict[str, Any] = {"content_digest": h("c"), "layout": LAYOUT,
                          "checksums": engine_map()}
    kw.update(change)
    with pytest.raises(BadInput):
        ReferenceChecksums(**kw)


def test_tampered_or_unknown_documents_are_refused() -> None:
    d = ref().to_dict()
    d["layout"] = {**LAYOUT, "dtype": "torch.float16"}
    with pytest.raises(BadInput, match="layout_digest"):
        ReferenceChecksums.from_dict(d)
    with pytest.raises(BadInput, match="format_version"):
        ReferenceChecksums.from_dict({**ref().to_dict(), "format_version": 2})
    with pytest.raises(BadInput, match="not a"):
        ReferenceChecksums.from_dict({"checksums": {}})


def test_layout_digest_is_canonical_and_sensitive() -> None:
    assert layout_digest(dict(reversed(list(LAYOUT.items())))) == layout_digest(LAYOUT)
    assert layout_digest({**LAYOUT, "dtype": "torch.float16"}) != layout_digest(LAYOUT)
    assert layout_digest({**LAYOUT, "tensor_parallel_size": 2}) != layout_digest(LAYOUT)
    assert {"dtype", "tensor_parallel_size", "device"} <= set(LAYOUT_FIELDS)


def test_engine_layout_needs_a_client() -> None:
    with pytest.raises(BadInput):
        engine_layout("http://x")  # type: ignore[arg-type]
    with pytest.raises(BadInput):
        take_reference("http://x", h("c"))  # type: ignore[arg-type]


def test_verification_does_no_io_and_imports_no_adapter() -> None:
    """verification may not reach the engine package, control or transports, nor start anything."""
    import ast

    tree = ast.parse(Path(vc.__file__).read_text())
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in mods if m.startswith(("rolloutcore.engine", "rolloutcore.control",
                                                  "rolloutcore.transports"))}
    assert not mods & {"os", "subprocess", "socket", "tempfile", "pathlib", "httpx"}


# --------------------------------------------------------------------------- cache


def test_cache_round_trip_keyed_by_content_and_layout(tmp_path: Path) -> None:
    cache = ChecksumCache(tmp_path / "cache")
    r = ref()
    assert cache.get(r.content_digest, LAYOUT) is None
    p = cache.put(r)
    assert p.parent.name == r.content_digest and p.name == f"{r.layout_digest}.json"
    assert cache.get(r.content_digest, LAYOUT) == r
    assert cache.get(r.content_digest, {**LAYOUT, "dtype": "torch.float16"}) is None
    assert cache.get(h("other"), LAYOUT) is None
    assert not [x for x in p.parent.iterdir() if x.name.endswith(".tmp")]
    again = ReferenceChecksums(r.content_digest, LAYOUT, engine_map(), taken_wall=1.0)
    cache.put(again)  # replaces atomically
    assert cache.get(r.content_digest, LAYOUT) == again


def test_a_corrupt_or_misplaced_cache_file_is_an_error_not_a_miss(tmp_path: Path) -> None:
    cache = ChecksumCache(tmp_path)
    r = ref()
    p = cache.put(r)
    p.write_text("{not json")
    with pytest.raises(JournalError, match="unreadable"):
        cache.get(r.content_digest, LAYOUT)
    # A valid reference of another checkpoint stored under this one's name.
    other = ReferenceChecksums(h("other"), LAYOUT, engine_map())
    p.write_text(json.dumps(other.to_dict()))
    with pytest.raises(JournalError, match="does not hold"):
        cache.get(r.content_digest, LAYOUT)


def test_cache_bad_input(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(BadInput):
        ChecksumCache(f)
    with pytest.raises(BadInput):
        ChecksumCache(tmp_path).get("abc", LAYOUT)
    with pytest.raises(BadInput):
        ChecksumCache(tmp_path).put({"not": "a reference"})  # type: ignore[arg-type]


def _tiny_checkpoint(d: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    d.mkdir()
    (d / "config.json").write_text("{}")
    save_file({"w": torch.arange(6, dtype=torch.float32)}, str(d / "model.safetensors"))
    return d


def test_reference_checksums_reuses_a_cached_reference_without_starting(
        tmp_path: Path) -> None:
    from rolloutcore.transports.source import WeightSource

    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    digest = WeightSource.from_checkpoint(ckpt).content_digest()
    cache = ChecksumCache(tmp_path / "cache")
    cached = ReferenceChecksums(digest, LAYOUT, engine_map(), source=str(ckpt))
    cache.put(cached)

    def no_launch(_: Path) -> Any:
        raise AssertionError("a cached reference must not start an engine")

    assert reference_checksums(ckpt, cache=cache, layout=LAYOUT, launch=no_launch) == cached
    # The cache is keyed by content: the same bytes elsewhere hit it too.
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in ckpt.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert reference_checksums(copy, cache=str(tmp_path / "cache"), layout=LAYOUT,
                               launch=no_launch) == cached


def test_reference_checksums_bad_input(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match=r"no config\.json"):
        reference_checksums(tmp_path)
    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    with pytest.raises(BadInput):
        reference_checksums(ckpt, layout={"dtype": ["not", "scalar"]})


# --------------------------------------------------------------------------- the one comparison


def test_compare_never_counts_a_value_that_verifies_nothing() -> None:
    r = compare({"a": 1, "b": None, "c": EMPTY_SHA256, "d": 4, "e": 5},
                {"a": 1, "b": None, "c": EMPTY_SHA256, "d": None, "e": 6, "f": 7})
    assert r.matched == ("a",) and r.mismatched == ("e",)
    assert r.unverifiable == ("b", "c") and r.unverifiable_reference == ("d",)
    assert r.missing_in_engine == ("f",) and r.compared == 2
    assert r.coverage == pytest.approx(2 / 5) and not r.passed and not r.complete


def test_compare_keeps_the_callers_order_and_complete_means_everything() -> None:
    names = ["z", "a", "m"]
    r = compare(dict(zip(names, [3, 1, 2], strict=True)),
                dict(zip(names, [0, 1, 0], strict=True)))
    assert r.mismatched == ("z", "m")  # engine order, not sorted
    same = compare({"a": 1, "b": 2}, {"b": 2, "a": 1})
    assert same.passed and same.complete and same.coverage == 1.0
    # passed tolerates what cannot be hashed (the CPU engine's fused layers); complete not.
    part = compare({"a": 1, "b": None}, {"a": 1, "b": 2})
    assert part.passed and not part.complete and part.coverage == 0.5
    assert not compare({}, {}).passed and not compare({}, {}).complete


def test_compare_lists_needs_the_same_layout() -> None:
    r = compare_lists(["a", "b"], [1, 2], ["a", "b"], [1, 2])
    assert r.complete and r.keyed_by == "position"
    moved = compare_lists(["b", "a"], [2, 1], ["a", "b"], [1, 2])
    assert not moved.passed and not moved.complete and moved.compared == 0
    assert moved.layout_mismatch and moved.coverage == 0.0
    with pytest.raises(BadInput, match="values"):
        compare_lists(["a"], [], ["a"], [1])
    with pytest.raises(BadInput, match="duplicate"):
        compare_lists(["a", "a"], [1, 1], ["a", "a"], [1, 1])


def _sums(**d: str) -> vc.WeightChecksums:
    return vc.WeightChecksums(d, {k: f"dp0:pp0:pcp0:tp0:{k}" for k in d})


def test_compare_checksums_view_never_counts_zero_bytes_as_a_match() -> None:
    eng = _sums(a="1" * 64, b="2" * 64, fused=EMPTY_SHA256, c="3" * 64)
    cmp = vc.compare_checksums(eng, {"a": "1" * 64, "b": "2" * 64, "fused": EMPTY_SHA256})
    assert cmp.matched == ("a", "b") and cmp.unverifiable == ("fused",)
    assert cmp.no_reference == ("c",) and cmp.passed and cmp.coverage == 0.5
    chk = cmp.to_check()
    assert chk.passed and chk.level is VerificationLevel.ENGINE_CHECKSUM
    assert "1 unverifiable" in chk.detail and "1 without reference" in chk.detail
    # A reference that hashed zero bytes where the engine hashed content: a mismatch.
    assert vc.compare_checksums(eng, {"a": EMPTY_SHA256}).mismatched == ("a",)
    assert vc.compare_checksums(eng, {"dp0:pp0:pcp0:tp0:a": "1" * 64}).matched == ("a",)
    missing = vc.compare_checksums(eng, {"a": "1" * 64, "gone": "1" * 64})
    assert not missing.passed and missing.missing_in_engine == ("gone",)
    with pytest.raises(BadInput):
        vc.compare_checksums(eng, {"a": 1})  # type: ignore[dict-item]


def test_strip_rank() -> None:
    assert vc.strip_rank(R0 + "model.x") == "model.x"
    assert vc.strip_rank("model.x") == "model.x"


# ------------------------------------------------------------- serve --takeover-checksums


def test_serve_reads_takeover_checksums_or_refuses_the_file_with_the_reason(
        tmp_path: Path) -> None:
    """``serve --takeover-checksums FILE`` (#47 symptom 2's content evidence from the command
    line): a saved reference is read back whole; a missing, garbled or foreign file is
    refused with the option and the reason, before anything starts."""
    import json

    from rolloutcore.errors import BadInput
    from rolloutcore.service.serve import _takeover_checksums

    assert _takeover_checksums(None) is None
    saved = ref(taken_wall=1.0)
    good = tmp_path / "ref.json"
    good.write_text(json.dumps(saved.to_dict()))
    back = _takeover_checksums(str(good))
    assert isinstance(back, ReferenceChecksums) and back.to_dict() == saved.to_dict()
    garbled = tmp_path / "garbled.json"
    garbled.write_text("{not json")
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"format": "something-else"}))
    forged = tmp_path / "forged.json"
    forged.write_text(json.dumps({**saved.to_dict(), "layout_digest": h("forged")}))
    for bad, why in ((tmp_path / "missing.json", "No such file"), (garbled, "Expecting"),
                     (foreign, "not a"), (forged, "layout_digest")):
        with pytest.raises(BadInput, match="--takeover-checksums") as exc:
            _takeover_checksums(str(bad))
        assert why in str(exc.value)
