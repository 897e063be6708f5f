"""Fault tolerance across replica groups (FT-HSDP): lighthouse, quorum client,
fault-tolerant all-reduce, replica restart and non-blocking catch-up.

Not built yet: this package is reserved by the layout (DESIGN.md) and filled by
the fault-tolerance issue.  Importing it provides nothing so far.
"""
