"""Entry point of every worker process: `python backends/worker.py RUN_DIR`, started by a launcher.

It sends this rank's stdout/stderr (the framework's native logs too) to RUN_DIR/rank{R}.log, builds the
backend's Trainer and runs the shared timed loop (or, for `harness commbench`, its Collectives and their
timing loop), and writes what happens to its event stream RUN_DIR/rank{R}.events.jsonl (core.events): its
start, the loop's phases and steps, everything measured before its collective trace, and its result, also
when the rank fails, so the harness can say which rank broke and why. Test hooks (core.hooks) come from
RUN_DIR/test_hooks.json where the harness wrote one.
"""

import importlib
import json
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends import get_backend  # noqa: E402
from backends.commbench import run_collectives  # noqa: E402
from backends.faults import record_failure, record_termination  # noqa: E402
from backends.loop import run_training  # noqa: E402
from backends.process_stats import rank_from_env  # noqa: E402
from core.config import RunConfig  # noqa: E402
from core.events import RESULT, RUN_START, EventLog, events_path  # noqa: E402
from core.hooks import TestHooks  # noqa: E402
from core.process import die_with_parent  # noqa: E402


def redirect_output(log_path: Path) -> None:
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)


def main(run_dir: Path) -> int:
    die_with_parent()
    record_termination()
    rank = rank_from_env()
    redirect_output(run_dir / f"rank{rank}.log")
    events = EventLog(events_path(run_dir, rank), rank)
    try:
        cfg = RunConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
        hooks = TestHooks.read(run_dir)
        events.emit(
            RUN_START,
            kind="commbench" if cfg.role.commbench else "training",
            backend=cfg.backend,
            world_size=cfg.topology.world_size,
            process_group_size=cfg.process_group_size,
            isolated_index=cfg.role.isolated_index,
            host=socket.gethostname(),
            pid=os.getpid(),
            test_hooks=hooks.to_dict(),
        )
        backend = get_backend(cfg.backend)
        if cfg.role.commbench:  # `harness commbench`: time the stack's collectives instead of training
            comm = importlib.import_module(backend.collectives_module).make_collectives(cfg)
            record = run_collectives(comm, cfg, hooks)
            comm.close()
        else:
            trainer = importlib.import_module(backend.worker_module).make_trainer(cfg)
            weights = run_dir / "weights_rank0.npz" if cfg.role.dump_weights else None
            record = run_training(trainer, cfg, events, hooks, weights)
            trainer.close()
        events.emit(RESULT, record=record)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a recorded result
        record_failure(events, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
