"""A campaign's types, apart from its backends: a run to make (RunSpec) and what came of
it (RunResult), where runs execute (Backend, kill_run), the campaign asked for
(CampaignSpec) and its result (CampaignResult, fault_text).

ptckpt.campaign (the local backend, the campaign itself), ptckpt.cluster (the Dask
backend) and ptckpt.report (report.html) all import this module and none of them imports
another's types, so that campaign -> cluster and campaign -> report stay one-way.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from . import procfs

OUTCOMES = ("masked", "detected", "crashed", "hung", "error")


@dataclass(frozen=True)
class RunSpec:
    """One run: what a backend executes."""

    index: int                  # 0: the reference run (no faults)
    seed: int
    argv: tuple[str, ...]       # the command (ptckpt restore ...)
    directory: str              # its own directory: stdout, stderr, faults.json
    timeout: float


@dataclass
class RunResult:
    index: int
    seed: int
    status: int | None          # shell-style: 128+N for a signal; None if killed at the timeout
    seconds: float
    timed_out: bool = False
    faults: list[dict] = field(default_factory=list)
    signature: str = ""
    check: str = ""             # "pass" | "fail" | "" (no check)
    outcome: str = ""
    reason: str = ""
    host: str = ""              # where it ran


class Backend:
    """Where runs execute.  submit() starts a run (it may queue it); wait() blocks until at
    least one run has ended and returns the (index, status, seconds, timed_out, host) of
    those that did; cancel() kills everything still going."""

    def submit(self, run: RunSpec) -> None:
        raise NotImplementedError

    def wait(self) -> list[tuple[int, int | None, float, bool, str]]:
        raise NotImplementedError

    def cancel(self) -> None:
        raise NotImplementedError


def kill_run(proc: subprocess.Popen) -> None:
    """A run's pid namespace (its init is the restore's child) and the restore itself."""
    for child in procfs.children_or_none(proc.pid):
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@dataclass
class CampaignSpec:
    image: str
    runs: int
    inject: Sequence[str]
    out: str
    seed: int = 1
    jobs: int = 1
    timeout: float = 60.0
    check: str = ""                         # a shell command; exit 0: the run's result is right
    restore_args: Sequence[str] = ()        # more options for every restore (--plugin, --file-policy ...)
    backend: str = "local"                  # or dask://HOST:PORT (ptckpt.cluster)
    clones: bool = True                     # runs as copies of one template where they can be
                                            # (ptckpt.clones); False: each restores the image


@dataclass
class CampaignResult:
    runs: list[RunResult]
    reference: RunResult
    out: str
    runs_as: str = "restores"               # or "copies of a template" (ptckpt.clones)

    def counts(self) -> Counter:
        return Counter(r.outcome for r in self.runs)

    def as_json(self) -> dict:
        """results.json's object: {"summary": {outcome: n}, "reference": run, "runs": [run]}."""
        return {"summary": dict(self.counts()), "runs_as": self.runs_as, "reference": asdict(self.reference),
                "runs": [asdict(r) for r in self.runs]}

    def summary(self) -> str:
        counts = self.counts()
        parts = [f"{counts.get(o, 0)} {o}" for o in OUTCOMES if o != "error" or counts.get(o)]
        return f"{len(self.runs)} runs: " + ", ".join(parts) + f"; results in {self.out}"


def fault_text(faults: list[dict]) -> str:
    """The faults of a run, one phrase each (the results table's column)."""
    return "; ".join(f"{f['target']} bits {','.join(map(str, f['bits']))}" if f["bits"]
                     else f"{f['target']} = {f['after']}" for f in faults)
