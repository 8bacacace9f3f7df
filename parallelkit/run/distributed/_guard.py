"""Start a cluster process that dies with its launcher (Linux): ``python _guard.py LAUNCHER_PID command...``.

Asks the kernel to SIGKILL this process when the launcher dies (``PR_SET_PDEATHSIG``,
which survives ``exec``), then becomes ``command``. Run by file path, not with
``-m``, so that it starts in milliseconds without importing parallelkit or JAX.
Setting the signal in the launcher instead (``preexec_fn``) would fork a process
that runs JAX's threads, which JAX warns may deadlock.
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def main(argv: list[str]) -> None:
    launcher, command = int(argv[0]), argv[1:]
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != launcher:  # the launcher died before the request took effect
        sys.exit(1)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
