"""Entry point of every worker process: `python backends/worker.py RUN_DIR`, started by a launcher.

It sends this rank's stdout/stderr (the framework's native logs too) to RUN_DIR/rank{R}.log, builds the
backend's Trainer and runs the shared timed loop (or, for `harness commbench`, its Collectives and their
timing loop), and writes RUN_DIR/rank{R}.json atomically — also when the
rank fails, so the harness can say which rank broke and why. Before a training rank's collective trace it
also writes RUN_DIR/rank{R}.measured.json, everything measured (again with the trace, before teardown),
which the harness keeps if the rank dies while tracing or tearing down.
"""

import importlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends import get_backend  # noqa: E402
from backends.commbench import run_collectives  # noqa: E402
from backends.loop import rank_from_env, record_failure, record_termination, run_training  # noqa: E402
from core.config import RunConfig  # noqa: E402
from core.process import die_with_parent  # noqa: E402
from core.records import write_json_atomic  # noqa: E402


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
    cfg = RunConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
    try:
        backend = get_backend(cfg.backend)
        if cfg.commbench:  # `harness commbench`: time the stack's collectives instead of training
            comm = importlib.import_module(backend.collectives_module).make_collectives(cfg)
            record = run_collectives(comm, cfg)
            comm.close()
        else:
            trainer = importlib.import_module(backend.worker_module).make_trainer(cfg)
            measured_path = run_dir / f"rank{rank}.measured.json"
            record = run_training(
                trainer,
                cfg,
                run_dir / "weights_rank0.npz" if cfg.dump_weights else None,
                checkpoint=lambda measured: write_json_atomic(measured_path, measured),
            )
            trainer.close()
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a recorded result
        record_failure(run_dir / f"rank{rank}.json", exc)
        return 1
    write_json_atomic(run_dir / f"rank{rank}.json", record)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
