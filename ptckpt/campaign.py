"""Restart campaigns: restore one image many times, each run with its own faults and seed.

``run_campaign(CampaignSpec(...))`` makes N runs (plus, when there is no check,
one reference run without faults first, whose stdout tells masked from
detected), at most `jobs` at a time.  Each run is ``ptckpt restore --pidns
--inherit-stdio --inject ... --seed S`` with its stdout and stderr in
OUT/runs/NNNN/, so pids never collide and nothing of one run is seen by another;
a run still going at the timeout is killed (its whole pid namespace) and counted
as hung.  Outcomes:

    masked    exit 0, the check passes (or, without a check, the same stdout as the
              reference run)
    detected  the program failed (exit status not 0), the check failed, or the stdout
              differs from the reference
    crashed   killed by a signal
    hung      killed at the timeout
    error     the restore itself failed (its "ptckpt: error:" line is kept)

OUT/results.csv and OUT/results.json hold one row per run: seed, faults, status,
signature, check verdict, outcome, seconds.

Runs go through a :class:`ptckpt.campaign_types.Backend` (submit, wait, cancel): :class:`LocalBackend`
runs them as processes on this machine; ptckpt.cluster.DaskBackend as tasks of a Dask
scheduler.  Results name the host each run ran on.
"""

from __future__ import annotations

import csv
import datetime
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence

from .campaign_types import (OUTCOMES, Backend, CampaignResult, CampaignSpec, RunResult, RunSpec, fault_text,
                             kill_run, run_directory)
from .errors import PtckptError, ReferenceFailed, UsageError

__all__ = ["OUTCOMES", "Backend", "CampaignResult", "CampaignSpec", "LocalBackend", "RunResult", "RunSpec",
           "backend_for", "classify", "fault_text", "kill_run", "run_campaign", "write_results"]

log = logging.getLogger("ptckpt.campaign")


class LocalBackend(Backend):
    """Runs on this machine, `jobs` at a time, each in its own process group."""

    def __init__(self, jobs: int = 1):
        self.jobs = max(1, jobs)
        self.queue: list[RunSpec] = []
        self.running: dict[int, tuple[RunSpec, subprocess.Popen, float]] = {}

    def submit(self, run: RunSpec) -> None:
        self.queue.append(run)
        self._start()

    def _start(self) -> None:
        while self.queue and len(self.running) < self.jobs:
            run = self.queue.pop(0)
            os.makedirs(run.directory, mode=0o700, exist_ok=True)
            with open(os.path.join(run.directory, "stdout"), "wb") as out, \
                    open(os.path.join(run.directory, "stderr"), "wb") as err:
                proc = subprocess.Popen(run.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                        start_new_session=True, close_fds=True)
            self.running[run.index] = (run, proc, time.monotonic())

    def wait(self) -> list[tuple[int, int | None, float, bool, str]]:
        while True:
            done = []
            now = time.monotonic()
            for index, (run, proc, started) in list(self.running.items()):
                status = proc.poll()
                timed_out = status is None and now - started > run.timeout
                if timed_out:
                    kill_run(proc)
                if status is not None or timed_out:
                    del self.running[index]
                    shell = None if timed_out else (128 - status if status < 0 else status)
                    done.append((index, shell, now - started, timed_out, socket.gethostname()))
            if done:
                self._start()
                return done
            if not self.running and not self.queue:
                return []
            time.sleep(0.02)

    def cancel(self) -> None:
        self.queue.clear()
        for _run, proc, _started in self.running.values():
            kill_run(proc)
        self.running.clear()


def backend_for(spec: str, image: str, jobs: int) -> Backend:
    """--backend: "local" or "dask://HOST:PORT" (ptckpt.cluster, imported only then)."""
    if spec in ("", "local"):
        return LocalBackend(jobs)
    if spec.startswith("dask://"):
        from .cluster import DaskBackend
        return DaskBackend("tcp://" + spec[len("dask://"):], image)
    raise UsageError(f"--backend {spec!r}: local or dask://HOST:PORT")


def _restore_argv(spec: CampaignSpec, seed: int, faults: bool, netns: bool = False) -> tuple[str, ...]:
    """The restore of one run (the reference: no faults), as results.json's "reproduce"
    gives it; the campaign adds --faults-log to it."""
    argv = [sys.executable, "-m", "ptckpt", "restore", "-D", os.path.abspath(spec.image), "--pidns",
            *(("--netns",) if netns else ()), "--inherit-stdio", *spec.restore_args]
    if faults:
        for text in spec.inject:
            argv += ["--inject", text]
        argv += ["--seed", str(seed)]
    return tuple(argv)


def _run_spec(spec: CampaignSpec, index: int, netns: bool) -> RunSpec:
    """Run `index` (0: the reference, no faults) with seed --seed + index - 1, its output
    in OUT/runs/NNNN (campaign_types.run_directory)."""
    directory = os.path.join(spec.out, run_directory(index))
    seed = spec.seed + index - 1 if index else 0
    reproduce = _restore_argv(spec, seed, index > 0, netns)
    argv = reproduce + (("--faults-log", os.path.join(directory, "faults.json")) if index else ())
    return RunSpec(index, seed, argv, directory, spec.timeout, reproduce)


def _parameters(spec: CampaignSpec, netns: bool, started: str, ref: RunResult) -> dict:
    """results.json's "campaign": what was asked, with what, when, and the reference run's
    output (None under --check: no reference run)."""
    from . import __version__
    reference = None
    if ref.outcome == "reference":
        reference = {"signature": ref.signature, "stdout": os.path.join(run_directory(0), "stdout"),
                     "stderr": os.path.join(run_directory(0), "stderr")}
    env = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}
    return {"image": os.path.abspath(spec.image), "inject": list(spec.inject),
            "seeds": {"first": spec.seed, "last": spec.seed + spec.runs - 1}, "runs": spec.runs, "jobs": spec.jobs,
            "timeout": spec.timeout, "check": spec.check, "restore_args": list(spec.restore_args),
            "backend": spec.backend or "local", "clones": spec.clones, "netns": netns,
            "ptckpt_version": __version__, "python": sys.executable, "date": started,
            "cwd": os.getcwd(), "env": env, "reference": reference}


def _holds_loopback_sockets(image: str) -> bool:
    """Whether each run needs a network namespace of its own (restore --netns): the image
    holds inet sockets on this host's loopback or wildcard addresses (listeners, UDP,
    connections between its own processes), which the runs would otherwise fight over,
    and no connection to a peer outside it (which a new namespace cannot reach)."""
    import ipaddress
    from .formats.image import ImageReader
    from .formats.model import InetMode
    try:
        with ImageReader(image, verify_pages=False) as reader:
            socks = reader.inet_sockets
    except PtckptError:
        return False                      # the restore reports what is wrong with the image
    if any(r.mode is InetMode.REPAIRED and not r.peer for r in socks):
        return False

    def local(addr: str) -> bool:
        return not addr or ipaddress.ip_address(addr).is_loopback or ipaddress.ip_address(addr).is_unspecified
    return any(r.sport and local(r.src) for r in socks)


def _signature(directory: str) -> str:
    with open(os.path.join(directory, "stdout"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def _ptckpt_error(directory: str) -> str:
    with open(os.path.join(directory, "stderr"), errors="replace") as f:
        return next((line.strip() for line in f if line.startswith("ptckpt: error:")), "")


def _run_check(check: str, run: RunSpec, status: int | None) -> str:
    env = dict(os.environ, PTCKPT_RUN_DIR=run.directory, PTCKPT_STDOUT=os.path.join(run.directory, "stdout"),
               PTCKPT_SEED=str(run.seed), PTCKPT_STATUS=str(status))
    try:
        res = subprocess.run(check, shell=True, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, timeout=max(run.timeout, 10))
    except subprocess.TimeoutExpired:
        return "fail"
    return "pass" if res.returncode == 0 else "fail"


def classify(result: RunResult, reference_signature: str, error: str) -> None:
    """Set result.outcome and result.reason (see the module docstring)."""
    if result.timed_out:
        result.outcome, result.reason = "hung", "killed at the timeout"
    elif error:
        result.outcome, result.reason = "error", error
    elif result.status is not None and result.status > 128:
        result.outcome, result.reason = "crashed", f"signal {result.status - 128}"
    elif result.status != 0:
        result.outcome, result.reason = "detected", f"exit status {result.status}"
    elif result.check == "fail":
        result.outcome, result.reason = "detected", "the check failed"
    elif not result.check and result.signature != reference_signature:
        result.outcome, result.reason = "detected", "stdout differs from the reference run"
    else:
        result.outcome, result.reason = "masked", ""


def _result(spec: CampaignSpec, run: RunSpec, status, seconds, timed_out, host) -> tuple[RunResult, str]:
    result = RunResult(run.index, run.seed, status, round(seconds, 3), timed_out, host=host,
                       reproduce=run.reproduce)
    path = os.path.join(run.directory, "faults.json")
    if os.path.exists(path):
        with open(path) as f:
            result.faults = json.load(f)["faults"]
    result.signature = _signature(run.directory)
    if spec.check and not timed_out:
        result.check = _run_check(spec.check, run, status)
    return result, _ptckpt_error(run.directory)


FAILED_REFERENCE = "reference-failed"      # in -o: the reason a campaign's reference run failed


def _only_failed_reference(out: str) -> bool:
    """-o holds nothing but a failed reference run (what a campaign leaves then): its
    marker and runs/reference/.  A retry reuses such an -o; any other content is refused."""
    try:
        return (set(os.listdir(out)) == {FAILED_REFERENCE, "runs"}
                and os.listdir(os.path.join(out, "runs")) == ["reference"])
    except OSError:
        return False


def _clear_failed_reference(out: str) -> None:
    import shutil
    shutil.rmtree(os.path.join(out, "runs", "reference"))
    os.rmdir(os.path.join(out, "runs"))
    os.unlink(os.path.join(out, FAILED_REFERENCE))


def _reference_failed(out: str, directory: str, ref: RunResult, error: str) -> ReferenceFailed:
    """The error for a reference run that did not succeed, its reason also left in
    OUT/reference-failed (so that a retry knows -o holds only that): the restore's own exit
    code when the restore failed (its "ptckpt: error:" line), else REFERENCE_FAILED."""
    restore_code = None
    if ref.timed_out:
        why = f"timed out (killed after {ref.seconds:.0f} s)"
    elif error:
        why = error.removeprefix("ptckpt: error:").strip()
        if ref.status is not None and 0 < ref.status < 128:
            restore_code = ref.status
    elif ref.status is not None and ref.status > 128:
        why = f"the program was killed by signal {ref.status - 128}"
    else:
        why = f"the program exited with status {ref.status}"
    fd = os.open(os.path.join(out, FAILED_REFERENCE), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(why + "\n")
    return ReferenceFailed(why, directory, restore_code)


def check_image(image: str, inject: Sequence[str]) -> None:
    """Before any run (and before -o is made): the image opens (its own errors, with their
    exit codes: NotAnImage ...), and every symbol an --inject SPEC names is defined in the
    process it names, as the image maps it (SymbolNotFound, naming the spec)."""
    from . import faults
    from .formats.image import ImageReader
    from .symbols import SymbolError, SymbolTable
    with ImageReader(image, verify_pages=False) as reader:
        tables: dict[int, SymbolTable] = {}
        for text in inject:
            fault = faults.parse_spec(text)
            names = [n for n in (fault.symbol, fault.function, fault.flip) if n]
            if not names:
                continue
            pid = fault.pid or reader.inventory.root_pid
            if pid not in reader.pids:
                raise UsageError(f"--inject {text}: the image has no process {pid} "
                                 f"(it has {', '.join(map(str, reader.pids))})")
            if pid not in tables:
                tables[pid] = SymbolTable.for_image(reader, pid)
            for name in names:
                try:
                    tables[pid].extent(name)
                except SymbolError as err:
                    raise UsageError(f"--inject {text}: {err} (process {pid} of {image})") from None


def _clone_refusal(spec: CampaignSpec, netns: bool) -> str | None:
    from . import clones
    if netns:
        return "its sockets need a network namespace per run"
    return clones.campaign_refusal(spec.image, spec.inject, spec.restore_args)


def _clone_backend(spec: CampaignSpec, netns: bool) -> Backend | None:
    """Runs as copies of one restored template (ptckpt.clones), when the campaign runs
    here and its image and options allow it; None (the reason logged): each run restores
    the image."""
    if not spec.clones or spec.backend not in ("", "local"):
        return None
    from . import clones
    why = _clone_refusal(spec, netns)
    if why is None:
        try:
            template = clones.template_for(spec.image, spec.restore_args)
        except PtckptError as err:
            why = f"the template could not be made: {err}"
        else:
            log.info("runs are copies of one template (pid %d)", template.task.tgid)
            return clones.CloneBackend(template, spec.inject, spec.jobs)
    log.info("each run restores the image (no template: %s)", why)
    return None


def run_campaign(spec: CampaignSpec, backend: Backend | None = None, progress=None) -> CampaignResult:
    """Run the campaign; `progress(done, total, counts, eta_seconds)` is called as runs end
    (and with 0 done, eta None, once the reference run passed)."""
    if spec.runs < 1:
        raise UsageError("--runs must be at least 1")
    if not spec.inject:
        raise UsageError("a campaign needs at least one --inject SPEC")
    if os.path.isdir(spec.out) and os.listdir(spec.out) and not _only_failed_reference(spec.out):
        raise UsageError(f"{spec.out} is not empty (another campaign's results?): give -o a new directory")
    check_image(spec.image, spec.inject)
    if os.path.isdir(spec.out) and _only_failed_reference(spec.out):
        _clear_failed_reference(spec.out)              # a retry after a failed reference takes -o again
    os.makedirs(spec.out, mode=0o700, exist_ok=True)
    started_at = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    netns = "--netns" not in spec.restore_args and _holds_loopback_sockets(spec.image)

    first = 1 if spec.check else 0               # with a check no reference is needed
    if backend is None:
        backend = _clone_backend(spec, netns) or backend_for(spec.backend, spec.image, spec.jobs)
        if spec.clones and hasattr(backend, "use_clones"):
            why = _clone_refusal(spec, netns)
            if why is None:
                backend.use_clones(spec.inject, spec.restore_args)
            else:
                log.info("each run restores the image (no template: %s)", why)
    specs = {i: _run_spec(spec, i, netns) for i in range(first, spec.runs + 1)}
    results: dict[int, RunResult] = {}
    ref = RunResult(0, 0, None, 0.0, outcome="none")
    try:
        if not first:
            backend.submit(specs[0])             # the reference first, alone: its stdout is the yardstick
            for index, status, seconds, timed_out, host in backend.wait():
                ref, error = _result(spec, specs[index], status, seconds, timed_out, host)
            if ref.timed_out or ref.status != 0:
                raise _reference_failed(spec.out, specs[0].directory, ref, error)
            ref.outcome = "reference"
            if progress is not None:
                progress(0, spec.runs, Counter(), None)     # the reference passed: the runs start
        for i in range(1, spec.runs + 1):
            backend.submit(specs[i])
        started = time.monotonic()
        while len(results) < spec.runs:
            for index, status, seconds, timed_out, host in backend.wait():
                result, error = _result(spec, specs[index], status, seconds, timed_out, host)
                classify(result, ref.signature, error)
                log.info("run %d (seed %d): %s %s", index, result.seed, result.outcome, result.reason)
                results[index] = result
                if progress is not None:
                    done = len(results)
                    eta = (time.monotonic() - started) / done * (spec.runs - done)
                    progress(done, spec.runs, Counter(r.outcome for r in results.values()), eta)
    finally:
        backend.cancel()
    done = CampaignResult([results[i] for i in range(1, spec.runs + 1)], ref, spec.out,
                          getattr(backend, "runs_as", None) or "restores", _parameters(spec, netns, started_at, ref))
    write_results(done)
    from .report import write_report
    write_report(done)
    return done


def write_results(result: CampaignResult) -> None:
    rows = ([result.reference] if result.reference.outcome == "reference" else []) + result.runs
    columns = ["index", "seed", "outcome", "reason", "status", "signature", "check", "seconds", "faults", "host"]
    fd = os.open(os.path.join(result.out, "results.csv"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for r in rows:
            w.writerow([r.index, r.seed, r.outcome, r.reason, "" if r.status is None else r.status, r.signature,
                        r.check, r.seconds, fault_text(r.faults), r.host])
    fd = os.open(os.path.join(result.out, "results.json"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(result.as_json(), f, indent=2)
