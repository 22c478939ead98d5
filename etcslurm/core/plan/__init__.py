"""The migration planner: old holdings + new needs → who plays which rank, what moves.

Pure and deterministic (no torch.distributed, no clocks in the result except
``stats.plan_seconds``): every rank replays :func:`plan` on the same :class:`PlanInputs`
JSON and gets the same :class:`MigrationPlan`.

A pipeline of stages over explicit intermediate results (:mod:`.pipeline` composes them):

========== ============================== ===========================================
stage      modules                        result
========== ============================== ===========================================
inputs     ``inputs``, ``part``           :class:`PlanInputs`, ``Devices`` (the order
                                          every tie is broken by)
index      ``index``, ``overlap``         an ``Index`` per layout, ``Overlap`` (what
                                          each needed piece is made of)
assign     ``assign``, ``matching``       ``Assignment`` (device per new rank, bytes
                                          in place, components)
sources    ``sources``, ``picker``        ``Routes`` (slices per (src, dst) pair,
                                          local copies, missing pieces)
schedule   ``schedule``                   ``Schedule`` (coalesced messages in rounds)
stats      ``stats``                      the plan's ``stats``
========== ============================== ===========================================

Scale comes from *classes*: devices with identical holdings (e.g. all DP replicas of a
(tp, pp) coordinate under plain Adam) are interchangeable, so overlaps are computed per
class pair, factorised by the sets of classes that hold/need each distinct piece, and the
assignment is one exact matching per connected component of the class overlap graph.

Precondition (true for megatron layouts): within one layout, two distinct pieces of the
same key are disjoint (shards are disjoint, replicas identical).
"""

from etcslurm.core.plan.inputs import PlanInputs
from etcslurm.core.plan.output import Message, MigrationPlan, Slice
from etcslurm.core.plan.pipeline import plan
from etcslurm.core.plan.schedule import message_cap

__all__ = ["Message", "MigrationPlan", "PlanInputs", "Slice", "message_cap", "plan"]
