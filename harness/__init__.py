"""distbench harness: CLI, launching, records, metrics, reports. Imports no ML framework."""
