"""Groups across hosts, on Dask: ``ptckpt group dump`` and ``ptckpt group restore`` with
``--backend dask://HOST:PORT`` (``pip install 'ptckpt[cluster]'``).

A group is processes on several hosts that make one computation (a client on one host
talking TCP to a server on another).  A member is WORKER:PID: WORKER the name a Dask worker
was started with (``dask worker --name``) on the host that holds PID.  Each member is a
task pinned to its worker (``workers=[name]``); the tasks meet at barriers made of Dask
Events (one per barrier and member, set on arrival; a barrier is passed once every
member's is set), and one Event per group says "a member failed": every waiting member
then gives up.

group dump -- each task runs the dump pipeline (ptckpt.pipeline.dump) on its member:

  ready     (before_freeze) every member checked, none frozen yet: nobody waits frozen
            for another's check;
  frozen    (after_freeze) every member is frozen, and with --tcp-established its
            connections locked (its dump locks them as soon as its tree is frozen), before
            any captures a byte: a member reads its connections in repair mode while every
            peer is frozen and silenced, so a segment that one drops stays in the other's
            send queue, and is sent again after the restore;
  captured  (before_release) every member's image is committed before any is resumed or
            killed;

  then each resumes or is killed.  A member that fails anywhere before the second barrier
  resumes as it was (its dump undoes itself) and so does every other member; past it
  (the release itself failed) the others are already resumed or killed, and the error
  says which.  The images come back as the campaign's content-addressed chunks
  (ptckpt.cluster) in the tasks' results, and are written into DIR/WORKER-PID/, with
  DIR/group.json naming the members, workers, hosts, pids and options; the whole of DIR
  is made beside it and renamed into place when complete.  A killed member whose
  connections stay locked keeps its worker's copy of the image until a restore there: the
  network lock names it.

group restore -- each member's image is scattered (its chunks) to the worker that is to
  run it (its own, or another with --place OLD=NEW), which checks each chunk and keeps
  the image in its cache; once every image is in place (barrier "ready") each runs the
  restore pipeline (ptckpt.pipeline.restore) up to the resume; there it waits
  (before_resume) until every member is rebuilt (barrier "rebuilt"), then all resume.  A failure before that kills every member made; one after
  (rare: the resume itself failed) has the others killed by a task on their workers.

Plugins meet the other members with ``ctx.barrier(name)`` (ptckpt.plugins), a barrier of
the same kind, and choose which member saves and restores a resource several of them
share (an emulator connection) with ``ctx.elect(ident)``: the first to ask.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from .cluster import cache_dir, chunk_key, connect, ensure_image, manifest, read_chunks, write_image
from .errors import DestinationExists, ExitCode, GroupFailed, PtckptError, UsageError

GROUP_FILE = "group.json"
GROUP_FORMAT = 1


class GroupAborted(Exception):
    """Another member of the group failed: this one gives up."""


class BarrierTimeout(PtckptError):
    """A member did not come to a barrier in time: the failure of the member that waited
    (the one said), which the group then gives up for."""

    exit_code = ExitCode.GROUP_FAILED


class Barrier:
    """Where the members of one group meet (Dask Events underneath, see the module's doc)."""

    def __init__(self, token: str, members: Sequence[str], me: str, timeout: float, client=None):
        from distributed import Event
        self._event, self.client = Event, client
        self.token, self.members, self.me, self.timeout = token, list(members), me, timeout
        self._abort = Event(f"ptckpt-group-{token}-abort", client=client)
        self.made: list[str] = []           # the events and variables this member set: gone at the end

    def forget(self, names) -> None:
        """Clear the events of this group (`names` and the abort event; the scheduler then
        drops them) and delete its variables (names of elections)."""
        from distributed import Variable
        for name in {*names, self._abort.name}:
            if name.startswith(f"ptckpt-group-{self.token}-elect-"):
                Variable(name, client=self.client).delete()
            else:
                self._event(name, client=self.client).clear()

    def elect(self, ident: str) -> str:
        """The member chosen to save and restore `ident`, a resource that members on several
        hosts share: the first to ask; every member asking gets the same answer (a Dask
        Variable, set under a Dask Lock)."""
        from distributed import Lock, Variable
        key = f"ptckpt-group-{self.token}-elect-{ident}"
        chosen = Variable(key, client=self.client)
        with Lock(f"{key}-lock"):
            try:
                return chosen.get(timeout=0)
            except TimeoutError:
                chosen.set(self.me)
                self.made.append(key)
                return self.me

    def key(self, name: str, member: str) -> str:
        return f"ptckpt-group-{self.token}-{name}-{member}"

    def aborted(self) -> bool:
        return self._abort.is_set()

    def abort(self) -> None:
        """Every member waiting, or yet to wait, at a barrier of this group gives up."""
        self._abort.set()

    def wait(self, name: str) -> None:
        """Return once every member has reached barrier `name`; GroupAborted if a member
        failed meanwhile or one did not come within the timeout."""
        self._event(self.key(name, self.me), client=self.client).set()
        self.made.append(self.key(name, self.me))
        deadline = time.monotonic() + self.timeout
        for other in self.members:
            if other == self.me:
                continue
            arrived = self._event(self.key(name, other), client=self.client)
            while not arrived.wait(timeout=0.05):
                if self.aborted():
                    raise GroupAborted(f"another member failed while {self.me} waited at barrier {name}")
                if time.monotonic() > deadline:
                    raise BarrierTimeout(f"member {other} did not reach barrier {name} within {self.timeout:g} s")
        if self.aborted():
            raise GroupAborted(f"another member failed before {self.me} passed barrier {name}")


# --- members, backends, workers ----------------------------------------------------------

def parse_members(specs: Sequence[str]) -> list[tuple[str, int]]:
    """WORKER:PID items -> [(worker, pid)]; UsageError naming a bad one or a repeated one."""
    members = []
    for spec in specs:
        worker, _, pid = str(spec).rpartition(":")
        if not worker or not pid.isdigit() or int(pid) <= 0 or "/" in worker or worker.startswith("."):
            raise UsageError(f"member {spec!r}: WORKER:PID expected (WORKER: a Dask worker's --name)")
        if (worker, int(pid)) in members:
            raise UsageError(f"member {spec} is named twice")
        members.append((worker, int(pid)))
    if not members:
        raise UsageError("a group needs at least one member, WORKER:PID")
    return members


def parse_backend(spec: str) -> str:
    """``dask://HOST:PORT`` -> the scheduler's address, tcp://HOST:PORT."""
    if not spec.startswith("dask://") or ":" not in spec[len("dask://"):]:
        raise UsageError(f"--backend {spec!r}: dask://HOST:PORT (a Dask scheduler) expected")
    return "tcp://" + spec[len("dask://"):]


def _workers(client, wanted: Sequence[str]) -> dict[str, dict]:
    """{name: the scheduler's record of the worker} of the workers `wanted` (their member
    counts); UsageError naming one that is not there, or one with too few threads."""
    known = {str(w.get("name")): w for w in client.scheduler_info(n_workers=-1)["workers"].values()}
    for name in dict.fromkeys(wanted):
        if name not in known:
            raise UsageError(f"no Dask worker named {name!r} (the scheduler has: {', '.join(sorted(known)) or 'none'})")
        if known[name].get("nthreads", 1) < wanted.count(name):
            raise UsageError(f"worker {name} runs {known[name].get('nthreads')} thread(s) for "
                             f"{wanted.count(name)} members: start it with --nthreads {wanted.count(name)}")
    return known


def _why(err: BaseException) -> str:
    return str(err) if getattr(err, "exit_code", None) else f"{type(err).__name__}: {err}"


def _aborted(err: BaseException | None) -> bool:
    """The failure is another member's (a barrier gave up), whatever wrapped it (a plugin's
    event, the restore's own report)."""
    while err is not None:
        if isinstance(err, GroupAborted):
            return True
        err = err.__cause__ or err.__context__
    return False


def _failed(out: dict, err: BaseException, barrier: Barrier) -> dict:
    """A task's outcome after `err`: the group told when the failure is this member's own."""
    if _aborted(err):
        out.update(aborted=True, error=str(err))
    else:
        barrier.abort()
        out.update(error=_why(err), exit_code=getattr(err, "exit_code", 1))
    return out


# --- the tasks a worker runs --------------------------------------------------------------

def dump_member(job: dict) -> dict:
    """A Dask task: member job["me"]'s dump on this worker (see the module's doc)."""
    from distributed import get_client
    from .dump import DumpMode
    from .pipeline.dump import dump
    from .plugins import load_plugin
    barrier = Barrier(job["token"], job["members"], job["me"], job["timeout"], get_client())
    out = {"member": job["me"], "worker": job["worker"], "pid": job["pid"], "host": socket.gethostname(),
           "phase": "check", "ok": False, "times": {"start": time.time()}, "events": barrier.made}
    directory = os.path.join(cache_dir(), "group-dumps", f"{job['token']}-{job['pid']}")

    def ready(_result) -> None:
        barrier.wait("ready")                   # nobody waits frozen for another's check
        out["times"]["all ready"] = time.time()
        out["phase"] = "freeze"

    def frozen(result) -> None:
        out["times"]["frozen"] = time.time()
        if result.netlock_at:
            out["times"]["locked"] = result.netlock_at
        barrier.wait("frozen")
        out["times"]["all frozen"] = time.time()
        out["phase"] = "capture"

    def captured(_result) -> None:
        out["times"]["captured"] = time.time()
        barrier.wait("captured")
        out["times"]["all captured"] = time.time()
        out["phase"] = "release"
    try:
        os.makedirs(os.path.dirname(directory), mode=0o700, exist_ok=True)
        result = dump(job["pid"], directory, mode=DumpMode.KILL if job["kill"] else DumpMode.LEAVE_RUNNING,
                      plugins=[load_plugin(s) for s in job["plugins"]], tcp_established=job["tcp_established"],
                      tcp_close=job["tcp_close"], before_freeze=ready, after_freeze=frozen,
                      before_release=captured, group=barrier)
    except Exception as err:                      # noqa: BLE001 - the member's outcome, said by the caller
        if out["phase"] != "release":
            shutil.rmtree(directory, ignore_errors=True)
        return _failed(out, err, barrier)
    out["times"]["released"] = time.time()
    man = manifest(directory)
    prefix = chunk_key("")
    out.update(ok=True, pids=result.pids, seconds=result.seconds, frozen_seconds=result.frozen_seconds,
               bytes=result.bytes, manifest=man,
               chunks={key.removeprefix(prefix): data for key, data in read_chunks(directory, man)})
    if _left_a_lock(directory):
        out["worker_image"] = directory       # the network lock a kill left names it: kept for a restore
    else:
        shutil.rmtree(directory, ignore_errors=True)
    return out


def _left_a_lock(directory: str) -> bool:
    from .formats.image import ImageReader
    with ImageReader(directory, verify_pages=False) as reader:
        return bool(reader.inventory.netlock)


def restore_member(job: dict, chunks: dict) -> dict:
    """A Dask task: member job["me"]'s restore on this worker, held until every member is
    rebuilt (see the module's doc)."""
    from distributed import get_client
    from .pipeline.restore import restore
    from .plugins import load_plugin
    from .resources.filepolicy import parse_policy
    barrier = Barrier(job["token"], job["members"], job["me"], job["timeout"], get_client())
    out = {"member": job["me"], "worker": job["worker"], "host": socket.gethostname(), "phase": "transfer",
           "ok": False, "events": barrier.made}

    def rebuilt(_result) -> None:
        out["phase"] = "held"
        barrier.wait("rebuilt")
        out["phase"] = "resume"
    try:
        image = ensure_image(job["manifest"], lambda keys: [chunks[k] for k in keys])
        barrier.wait("ready")                     # every image in place: the rebuilds start together
        out["phase"] = "rebuild"
        result = restore(image, pidns=job["pidns"], file_policy=parse_policy(job["file_policy"]),
                         plugins=_restore_plugins(job, [load_plugin(s) for s in job["plugins"]]),
                         before_resume=rebuilt, group=barrier)
    except Exception as err:                      # noqa: BLE001 - the member's outcome, said by the caller
        return _failed(out, err, barrier)
    out.update(ok=True, pid=result.pid, vpid=result.vpid, init_pid=result.init_pid, seconds=result.seconds,
               warnings=list(result.warnings))
    left = job.get("worker_image")
    if left and os.path.isdir(left) and left.startswith(os.path.join(cache_dir(), "group-dumps") + os.sep):
        shutil.rmtree(left, ignore_errors=True)   # its dump's lock is lifted: no longer needed
    return out


def _restore_plugins(job: dict, loaded: list) -> list:
    """The plugins given, and the built-in ones the options ask for (remap-path first, so
    that every other plugin sees the new paths), as a single restore has them."""
    from .builtins import RemapPath, SetEnv
    if job["remap_path"]:
        loaded.insert(0, RemapPath(job["remap_path"]))
    if job["set_env"] or job["unset_env"]:
        loaded.append(SetEnv(job["set_env"], job["unset_env"]))
    return loaded


def kill_member(pids: Sequence[int]) -> None:
    """A Dask task: SIGKILL to restored processes of this worker (a group restore undone)."""
    for pid in pids:
        if pid > 0:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# --- running the tasks --------------------------------------------------------------------

def _run(client, token: str, fn, jobs: list[dict], extra: Sequence = (), timeout: float = 60.0) -> list[dict]:
    """Run `fn(job, *extra[i])` on each job's worker; their outcomes, in order.  A task
    that fails outright, or whose worker leaves, counts as that member's failure and the
    group is told; on ^C (or any error here) too."""
    futures = [client.submit(fn, job, *(extra[i] if extra else ()), key=f"ptckpt-group-{token}-{i}",
                             workers=[job["worker"]], allow_other_workers=False, pure=False)
               for i, job in enumerate(jobs)]
    barrier = Barrier(token, [], "controller", timeout, client)
    outs: list[dict | None] = [None] * len(jobs)
    given_up_at = None
    checked = time.monotonic()
    try:
        while any(o is None for o in outs):
            time.sleep(0.02)
            for i, f in enumerate(futures):
                if outs[i] is None and f.done():
                    outs[i] = _outcome(f, jobs[i])
                    if not outs[i]["ok"] and not outs[i].get("aborted"):
                        barrier.abort()
            now = time.monotonic()
            if now - checked > 0.5:
                checked = now
                _lost_workers(client, jobs, outs, barrier)
                if given_up_at is None and barrier.aborted():
                    given_up_at = now
            if given_up_at is not None and now - given_up_at > timeout:
                for i, job in enumerate(jobs):
                    if outs[i] is None:
                        outs[i] = {**_base(job), "late": True,
                                   "error": f"no answer from worker {job['worker']} "
                                            f"within {timeout:g} s after the group gave up"}
    except BaseException:
        barrier.abort()
        client.cancel(futures)
        raise
    late = [f for f, o in zip(futures, outs) if o.get("late")]
    barrier.forget([*(n for o in outs for n in o.get("events", ())), *_late_events(late)])
    return outs


LATE_WAIT = 10.0       # seconds a member that had not answered when the group gave up is waited for


def _late_events(late) -> list[str]:
    """The events of members whose workers had not answered when the group gave up (but
    are still there): each is waited for (up to LATE_WAIT more), so that what it sets on
    its way out (its barrier, the abort) is cleared with the rest, not left in the scheduler."""
    from distributed import wait
    if late:
        with contextlib.suppress(Exception):
            wait(late, timeout=LATE_WAIT)
    names: list[str] = []
    for f in late:
        with contextlib.suppress(Exception):
            if f.done():
                names += f.result().get("events", ())
    return names


def _base(job: dict) -> dict:
    return {"member": job["me"], "worker": job["worker"], "host": "", "phase": "", "ok": False}


def _outcome(future, job: dict) -> dict:
    try:
        return future.result()
    except Exception as err:                      # noqa: BLE001 - the task itself failed (pickling, a lost worker)
        return {**_base(job), "error": f"the Dask task failed: {type(err).__name__}: {err}"}


PHASE_BARRIERS = ("ready", "frozen", "captured", "rebuilt")     # the group's own, between its phases


def _lost_workers(client, jobs: list[dict], outs: list, barrier: Barrier) -> None:
    present = {str(w.get("name")) for w in client.scheduler_info(n_workers=-1)["workers"].values()}
    for i, job in enumerate(jobs):
        if outs[i] is None and job["worker"] not in present:
            # the barriers it may have reached before its worker went: cleared with the rest
            events = [barrier.key(name, job["me"]) for name in PHASE_BARRIERS]
            outs[i] = {**_base(job), "error": f"worker {job['worker']} left the cluster", "events": events}
            barrier.abort()


def _first_failure(outs: list[dict]) -> dict | None:
    """The member whose own failure stopped the group (not one that gave up for it)."""
    failed = [o for o in outs if not o["ok"]]
    return next((o for o in failed if not o.get("aborted")), failed[0] if failed else None)


# --- group dump ---------------------------------------------------------------------------

@dataclass
class GroupDumpResult:
    directory: str
    members: list[dict] = field(default_factory=list)   # group.json's members
    seconds: float = 0.0
    frozen_seconds: float = 0.0       # the longest a member was frozen

    def summary(self) -> str:
        return (f"dumped a group of {len(self.members)} members to {self.directory}: "
                + ", ".join(f"{m['member']} (host {m['host']}, frozen {m['frozen_seconds']:.3f} s)"
                            for m in self.members)
                + f"; {self.seconds:.3f} s (frozen at most {self.frozen_seconds:.3f} s)")


def group_dump(members: Sequence[str], directory: str, backend: str, *, kill: bool = False,
               tcp_established: bool = False, tcp_close: bool = False, plugins: Sequence[str] = (),
               timeout: float = 60.0) -> GroupDumpResult:
    """Dump every member (WORKER:PID) of a group at one moment into `directory` (see the
    module's doc); GroupFailed naming the member that failed and why."""
    parsed = parse_members(members)
    if tcp_established and tcp_close:
        raise UsageError("--tcp-established and --tcp-close exclude each other")
    final = os.path.abspath(directory)
    if os.path.exists(final) and (not os.path.isdir(final) or os.listdir(final)):
        raise DestinationExists(final)
    started = time.monotonic()
    client = connect(parse_backend(backend))
    try:
        workers = _workers(client, [w for w, _ in parsed])
        token = uuid.uuid4().hex[:12]
        names = [f"{w}:{p}" for w, p in parsed]
        options = {"mode": "kill" if kill else "leave-running", "tcp_established": tcp_established,
                   "tcp_close": tcp_close, "plugins": list(plugins)}
        jobs = [{"token": token, "members": names, "me": f"{w}:{p}", "worker": w, "pid": p, "timeout": timeout,
                 "kill": kill, "tcp_established": tcp_established, "tcp_close": tcp_close,
                 "plugins": list(plugins)} for w, p in parsed]
        outs = _run(client, token, dump_member, jobs, timeout=timeout)
    finally:
        client.close()
    failure = _first_failure(outs)
    if failure is not None:
        raise GroupFailed("dump", failure["member"], failure["phase"], failure["error"], _others_dump(outs, failure, kill))
    result = GroupDumpResult(final, seconds=0.0)
    _write_group(final, outs, workers, options, result)
    result.seconds = time.monotonic() - started
    return result


def _others_dump(outs: list[dict], failure: dict, kill: bool) -> str:
    done = [o["member"] for o in outs if o is not failure and o["ok"]]
    if done:
        return (f"{', '.join(done)} already {'killed' if kill else 'resumed'} after their dump "
                f"(the failure came after every image was taken)")
    return "every member runs on as it was"


def _write_group(final: str, outs: list[dict], workers: dict, options: dict, result: GroupDumpResult) -> None:
    """Each member's image into final/WORKER-PID, and group.json; made beside `final` and
    renamed into place once complete."""
    from . import __version__
    tmp = f"{final}.part-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp, mode=0o700)
    try:
        for out in outs:
            sub = f"{out['worker']}-{out['pid']}"
            os.mkdir(os.path.join(tmp, sub), 0o700)
            write_image(out["manifest"], out["chunks"], os.path.join(tmp, sub))
            result.members.append({
                "member": out["member"], "worker": out["worker"], "host": out["host"],
                "address": workers[out["worker"]].get("host", ""), "pid": out["pid"], "pids": out["pids"],
                "directory": sub, "digest": out["manifest"]["digest"], "bytes": out["bytes"],
                "frozen_seconds": round(out["frozen_seconds"], 6), "seconds": round(out["seconds"], 6),
                "times": {k: round(t, 6) for k, t in out["times"].items()},
                "worker_image": out.get("worker_image", "")})
        with open(os.path.join(tmp, GROUP_FILE), "w") as f:
            json.dump({"format": GROUP_FORMAT, "ptckpt_version": __version__, "created": time.time(),
                       "options": options, "members": result.members}, f, indent=1)
        if os.path.isdir(final):
            os.rmdir(final)                       # an empty directory given: replaced
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result.frozen_seconds = max(m["frozen_seconds"] for m in result.members)


# --- group restore ------------------------------------------------------------------------

@dataclass
class GroupRestoreResult:
    directory: str
    members: list[dict] = field(default_factory=list)   # member, worker, host, pid, vpid, seconds
    seconds: float = 0.0

    def summary(self) -> str:
        return (f"restored a group of {len(self.members)} members from {self.directory}: "
                + ", ".join(f"{m['member']} as {m['worker']}:{m['pid']}" for m in self.members)
                + f" in {self.seconds:.3f} s")


def read_group(directory: str) -> dict:
    """DIR/group.json, checked: UsageError when DIR is no group image."""
    path = os.path.join(directory, GROUP_FILE)
    try:
        with open(path) as f:
            group = json.load(f)
    except FileNotFoundError:
        raise UsageError(f"{directory} is no group image (no {GROUP_FILE}): made by `ptckpt group dump`?") from None
    except (OSError, ValueError) as err:
        raise UsageError(f"{path}: {err}") from None
    if group.get("format") != GROUP_FORMAT:
        raise UsageError(f"{path}: group format {group.get('format')!r}, this ptckpt reads {GROUP_FORMAT}")
    return group


def parse_place(items: Sequence[str], group: dict) -> dict[str, str]:
    """--place OLD=NEW items: {old worker: new worker}; UsageError for a worker not in the group."""
    old = {m["worker"] for m in group["members"]}
    place = {}
    for item in items:
        a, sep, b = item.partition("=")
        if not sep or not a or not b:
            raise UsageError(f"--place {item!r}: OLD=NEW (worker names) expected")
        if a not in old:
            raise UsageError(f"--place {item}: no member of the group ran on worker {a!r} ({', '.join(sorted(old))})")
        place[a] = b
    return place


def group_restore(directory: str, backend: str, *, place: Sequence[str] = (), plugins: Sequence[str] = (),
                  file_policy: Sequence[str] = (), pidns: bool = False, remap_path: Sequence[str] = (),
                  set_env: Sequence[str] = (), unset_env: Sequence[str] = (),
                  timeout: float = 60.0) -> GroupRestoreResult:
    """Restore every member of group image `directory` on its worker (or the one --place
    gives), all held until every one is rebuilt, then resumed together; GroupFailed
    naming the member that failed (every member made is killed)."""
    from .resources.filepolicy import parse_policy
    started = time.monotonic()
    directory = os.path.abspath(directory)
    group = read_group(directory)
    moved = parse_place(place, group)
    try:
        parse_policy(list(file_policy))
    except ValueError as err:
        raise UsageError(str(err)) from None
    client = connect(parse_backend(backend))
    try:
        targets = [moved.get(m["worker"], m["worker"]) for m in group["members"]]
        _workers(client, targets)
        token = uuid.uuid4().hex[:12]
        jobs, extra = _restore_jobs(client, directory, group, targets, token, timeout,
                                    {"plugins": list(plugins), "file_policy": list(file_policy), "pidns": pidns,
                                     "remap_path": list(remap_path), "set_env": list(set_env),
                                     "unset_env": list(unset_env)})
        outs = _run(client, token, restore_member, jobs, extra, timeout=timeout)
        failure = _first_failure(outs)
        if failure is not None:
            made = [o for o in outs if o["ok"]]
            for o in made:                        # the resume itself failed somewhere: undo the rest
                client.submit(kill_member, [o["pid"], o.get("init_pid", 0)], workers=[o["worker"]],
                              pure=False).result()
            raise GroupFailed("restore", failure["member"], failure["phase"], failure["error"],
                              f"{', '.join(o['member'] for o in made)} killed after it ran" if made
                              else "every member made was killed before it ran")
    finally:
        client.close()
    result = GroupRestoreResult(directory, seconds=time.monotonic() - started)
    for out in outs:
        result.members.append({k: out[k] for k in ("member", "worker", "host", "pid", "vpid", "init_pid", "seconds",
                                                   "warnings")})
    return result


def _restore_jobs(client, directory: str, group: dict, targets: list[str], token: str, timeout: float,
                  options: dict) -> tuple[list[dict], list[tuple]]:
    """One job per member, and its image's chunks scattered to the worker that restores it."""
    names = [m["member"] for m in group["members"]]
    jobs, extra = [], []
    for member, worker in zip(group["members"], targets):
        image = os.path.join(directory, member["directory"])
        man = manifest(image)
        chunks = client.scatter(dict(read_chunks(image, man)), workers=[worker], hash=False)
        jobs.append({"token": token, "members": names, "me": member["member"], "worker": worker,
                     "timeout": timeout, "manifest": man, **options,
                     "worker_image": member.get("worker_image", "") if worker == member["worker"] else ""})
        extra.append((chunks,))
    return jobs, extra
