"""The TRL integration's fast-lane fakes: an ``EngineSession`` over the fake engine, and Ctrl-C.

``FakeSession`` has what ``integrations.trl.engines._SessionEngine`` uses of an
``EngineSession`` (``controller``, ``runner``, ``journal``, ``http.generate``,
``update``, ``close``), built from the real controller, runner and journal over
the ``FakeEngine`` and its ``FakeAdapter``: admission, binding, the update's
lifecycle, its failure classes and its records are RolloutCore's own.

``sigint_when(predicate)`` is the terminal: a thread that sends SIGINT to the
main thread (as a terminal's Ctrl-C reaches the foreground process) once
``predicate(main_stack())`` holds for the main thread's stack, so that the
interrupt lands exactly where a test wants it (``calls(stack, "f", "g")``: f
blocked in g), whatever the machine's load.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import save_file

from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal
from rolloutcore.control.runner import Deadlines, LifecycleRunner
from rolloutcore.core.versions import Provenance
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.session import UpdateResult
from rolloutcore.testing.fake import FakeAdapter, FakeEngine, FakeWeights
from rolloutcore.testing.fake_vllm import FakeVllm
from rolloutcore.testing.models import VOCAB_SIZE
from rolloutcore.transports.source import WeightSource

FAST = Deadlines(drain_s=5, pause_s=5, preflight_s=2, transfer_s=30, reset_s=1, validate_s=2,
                 resume_s=1, live_validate_s=5, bootstrap_s=2, fence_s=1, cancel_grace_s=1,
                 retry_backoff_s=0.01)


N = 4  # num_generations
RUN = "unit-run"
REPLICA = "http://fake-engine-0"  # the one fake of vLLM answers it (FakeVllm)


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 3)
        self.config = SimpleNamespace(vocab_size=256)


def write_checkpoint(d: Path, model: torch.nn.Module) -> Path:
    d.mkdir()
    save_file({n: p.detach().to(torch.bfloat16).contiguous()
               for n, p in model.named_parameters()}, str(d / "model.safetensors"))
    (d / "config.json").write_text("{}")
    return d


class ByteTokenizer:
    """TRL calls ``processing_class(text=[...])["input_ids"]`` for plain prompts."""

    def __call__(self, *, text: Sequence[str]) -> dict[str, list[list[int]]]:
        return {"input_ids": [list(t.encode()) for t in text]}

    def apply_chat_template(self, *, conversation: Sequence[Any], add_generation_prompt: bool,
                            tokenize: bool, return_dict: bool, chat_template: Any = None,
                            **kw: Any) -> dict[str, list[list[int]]]:
        assert add_generation_prompt and tokenize and return_dict
        return {"input_ids": [list(("|".join(m["content"] for m in c) + ">").encode())
                              for c in conversation]}


def make_trainer(model: torch.nn.Module) -> SimpleNamespace:
    """The attributes GRPOTrainer 1.16 gives a rollout function."""
    return SimpleNamespace(
        state=SimpleNamespace(global_step=0), model=model, num_generations=N,
        num_generations_eval=2, processing_class=ByteTokenizer(), max_completion_length=6,
        temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
        args=SimpleNamespace(generation_kwargs=None),
        accelerator=SimpleNamespace(num_processes=1, unwrap_model=lambda m: m),
        vllm_importance_sampling_correction=True, use_vllm=False, tools=None,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)})


def train_step(model: torch.nn.Module, trainer: Any) -> None:
    """What an optimizer step does to the rollout function's view: weights and step move."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05)
    trainer.state.global_step += 1


def prompts(k: int = 2, n: int = N) -> list[str]:
    return [f"prompt {i}" for i in range(k) for _ in range(n)]


def fake_weights(state: Mapping[str, torch.Tensor], provenance: Provenance) -> FakeWeights:
    """The tensors' bytes as the fake engine's weights (same names)."""
    return FakeWeights({n: t.contiguous().view(torch.uint8).numpy().tobytes()
                        for n, t in state.items()}, provenance)


class FakeSession:
    """An ``EngineSession`` over the fake engine, bootstrapped on ``ckpt``."""

    def __init__(self, ckpt: Path, run: str, *, journal: Path | None = None,
                 deadlines: Deadlines = FAST) -> None:
        w0 = fake_weights(dict(WeightSource.from_checkpoint(ckpt).named_tensors()),
                          Provenance(str(ckpt.resolve()), run, 0))
        self.engine = FakeEngine(w0, token_delay_s=0.0)
        self.vllm = FakeAdapter(self.engine)
        self.vllm.stage(w0)
        self.journal = Journal(journal)
        self.controller = LifecycleController(listener=self.journal.listener)
        self.runner = LifecycleRunner(self.controller, self.vllm, deadlines,
                                      record=self.journal.write)
        self.runner.bootstrap(w0.identity())
        self.fake = FakeVllm(self.engine, vocab_size=VOCAB_SIZE)
        self.http = VllmHTTP(REPLICA, transport=self.fake.transport())
        self.closed = False

    def update(self, state: Mapping[str, Any], provenance: Provenance, *, probe: Any,
               owner: str) -> UpdateResult:
        w = fake_weights(dict(state), provenance)
        self.vllm.stage(w)
        out = self.runner.run_update(w.identity(), owner=owner)
        assert out.published is not None and self.controller.identity is not None
        return UpdateResult(out.published, self.controller.identity, out)

    def close(self) -> None:
        self.journal.close()
        self.http.close()
        self.closed = True


def main_stack() -> list[str]:
    """The main thread's stack now, innermost first, as ``module.qualname`` of each frame."""
    f = sys._current_frames().get(threading.main_thread().ident or 0)
    out = []
    while f is not None:
        out.append(f"{f.f_globals.get('__name__')}.{f.f_code.co_qualname}")
        f = f.f_back
    return out


def calls(stack: list[str], caller: str, callee: str) -> bool:
    """Whether ``caller`` (a qualname's end) is, right now, in a call of ``callee``."""
    return any(s.endswith(caller) and i > 0 and stack[i - 1] == callee
               for i, s in enumerate(stack))


def sigint_when(predicate: Callable[[list[str]], bool], *,
                timeout_s: float = 60.0) -> threading.Thread:
    """Send SIGINT to the main thread once ``predicate(main_stack())`` holds (started)."""
    main = threading.main_thread().ident
    assert main is not None

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate(main_stack()):
            if time.monotonic() > deadline:
                return  # the test then fails on what it expected
            time.sleep(0.001)
        signal.pthread_kill(main, signal.SIGINT)

    th = threading.Thread(target=watch, name="test-terminal", daemon=True)
    th.start()
    return th
