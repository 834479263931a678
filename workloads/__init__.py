"""Workloads: the framework-free model spec and data, plus one model file per framework."""
