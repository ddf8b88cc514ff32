"""A test plugin: while the tree is frozen, writes one byte into the FIFO named by
$PTCKPT_TEST_FIFO (a request the target left in flight on it completes meanwhile)."""

import os

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
