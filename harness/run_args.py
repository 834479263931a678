"""Moved to harness.arguments (the one path from arguments to a RunConfig); these names stay importable from
here until the modules that still import them from here have switched."""

from harness.arguments import foreign_flags, micro_batch_for, spec_from_args  # noqa: F401
