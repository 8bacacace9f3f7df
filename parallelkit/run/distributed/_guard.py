"""Start a cluster process that dies with its launcher (Linux): ``python _guard.py LAUNCHER_PID command...``."""

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
