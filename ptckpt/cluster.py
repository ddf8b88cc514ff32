"""Campaigns on a Dask cluster: ``ptckpt campaign --backend dask://HOST:PORT``
(``pip install 'ptckpt[cluster]'``, dask.distributed).

Each run is a task submitted to an existing scheduler.  The worker that takes it:

* makes sure it holds the image: images move as content-addressed chunks (4 MiB of a
  file, zstd-compressed, named by the sha256 of their raw bytes), scattered into the
  cluster once by the campaign (and published as a dataset); a worker lacking the image
  gathers them, checks each against its name, and keeps the image in its cache directory
  ($PTCKPT_IMAGE_CACHE, else ~/.cache/ptckpt/images) under the image's digest (the
  sha256 of its manifest), so it fetches it once whatever number of runs it makes.  No
  shared file system is assumed for the image (the program's own files, and plugins
  named by path, must be at the same paths on every worker, as for any restore);
* runs the same ``ptckpt restore --pidns ...`` command as the local backend, with the
  cached image and a run directory of its own, kills the run's pid namespace at the
  timeout, and returns its status, stdout, stderr and faults.json, which the campaign
  writes into OUT/runs/NNNN as the local backend does: the results and the outcome
  table are the same, but for timings and host names.

A worker lost mid-run: the scheduler runs the task again elsewhere (its own retry
rule), and the campaign records the result it gets once.  The restore runs with a
parent-death signal: a worker process that dies takes its runs' namespaces with it.
Cancelling (the campaign ends, fails or gets Ctrl-C) sets a cluster Event that every
running task watches (it kills its run), and cancels the rest.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

from .campaign_types import Backend, RunSpec, kill_run
from .errors import UsageError

CHUNK = 4 << 20
PYTHON, IMAGE, RUN = "{PYTHON}", "{IMAGE}", "{RUN}"


def _need_distributed():
    try:
        import distributed
    except ImportError:
        raise UsageError("the dask backend needs dask.distributed: pip install 'ptckpt[cluster]'") from None
    return distributed


def cache_dir() -> str:
    return os.environ.get("PTCKPT_IMAGE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ptckpt", "images")


# --- images as content-addressed chunks --------------------------------------------------

def manifest(directory: str) -> dict:
    """{"files": [[name, size, mode, [chunk sha256, ...]], ...], "digest": sha256 of the rest}
    of an image without parents (every regular file directly in it)."""
    from .formats.image import ImageReader
    with ImageReader(directory, verify_pages=False) as reader:
        if reader.inventory.parent:
            raise UsageError(f"{directory} is an incremental image (its parent: {reader.inventory.parent}): "
                             f"fold it first, `ptckpt compact -D {directory} -o NEW`, and run the campaign on NEW")
    files = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        sums = []
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                sums.append(hashlib.sha256(chunk).hexdigest())
        st = os.stat(path)
        files.append([name, st.st_size, st.st_mode & 0o777, sums])
    body = json.dumps(files, separators=(",", ":")).encode()
    return {"files": files, "digest": hashlib.sha256(body).hexdigest()}


def chunk_key(digest: str) -> str:
    return f"ptckpt-chunk-{digest}"


def read_chunks(directory: str, man: dict):
    """(key, compressed bytes) of every distinct chunk of the image."""
    import zstandard
    comp = zstandard.ZstdCompressor(level=3)
    seen = set()
    for name, _size, _mode, sums in man["files"]:
        with open(os.path.join(directory, name), "rb") as f:
            for digest in sums:
                chunk = f.read(CHUNK)
                if digest not in seen:
                    seen.add(digest)
                    yield chunk_key(digest), comp.compress(chunk)


def write_image(man: dict, blobs: dict, directory: str) -> None:
    """The files of image `man` written into `directory` (it exists) from `blobs` ({chunk
    sha256: compressed bytes}), each chunk checked against its name."""
    import zstandard
    dec = zstandard.ZstdDecompressor()
    for name, size, mode, sums in man["files"]:
        fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            for digest in sums:
                raw = dec.decompress(blobs[digest], max_output_size=CHUNK)
                if hashlib.sha256(raw).hexdigest() != digest:
                    raise RuntimeError(f"chunk {digest} of {name} arrived corrupt")
                f.write(raw)
            if f.tell() != size:
                raise RuntimeError(f"{name}: {f.tell()} bytes arrived, {size} expected")
        os.chmod(os.path.join(directory, name), mode)


def ensure_image(man: dict, fetch) -> str:
    """The image's directory in this host's cache, fetched (`fetch(keys) -> [bytes]`) and
    checked chunk by chunk when it is not there yet; one fetch per host at a time."""
    root = cache_dir()
    os.makedirs(root, mode=0o700, exist_ok=True)
    final = os.path.join(root, man["digest"])
    if os.path.exists(os.path.join(final, ".complete")):
        return final
    with open(os.path.join(root, f"{man['digest']}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(os.path.join(final, ".complete")):
            return final
        tmp = tempfile.mkdtemp(prefix=f"{man['digest']}.", dir=root)
        try:
            wanted = sorted({d for _n, _s, _m, sums in man["files"] for d in sums})
            write_image(man, dict(zip(wanted, fetch([chunk_key(d) for d in wanted]))), tmp)
            open(os.path.join(tmp, ".complete"), "w").close()
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            os.chmod(final, 0o700)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


# --- the task a worker runs ---------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def run_on_worker(job: dict) -> dict:
    """A Dask task: one campaign run on this worker (see the module docstring)."""
    from distributed import Event, get_client
    client = get_client()

    def fetch(keys: list[str]) -> list[bytes]:
        held = client.get_dataset(job["dataset"])      # the campaign's futures of the chunks
        return client.gather([held[k] for k in keys])
    image = ensure_image(job["manifest"], fetch)
    rundir = tempfile.mkdtemp(prefix=f"ptckpt-run-{job['index']}-")
    cancel = Event(job["cancel"], client=client)
    try:
        server = _clone_server(job, image) if job.get("clones") else None
        if server is not None:
            status, seconds, timed_out, cancelled = server.run(job, rundir, cancel.is_set)
        else:
            status, seconds, timed_out, cancelled = _restore_run(job, image, rundir, cancel.is_set)

        def read(name: str) -> bytes | None:
            try:
                with open(os.path.join(rundir, name), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None
        return {"index": job["index"], "status": status, "seconds": seconds, "timed_out": timed_out,
                "cancelled": cancelled, "stdout": read("stdout"), "stderr": read("stderr"),
                "faults": read("faults.json"), "host": socket.gethostname(), "copy": server is not None}
    finally:
        shutil.rmtree(rundir, ignore_errors=True)


def _restore_run(job: dict, image: str, rundir: str, cancelled) -> tuple[int | None, float, bool, bool]:
    """The run as a `ptckpt restore` command: (status, seconds, timed out, cancelled)."""
    argv = [sys.executable if a == PYTHON else a.replace(IMAGE, image).replace(RUN, rundir) for a in job["argv"]]
    started = time.monotonic()
    with open(os.path.join(rundir, "stdout"), "wb") as out, open(os.path.join(rundir, "stderr"), "wb") as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
                                close_fds=True, preexec_fn=_die_with_parent)
    timed_out = was_cancelled = False
    checked = started
    while proc.poll() is None:
        now = time.monotonic()
        if now - started > job["timeout"]:
            timed_out = True
        elif now - checked > 0.5:
            checked = now
            was_cancelled = cancelled()
        if timed_out or was_cancelled:
            kill_run(proc)
            break
        time.sleep(0.02)
    status = proc.returncode
    return (None if timed_out else (128 - status if status < 0 else status), time.monotonic() - started,
            timed_out, was_cancelled)


# --- a template per worker ----------------------------------------------------------------

_SERVERS: dict[str, _CloneServer] = {}
_SERVERS_LOCK = threading.Lock()


class _CloneServer:
    """This worker's template of one campaign (python -m ptckpt.cloneserver), shared by
    its task threads: each asks for its run and waits for the answer."""

    def __init__(self, job: dict, image: str):
        argv = [sys.executable, "-m", "ptckpt.cloneserver", image, *(f"--inject={t}" for t in job["inject"]),
                *(f"--restore-arg={a}" for a in job["restore_args"])]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     start_new_session=True, close_fds=True, preexec_fn=_die_with_parent)
        first = json.loads(self.proc.stdout.readline() or b'{"error": "the template server ended"}')
        self.error = first.get("error")
        self.answers: dict[int, dict] = {}
        self.changed = threading.Condition()
        self.writing = threading.Lock()
        if self.error is None:
            threading.Thread(target=self._read, daemon=True, name="ptckpt-clone-answers").start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.changed:
                self.answers[msg["index"]] = msg
                self.changed.notify_all()
        with self.changed:
            self.error = "the template server ended"
            self.changed.notify_all()

    def _send(self, msg: dict) -> None:
        with self.writing:
            self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
            self.proc.stdin.flush()

    def run(self, job: dict, rundir: str, cancelled) -> tuple[int | None, float, bool, bool]:
        index = job["index"]
        self._send({"run": index, "seed": job["seed"], "dir": rundir, "timeout": job["timeout"]})
        started = time.monotonic()
        with self.changed:
            while index not in self.answers:
                if self.error is not None:
                    raise RuntimeError(f"run {index}: {self.error}")
                self.changed.wait(0.5)
                if index not in self.answers and cancelled():
                    self._send({"stop": index})
                    return None, time.monotonic() - started, False, True
            got = self.answers.pop(index)
        return got["status"], got["seconds"], got["timed_out"], False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _clone_server(job: dict, image: str) -> _CloneServer | None:
    """The campaign's template server on this worker, started by its first run; None when
    the template could not be made here (the runs restore the image, as without)."""
    with _SERVERS_LOCK:
        server = _SERVERS.get(job["token"])
        if server is None:
            server = _SERVERS[job["token"]] = _CloneServer(job, image)
    return None if server.error is not None else server


def stop_clone_servers(token: str) -> int:
    """On every worker, at the campaign's end (Client.run): its template server goes."""
    with _SERVERS_LOCK:
        server = _SERVERS.pop(token, None)
    if server is not None:
        server.close()
    return 0 if server is None else 1


# --- the backend --------------------------------------------------------------------------

def connect(address: str, timeout: float = 30.0):
    """A distributed.Client of the scheduler at `address` (tcp://HOST:PORT or HOST:PORT);
    UsageError, one line, when nothing answers there."""
    distributed = _need_distributed()
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    try:                                          # a refused port fails now, not at the timeout
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except (OSError, ValueError) as err:
        raise UsageError(f"no Dask scheduler at {address}: {getattr(err, 'strerror', None) or err}") from None
    try:
        return distributed.Client(address, timeout=timeout)
    except (OSError, TimeoutError) as err:
        raise UsageError(f"no Dask scheduler at {address}: {err}") from None


class DaskBackend(Backend):
    """Runs as tasks of a Dask scheduler at `address` (tcp://HOST:PORT)."""

    def __init__(self, address: str, image: str, connect_timeout: float = 30.0):
        distributed = _need_distributed()
        self._distributed = distributed
        self.image = os.path.abspath(image)
        man = manifest(self.image)
        self.client = connect(address, connect_timeout)
        self.token = uuid.uuid4().hex[:12]
        self.manifest = man
        # the chunks live in the cluster (held by these futures) until the campaign ends
        self.chunks = self.client.scatter(dict(read_chunks(self.image, man)), hash=False)
        self.dataset = f"ptckpt-image-{man['digest'][:16]}-{self.token}"
        self.client.publish_dataset(self.chunks, name=self.dataset)
        self.cancel_event = distributed.Event(f"ptckpt-cancel-{self.token}", client=self.client)
        self.running: dict = {}                       # future -> RunSpec
        self.clones: tuple | None = None              # (inject, restore args): a template per worker
        self.copies: set[bool] = set()                # how the runs went: copies, restores

    def use_clones(self, inject, restore_args) -> None:
        """Runs as copies of a template each worker holds (ptckpt.cloneserver); a worker
        that cannot make it restores the image for each run instead."""
        self.clones = (list(inject), list(restore_args))

    @property
    def runs_as(self) -> str:
        return {frozenset({True}): "copies of a template", frozenset({True, False}): "copies of a template and restores"
                }.get(frozenset(self.copies), "restores")

    def submit(self, run: RunSpec) -> None:
        argv = []
        for a in run.argv:
            if a == sys.executable:
                a = PYTHON
            argv.append(a.replace(self.image, IMAGE).replace(run.directory, RUN))
        job = {"index": run.index, "argv": argv, "timeout": run.timeout, "manifest": self.manifest,
               "cancel": f"ptckpt-cancel-{self.token}", "dataset": self.dataset, "token": self.token,
               "seed": run.seed}
        if self.clones is not None:
            job.update(clones=True, inject=self.clones[0], restore_args=self.clones[1])
        future = self.client.submit(run_on_worker, job, key=f"ptckpt-run-{self.token}-{run.index}", pure=False)
        self.running[future] = run

    def wait(self) -> list[tuple[int, int | None, float, bool, str]]:
        if not self.running:
            return []
        done, _rest = self._distributed.wait(list(self.running), return_when="FIRST_COMPLETED")
        out = []
        for future in done:
            run = self.running.pop(future)
            os.makedirs(run.directory, mode=0o700, exist_ok=True)
            try:
                res = future.result()
            except Exception as err:                  # noqa: BLE001 - the run's outcome: error
                res = {"status": None, "seconds": 0.0, "timed_out": False, "stdout": b"", "host": "",
                       "stderr": f"ptckpt: error: the Dask task of run {run.index} failed: "
                                 f"{type(err).__name__}: {err}\n".encode(), "faults": None}
            for name, data in (("stdout", res["stdout"]), ("stderr", res["stderr"]), ("faults.json", res["faults"])):
                if data is not None:
                    fd = os.open(os.path.join(run.directory, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
            self.copies.add(bool(res.get("copy")))
            out.append((run.index, res["status"], res["seconds"], res["timed_out"], res["host"]))
        return out

    def cancel(self) -> None:
        with contextlib.suppress(Exception):
            self.cancel_event.set()
            self.client.cancel(list(self.running), force=True)
            self.running.clear()
            self.client.unpublish_dataset(self.dataset)
            self.client.cancel(list(self.chunks.values()), force=True)
            time.sleep(0.6)                           # the tasks look at the event twice a second
            self.cancel_event.clear()
        if self.clones is not None:
            with contextlib.suppress(Exception):
                self.client.run(stop_clone_servers, self.token)
        with contextlib.suppress(Exception):
            self.client.close()
