"""A template served to another process: ``python -m ptckpt.cloneserver IMAGE ...``.

A Dask worker runs its tasks on threads of its own, but only the thread that restored a
template may make copies of it (ptrace answers to one thread): each worker taking part
in a campaign starts one server, which holds the campaign's template (ptckpt.clones) and
makes the copies its task threads ask for.  One JSON object a line::

    server -> {"ready": PID}                 the template is held (PID: as the worker sees it)
    server -> {"error": TEXT, "exit_code": N}   it could not be made; the server ends
    client -> {"run": INDEX, "seed": S, "dir": DIR, "timeout": SECONDS}
    server -> {"index": INDEX, "status": N|null, "seconds": S, "timed_out": BOOL}
    client -> {"stop": INDEX}                 that run ended now (cancelled), nothing said
    client closes its end                    every copy and the template end, so does the server

A run's stdout, stderr and faults.json are written in its DIR, as by a campaign here.
The server dies with the process that started it (a parent-death signal), and its
template's namespace dies with the server.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .campaign_types import RunSpec
from .errors import PtckptError


def _say(out, message: dict) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def serve(image: str, inject: list[str], restore_args: list[str], jobs: int, stdin, stdout) -> int:
    """Hold the template, make the copies asked on `stdin`, say their ends on `stdout`."""
    from .clones import CloneBackend, template_for
    try:
        template = template_for(image, restore_args)
    except PtckptError as err:
        _say(stdout, {"error": str(err), "exit_code": int(err.exit_code)})
        return int(err.exit_code)
    backend = CloneBackend(template, inject, jobs)
    _say(stdout, {"ready": template.task.tgid})
    fd = stdin.fileno()
    pending = b""
    try:
        while True:
            for index, status, seconds, timed_out, _host in backend.collect():
                _say(stdout, {"index": index, "status": status, "seconds": seconds, "timed_out": timed_out})
            backend.sleep(fd)
            if not _readable(fd):
                continue
            data = os.read(fd, 65536)
            if not data:
                return 0
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in filter(None, lines):
                _request(backend, json.loads(line))
    finally:
        backend.cancel()


def _readable(fd: int) -> bool:
    import select
    return bool(select.select([fd], [], [], 0)[0])


def _request(backend, msg: dict) -> None:
    if "stop" in msg:
        backend.stop(int(msg["stop"]))
    else:
        backend.submit(RunSpec(int(msg["run"]), int(msg["seed"]), (), msg["dir"], float(msg["timeout"])))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ptckpt.cloneserver", description=__doc__.split("\n\n")[0])
    ap.add_argument("image")
    ap.add_argument("--inject", action="append", default=[])
    ap.add_argument("--restore-arg", action="append", default=[], help="one word of the campaign's restore options")
    ap.add_argument("--jobs", type=int, default=64, help="copies running at once")
    args = ap.parse_args(argv)
    return serve(args.image, args.inject, args.restore_arg, args.jobs, sys.stdin, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
