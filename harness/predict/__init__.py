"""`harness predict`: step time, throughput, exposed communication and memory at GPU counts not measured.

An analytic model (`model`) of one training step as each stack schedules its collectives (the adapter's
`schedule`, backends/<stack>/schedule.py),
priced by a hardware profile (`hardware`: catalogue constants, or this machine's commbench records) and
calibrated by this suite's own records. Its output is labelled predicted everywhere, never mixed with
measurements.
"""
