"""Running a little code in forked children, for tests of what a fork must not share with its parent."""

from __future__ import annotations

import os
from collections.abc import Callable


def in_forked_children(make: Callable[[], str], children: int = 2) -> list[str]:
    """What ``make`` returns in each of ``children`` processes forked one after the other from this one."""
    out = []
    for _ in range(children):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: run, report, leave without running the parent's cleanup
            try:
                os.write(write, make().encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            out.append(pipe.read())
        os.waitpid(pid, 0)
    return out
