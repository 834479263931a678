"""The harness's reaper: kills a run's processes if the harness dies before it could.

Started by harness.run.launch in its own session (a SIGKILL or Ctrl-C of the harness's process group does not
reach it). It reads the pids of the session leaders the harness starts, one per line, from stdin, and
"leftover <glob>" lines naming what the run leaves outside its directory. "done" means the harness cleaned up
itself; end of input without it means the harness died, and the reaper SIGTERMs those sessions, SIGKILLs
what is left after the grace period and removes the leftovers, as the harness would have.
"""

import signal
import sys

from harness.run.launch import kill_sessions, remove_leftovers


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the harness; the harness cleans up
    leaders, leftovers = [], []
    for line in sys.stdin:
        if line.strip() == "done":
            return 0
        if line.startswith("leftover "):
            leftovers.append(line.removeprefix("leftover ").rstrip("\n"))
        else:
            leaders.append(int(line))
    kill_sessions(leaders)
    remove_leftovers(leftovers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
