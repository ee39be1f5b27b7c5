"""A controller process for the crash test: runs an update on the fake engine whose
transfer hangs, and prints READY-TO-KILL once the journal shows begin_update."""

import sys

from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal
from rolloutcore.control.runner import Deadlines, LifecycleRunner
from rolloutcore.testing.fake import FakeAdapter, FakeEngine, FakeWeights, FaultKind


def main(path: str) -> None:
    w0 = FakeWeights.from_seed(0)
    eng = FakeEngine(w0)
    ad = FakeAdapter(eng)
    j = Journal(path, fsync=True)
    c = LifecycleController(listener=j.listener)
    r = LifecycleRunner(c, ad, Deadlines(transfer_s=3600), record=j.write)
    ad.stage(w0)
    r.bootstrap(w0.identity())
    c.admit("still-running-1")
    c.admit("still-running-2")
    c.complete("still-running-2")
    c.complete("still-running-1")
    c.admit("bound-at-crash")   # an admission that is active when the process dies...
    c.complete("bound-at-crash")  # ...no: completes; the update needs a drain
    w1 = FakeWeights.from_seed(1, step=1)
    ad.stage(w1)
    ad.inject("transfer", FaultKind.HANG)
    orig = ad.transfer

    def transfer(target):  # type: ignore[no-untyped-def]
        print("READY-TO-KILL", flush=True)
        return orig(target)

    ad.transfer = transfer  # type: ignore[method-assign]
    r.run_update(w1.identity())


if __name__ == "__main__":
    main(sys.argv[1])
