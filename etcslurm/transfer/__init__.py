"""Transfer: the thin layer that moves planned state between devices.

``groups`` owns the torch.distributed process-group lifecycle (configure a generation,
tear it down completely); ``executor`` runs a :class:`~etcslurm.core.planner.MigrationPlan`
for one device: pack -> ``batch_isend_irecv`` -> verify checksum -> unpack.
"""
