"""A campaign's types, apart from its backends: a run to make (RunSpec) and what came of
it (RunResult), where runs execute (Backend, kill_run), the campaign asked for
(CampaignSpec) and its result (CampaignResult, fault_text).

ptckpt.campaign (the local backend, the campaign itself), ptckpt.cluster (the Dask
backend) and ptckpt.report (report.html) all import this module and none of them imports
another's types, so that campaign -> cluster and campaign -> report stay one-way.
"""

from __future__ import annotations

import os
import shlex
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
    reproduce: tuple[str, ...] = ()     # the restore that makes this run again by hand (argv
                                        # without --faults-log: it would overwrite the run's)


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
    reproduce: tuple[str, ...] = ()     # RunSpec.reproduce


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


def run_directory(index: int) -> str:
    """A run's directory relative to the campaign's OUT: runs/reference for the reference
    run (index 0), runs/0001, runs/0002 ... for the others."""
    return os.path.join("runs", "reference" if index == 0 else f"{index:04d}")


def shell_command(argv: Sequence[str], cwd: str = "", env: dict[str, str] | None = None) -> str:
    """argv as one line for a POSIX shell, run as a campaign ran it: from `cwd` (the
    restore options may hold relative paths), with `env` (PYTHONPATH when the campaign's
    ptckpt came from there), stdin from /dev/null."""
    assignments = "".join(f"{name}={shlex.quote(value)} " for name, value in sorted((env or {}).items()))
    where = f"cd {shlex.quote(cwd)} && " if cwd else ""
    return f"{where}{assignments}{shlex.join(argv)} </dev/null"


@dataclass
class CampaignResult:
    runs: list[RunResult]
    reference: RunResult
    out: str
    runs_as: str = "restores"               # or "copies of a template" (ptckpt.clones)
    campaign: dict = field(default_factory=dict)    # its parameters: results.json's "campaign"
                                                    # (written by ptckpt.campaign._parameters)

    def counts(self) -> Counter:
        return Counter(r.outcome for r in self.runs)

    def outputs(self, run: RunResult) -> dict[str, str | None]:
        """A run's files, relative to OUT: stdout, stderr and faults (faults.json), each None
        when the run has none (no faults.json for the reference run or a restore that failed
        before its faults; nothing for a reference that was never run, under --check)."""
        directory = run_directory(run.index)
        paths = {"stdout": "stdout", "stderr": "stderr", "faults": "faults.json"}
        return {key: os.path.join(directory, name) if os.path.exists(os.path.join(self.out, directory, name))
                else None for key, name in paths.items()}

    def reproduce(self, run: RunResult) -> dict:
        """How to make `run` again by hand: its restore's argv, the directory and environment
        it ran in, and the same as one shell line."""
        cwd, env = self.campaign.get("cwd", ""), self.campaign.get("env", {})
        return {"argv": list(run.reproduce), "cwd": cwd, "env": env, "stdin": "/dev/null",
                "shell": shell_command(run.reproduce, cwd, env) if run.reproduce else ""}

    def _run_json(self, run: RunResult) -> dict:
        return {**asdict(run), "reproduce": self.reproduce(run), "output": self.outputs(run)}

    def as_json(self) -> dict:
        """results.json's object: {"summary": {outcome: n}, "runs_as": how, "campaign": its
        parameters, "reference": run, "runs": [run]}, each run with its "reproduce" command
        and its "output" files."""
        return {"summary": dict(self.counts()), "runs_as": self.runs_as, "campaign": self.campaign,
                "reference": self._run_json(self.reference), "runs": [self._run_json(r) for r in self.runs]}

    def summary(self) -> str:
        counts = self.counts()
        parts = [f"{counts.get(o, 0)} {o}" for o in OUTCOMES if o != "error" or counts.get(o)]
        return f"{len(self.runs)} runs: " + ", ".join(parts) + f"; results in {self.out}"


def fault_text(faults: list[dict]) -> str:
    """The faults of a run, one phrase each (the results table's column)."""
    return "; ".join(f"{f['target']} bits {','.join(map(str, f['bits']))}" if f["bits"]
                     else f"{f['target']} = {f['after']}" for f in faults)
