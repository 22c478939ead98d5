"""Transfer: the thin layer that moves planned state between devices.

``executor`` runs one device's part of a :class:`~etcslurm.core.plan.MigrationPlan`:
pack -> send/recv -> verify checksum -> unpack.  The process groups it runs on come from
:mod:`etcslurm.groups.lifecycle`.
"""
