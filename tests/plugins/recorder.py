"""A test plugin: records every event it gets (into $PTCKPT_TEST_LOG), saves data, elects the
last holder of a shared resource, and claims fd 9 (the test's TCP connection) as external."""

import json
import os
import socket

from ptckpt.plugins import Plugin


def _log(event, proc, **more):
    with open(os.environ["PTCKPT_TEST_LOG"], "a") as f:
        f.write(json.dumps(dict(event=event, pid=proc.vpid if proc else None, **more)) + "\n")


class Recorder(Plugin):
    name = "recorder"
    version = "1.0"

    def pre_dump(self, proc, ctx):
        _log("pre_dump", proc)

    def shared(self, resource, ctx):
        _log("shared", None, what=resource.what, holders=sorted(p for p, _ in resource.holders))
        return max(p for p, _ in resource.holders)

    def frozen(self, proc, ctx):
        counter = proc.read_symbol("counter", 8) if "COUNTER_SYM" in os.environ else b""
        ctx.save(f"state of {proc.vpid}".encode(), key="state", pid=proc.vpid)
        if any(f.fd == 9 for f in proc.fds):
            ctx.claim_external(proc.vpid, 9, "recorder: the test server")
        _log("frozen", proc, regs=proc.registers()["rip"] != 0, counter=len(counter),
             getpid=proc.syscall("getpid"))

    def post_dump(self, proc, ctx):
        _log("post_dump", proc)

    def pre_restore(self, proc, ctx):
        data = ctx.load(key="state", pid=proc.vpid)
        if any(f.fd == 9 and f.external for f in proc.fds):
            ctx.claim_external(proc.vpid, 9)
        _log("pre_restore", proc, data=data.decode() if data else None)

    def restored(self, proc, ctx):
        if any(f.fd == 9 and f.external for f in proc.fds):
            port = int(os.environ["PTCKPT_TEST_PORT"])
            with socket.create_connection(("127.0.0.1", port)) as s:
                proc.install_fd(9, s.fileno())
        _log("restored", proc, getpid=proc.syscall("getpid"))

    def resumed(self, proc, ctx):
        _log("resumed", proc)
