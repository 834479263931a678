"""Running: one run, its nodes and processes, sweeps, plans, scheduler job files, doctor."""
