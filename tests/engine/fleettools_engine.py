"""Real-engine fleet support: client load through a fleet gateway, and direct reads.

``Load`` runs client threads against the gateway (each request records when
it was sent and answered, its status, headers and body) until stopped;
``Sampler`` polls ``/control/status``. ``greedy`` asks one engine directly
for greedy tokens and logprobs (the cold-start comparison).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = ["PROMPTS", "Answer", "Load", "Sampler", "greedy"]

_rng = random.Random(11)
PROMPTS: list[list[int]] = [list(range(10, 40)), [1],
                            [_rng.randrange(256) for _ in range(200)]]


def greedy(base_url: str, prompts: list[list[int]] = PROMPTS, max_tokens: int = 12
           ) -> list[tuple[list[int], list[float]]]:
    out = []
    for ids in prompts:
        r = httpx.post(f"{base_url}/inference/v1/generate", timeout=120, json={
            "model": "policy", "token_ids": ids,
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
                                "ignore_eos": True}})
        r.raise_for_status()
        c = r.json()["choices"][0]
        out.append((c["token_ids"], [x["logprob"] for x in c["logprobs"]["content"]]))
    return out


@dataclass
class Answer:
    policy: str
    sent: float
    done: float
    status: int
    headers: dict[str, str]
    body: Any


@dataclass
class Load:
    """Client threads posting ``/inference/v1/generate`` with the given policies."""

    url: str
    policies: list[str]
    max_tokens: int = 6
    pause_s: float = 0.0
    #: A run name: each request then asks the gateway to record it (``--record``), as
    #: step <client index>, prompt index <request number>: one group per request.
    record: str | None = None
    answers: list[Answer] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(p, i), daemon=True)
                         for i, p in enumerate(self.policies)]

    def _run(self, policy: str, k: int) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as c:
            i = 0
            while not self._stop.is_set():
                i += 1
                t0 = time.monotonic()
                headers = {"x-rolloutcore-policy": policy}
                if self.record is not None:
                    headers.update({"x-rolloutcore-run": self.record,
                                    "x-rolloutcore-step": str(k),
                                    "x-rolloutcore-prompt-index": str(i)})
                try:
                    r = c.post("/inference/v1/generate", headers=headers, json={
                        "model": "policy", "token_ids": [3, 1, 4, 1, 5, k, i % 200],
                        "sampling_params": {"max_tokens": self.max_tokens, "temperature": 0}})
                except httpx.HTTPError as exc:
                    self.errors.append(exc)
                    continue
                try:
                    body = r.json()
                except ValueError:
                    body = r.text
                self.answers.append(Answer(policy, t0, time.monotonic(), r.status_code,
                                           dict(r.headers), body))
                if r.status_code == 503:
                    time.sleep(0.05)
                elif self.pause_s:
                    time.sleep(self.pause_s)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def of(self, policy: str, status: int | None = None) -> list[Answer]:
        return [a for a in self.answers if a.policy == policy
                and (status is None or a.status == status)]


@dataclass
class Sampler:
    url: str
    token: str
    period_s: float = 0.02
    samples: list[tuple[float, dict[str, Any]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30, headers={
                "authorization": f"Bearer {self.token}"}) as c:
            while not self._stop.is_set():
                r = c.get("/control/status")
                if r.status_code == 200:
                    self.samples.append((time.monotonic(), r.json()))
                time.sleep(self.period_s)

    def __enter__(self) -> Sampler:
        self._th.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._th.join(30)
