"""A test plugin: while the tree is frozen, writes one byte into the FIFO named by
$PTCKPT_TEST_FIFO (a request the target left in flight on it completes meanwhile).

The completion of an AIO poll request is usually made by the write itself, but may be
left to a kernel worker (when the context's lock is busy): the plugin gives that worker
a moment, so that the completion is there before the dump looks for it."""

import os
import time

from ptckpt.plugins import Plugin


class FifoPoke(Plugin):
    name = "fifo-poke"
    version = "1.0"

    def frozen(self, proc, ctx):
        fd = os.open(os.environ["PTCKPT_TEST_FIFO"], os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
        time.sleep(0.2)
