"""Framework-free layer shared by the harness and the workers: run config, records, process helpers."""
