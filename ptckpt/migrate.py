"""``ptckpt migrate PID --to ADDRESS``: move a running process tree to a page server.

1. Connect and authenticate first: nothing touches the process if the other side is
   not there or refuses the token.
2. Pre-dump rounds while the tree runs (ptckpt.increment: memory tracked with
   userfaultfd write-protection): the first writes all memory, each later one only what
   changed since; each is sent while the tree runs on.
3. The final dump (frozen) writes only what changed since the last round; with the tree
   still frozen, it is sent, and the other side restores the chain (``restore
   --detach`` with the options given, e.g. --pidns, --lazy).
4. Only once the other side says the tree runs there is the tree killed here.  On any
   failure before that (the connection breaks, the other side refuses, its restore
   fails) the tree resumes here, where it was, and the error is said.

Downtime = from the final freeze to the kill here, after the other side runs: the
result's ``downtime`` (the final dump's frozen time).  The images are made in a private
temporary directory, removed at the end.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from . import transfer
from .errors import UsageError

log = logging.getLogger("ptckpt.migrate")


@dataclass
class MigrateResult:
    pid: int                        # here
    remote_pid: int = 0             # there, as the other side sees it
    remote_vpid: int = 0
    rounds: int = 0
    sent_bytes: int = 0
    round_bytes: list[int] = field(default_factory=list)
    final_bytes: int = 0
    downtime: float = 0.0
    seconds: float = 0.0
    remote: dict = field(default_factory=dict)   # the other side's restore result

    def summary(self) -> str:
        return (f"migrated {self.pid} to pid {self.remote_pid} there in {self.seconds:.3f} s: "
                f"{self.rounds} pre-dump round(s) of {', '.join(f'{b / 2**20:.1f}' for b in self.round_bytes)} MiB "
                f"while it ran, a final dump of {self.final_bytes / 2**20:.1f} MiB; downtime {self.downtime * 1e3:.0f} ms")


def migrate(pid: int, address: str, token: bytes, *, rounds: int = 2, restore_args: Sequence[str] = (),
            plugins: Sequence = (), workdir: str | None = None) -> MigrateResult:
    """Move `pid`'s tree to the page server at `address` (see the module docstring); the
    dumps get `plugins` (e.g. one that drops an external connection), the restore there
    `restore_args` (restore options from transfer.RESTORE_FLAGS / RESTORE_VALUED)."""
    from .dump import DumpMode
    from .pipeline.dump import dump
    if rounds < 0:
        raise UsageError("--rounds must be 0 or more")
    args = transfer.restore_args(restore_args)
    started = time.monotonic()
    result = MigrateResult(pid)
    work = tempfile.mkdtemp(prefix=f"ptckpt-migrate-{pid}-", dir=workdir)
    bundle = f"migrate-{pid}-{secrets.token_hex(4)}"
    chan = transfer.connect(address, token)
    try:
        prev = None
        for i in range(rounds):
            image = os.path.join(work, f"pre{i}")
            log.info("pre-dump round %d of %d", i + 1, rounds)
            dump(pid, image, pre_dump=True, prev=prev, track_mem=True, plugins=plugins)
            sent = transfer.send_image(chan, image, bundle)
            result.round_bytes.append(sent)
            result.sent_bytes += sent
            result.rounds += 1
            prev = image
        final = os.path.join(work, "final")

        def ship(dumped) -> None:
            log.info("send the final image and restore it at %s", address)
            sent = transfer.send_image(chan, final, bundle)
            result.final_bytes = sent
            result.sent_bytes += sent
            result.remote = transfer.remote_restore(chan, f"{bundle}/final", args)
            log.info("it runs there as %s: kill it here", result.remote.get("pid"))

        dumped = dump(pid, final, mode=DumpMode.KILL, prev=prev, plugins=plugins, before_release=ship)
        result.downtime = dumped.frozen_seconds
        result.remote_pid = int(result.remote.get("pid", 0))
        result.remote_vpid = int(result.remote.get("vpid", 0))
        chan.send({"op": "bye"})
    finally:
        chan.close()
        shutil.rmtree(work, ignore_errors=True)
    result.seconds = time.monotonic() - started
    return result
