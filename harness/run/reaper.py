"""The harness's reaper: kills a run's processes if the harness dies before it could.

Started by harness.run.launch in its own session (a SIGKILL or Ctrl-C of the harness's process group does not
reach it). It reads the pids of the session leaders the harness starts, one per line, from stdin. "done"
means the harness cleaned up itself; end of input without it means the harness died, and the reaper
SIGTERMs those sessions and SIGKILLs what is left after the grace period, as the harness would have.
"""

import signal
import sys

from harness.run.launch import kill_sessions


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the harness; the harness cleans up
    leaders = []
    for line in sys.stdin:
        if line.strip() == "done":
            return 0
        leaders.append(int(line))
    kill_sessions(leaders)
    return 0


if __name__ == "__main__":
    sys.exit(main())
