"""The engine half's record of what one rank wrote in an update session.

Built inside vLLM's worker (it imports vLLM's layer classes), used by
``transports.gloo``'s engine: see ``build_capture_class``.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from typing import Any

from rolloutcore.transports import rank_checksums

__all__ = ["build_capture_class"]


def build_capture_class() -> type[Any]:
    """``_WriteCapture``: each written parameter's checksum as loaded, and its placement.

    Installed for one update session: every layer's quant method is wrapped so
    that, when vLLM's layerwise reload has replayed all of a layer's loads and
    is about to process the layer (the CPU GEMM repacks its weight there and
    the parameter keeps no bytes), the layer's parameters are hashed
    (``rank_checksums.checksum_of``). Layers without a quant method (norms,
    convolutions) are hashed live at finish: nothing transforms them. The
    report names each parameter's layer kind and tensor-parallel geometry as
    vLLM's layer holds it; the trainer rebuilds the slice from the full
    tensors with its own rules (``rank_checksums.expected``).
    """
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    kinds: dict[type[Any], str] = {
        linear.QKVParallelLinear: "qkv", linear.MergedColumnParallelLinear: "merged",
        linear.ColumnParallelLinear: "column", linear.RowParallelLinear: "row",
        linear.ReplicatedLinear: "whole", vpe.VocabParallelEmbedding: "vocab",
        vpe.ParallelLMHead: "vocab",
    }
    parallel = (linear.LinearBase, vpe.VocabParallelEmbedding)
    attr = "process_weights_after_loading"

    def dtype_name(t: Any) -> str:
        return str(t.dtype).rsplit(".", 1)[-1]

    class _WriteCapture:
        def __init__(self, model: Any) -> None:
            self.model = model
            self.modules = dict(model.named_modules())
            self.names = {id(m): n for n, m in self.modules.items()}
            self.seen: dict[str, tuple[int | None, tuple[int, ...], str, Any, Any]] = {}
            self.elapsed_s = 0.0
            self._wrapped: list[tuple[Any, Any]] = []
            done: set[int] = set()
            for m in self.modules.values():
                qm = getattr(m, "quant_method", None)
                if isinstance(qm, QuantizeMethodBase) and id(qm) not in done:
                    done.add(id(qm))
                    self._wrap(qm)

        def _wrap(self, qm: Any) -> None:
            own = vars(qm).get(attr)
            inner = getattr(qm, attr)

            def process(layer: Any, *args: Any, **kwargs: Any) -> Any:
                self.take(layer)
                return inner(layer, *args, **kwargs)

            setattr(qm, attr, process)
            self._wrapped.append((qm, own))

        def close(self) -> None:
            for qm, own in self._wrapped:
                if own is None:
                    vars(qm).pop(attr, None)
                else:
                    setattr(qm, attr, own)
            self._wrapped = []

        def take(self, layer: Any) -> None:
            mname = self.names.get(id(layer))
            if mname is None:
                return
            t0 = time.monotonic()
            for pname, prm in layer._parameters.items():
                if prm is not None:
                    self.seen[f"{mname}.{pname}" if mname else pname] = self.entry(prm)
            self.elapsed_s += time.monotonic() - t0

        @staticmethod
        def entry(prm: Any) -> tuple[int | None, tuple[int, ...], str, Any, Any]:
            data = prm.data
            value = (None if data.is_meta or data.numel() == 0
                     else rank_checksums.checksum_of(data))
            return (value, tuple(int(d) for d in data.shape), dtype_name(data),
                    getattr(prm, "output_dim", None), getattr(prm, "input_dim", None))

        def report(self, placed: Mapping[str, list[tuple[str, tuple[int, ...]]]],
                   written: set[str], worker_rank: int, nonce: str,
                   wrote: tuple[str, ...] = (), skipped: tuple[str, ...] = (),
                   borrowed: Collection[str] = ()) -> rank_checksums.RankReport:
            """``borrowed``: parameters that are another model's (an EAGLE head's
            embedding and output projection are its target's): not this round's to
            write, so not counted among the model's parameters."""
            from vllm.distributed import (
                get_pp_group,
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            t0 = time.monotonic()
            live = dict(self.model.named_parameters())
            params = []
            for n in sorted(written):
                got = self.seen.get(n)
                if got is None:
                    prm = live.get(n)
                    if prm is None:
                        continue
                    got = self.entry(prm)
                value, shape, dt, odim, idim = got
                mname = n.rpartition(".")[0]
                mod: Any = self.modules.get(mname)
                kind = kinds.get(type(mod), "other" if isinstance(mod, parallel) else "whole")
                qkv = vocab = tp = None
                sizes: tuple[int, ...] = ()
                if kind == "qkv":
                    qkv = (int(mod.num_heads), int(mod.num_kv_heads), int(mod.head_size),
                           int(mod.v_head_size), int(mod.num_kv_head_replicas))
                elif kind == "merged":
                    sizes = tuple(int(x) for x in mod.output_sizes)
                elif kind == "vocab":
                    si = mod.shard_indices
                    if si.added_vocab_end_index > si.added_vocab_start_index:
                        kind = "other"  # rows added beyond the checkpoint's vocabulary
                    vocab = (int(si.org_vocab_start_index), int(si.org_vocab_end_index))
                if isinstance(mod, parallel):
                    tp = (int(getattr(mod, "tp_rank", 0)), int(getattr(mod, "tp_size", 1)))
                params.append(rank_checksums.ParamWrite(
                    n, shape, dt, kind, value,
                    tuple((src, tuple(parts)) for src, parts in placed.get(n, [])),
                    odim if isinstance(odim, int) else None,
                    idim if isinstance(idim, int) else None, sizes, qkv, vocab, tp))
            pp = get_pp_group()
            return rank_checksums.RankReport(
                worker_rank, int(get_tensor_model_parallel_rank()),
                int(get_tensor_model_parallel_world_size()), tuple(params),
                sum(1 for n in live if n not in borrowed),
                self.elapsed_s + time.monotonic() - t0, nonce,
                int(pp.rank_in_group), int(pp.world_size), wrote, skipped)

    return _WriteCapture
