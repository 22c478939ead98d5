"""Which transformer layers each pipeline stage and virtual chunk holds (pure arithmetic).

megatron-core's rules (``get_num_layers_to_build`` and ``get_transformer_layer_offset``):
with even stages every one of the ``pp * vpp`` chunks holds ``layers / (pp * vpp)``
consecutive layers, chunk ``v`` of stage ``p`` the ``(v * pp + p)``-th run of them; with
uneven stages (``first_stage_layers`` / ``last_stage_layers`` of the spec) the first and
last stages hold the numbers given and the middle stages split the rest evenly, and with
an interleaved pipeline each stage's layers are split over its ``vpp`` chunks.  The uneven
sizes apply only when ``pp > 1``: with one stage it holds every layer (megatron would give
it ``last_stage_layers``, so etcslurm never passes them to a one-stage model).

Why here and not in the adapter: the planner, the memory estimate and the layout rules
all need the split before any model exists.
"""

from __future__ import annotations

from etcslurm.core.models import GPTSpec


def uneven(spec: GPTSpec, pp: int) -> tuple[int | None, int | None]:
    """The (first, last) stage sizes megatron is given under ``pp`` stages (None: even)."""
    if pp == 1:
        return None, None
    return spec.first_stage_layers, spec.last_stage_layers


def split_problems(spec: GPTSpec, pp: int, vpp: int) -> list[str]:
    """Why ``spec``'s layers cannot be split over ``pp`` stages of ``vpp`` chunks (empty:
    they can), in megatron-core's own terms."""
    if vpp > 1 and pp == 1:
        return [f"vpp={vpp} needs pp > 1 (an interleaved pipeline has several stages)"]
    first, last = uneven(spec, pp)
    if first is None and last is None:
        if spec.layers % (pp * vpp):
            by = f"pp={pp}" if vpp == 1 else f"pp*vpp={pp * vpp}"
            return [f"layers={spec.layers} is not divisible by {by}"]
        return []
    out: list[str] = []
    middle_layers, middle_stages = spec.layers, pp
    for name, size in (("first_stage_layers", first), ("last_stage_layers", last)):
        if size is None:
            continue
        if size % vpp:
            out.append(f"{name}={size} is not divisible by vpp={vpp}")
        middle_layers -= size
        middle_stages -= 1
    if middle_layers < 0:
        out.append(f"first and last stages take more than the {spec.layers} layers")
    elif bool(middle_layers) != bool(middle_stages):
        out.append(f"{middle_layers} layers are left for {middle_stages} middle stages "
                   f"(pp={pp})")
    elif middle_stages and middle_layers % middle_stages:
        out.append(f"the {middle_layers} middle layers do not split over {middle_stages} "
                   f"middle stages (pp={pp})")
    elif middle_stages and (middle_layers // middle_stages) % vpp:
        out.append(f"{middle_layers // middle_stages} layers per middle stage are not "
                   f"divisible by vpp={vpp}")
    return out


def stage_layer_count(spec: GPTSpec, pp: int, pp_rank: int) -> int:
    """Transformer layers on pipeline stage ``pp_rank`` (all of its chunks)."""
    first, last = uneven(spec, pp)
    if first is None and last is None:
        return spec.layers // pp
    if pp_rank == 0 and first is not None:
        return first
    if pp_rank == pp - 1 and last is not None:
        return last
    middle_stages = pp - (first is not None) - (last is not None)
    return (spec.layers - (first or 0) - (last or 0)) // middle_stages


def chunk_layers(spec: GPTSpec, pp: int, vpp: int, pp_rank: int, chunk: int) -> range:
    """The global layer numbers chunk ``chunk`` of stage ``pp_rank`` holds (megatron's
    layer offset and count for ``vp_stage=chunk``)."""
    count = stage_layer_count(spec, pp, pp_rank) // vpp
    first, last = uneven(spec, pp)
    if first is None and last is None:
        per_chunk = spec.layers // (pp * vpp)
        start = chunk * (spec.layers // vpp) + pp_rank * per_chunk
        return range(start, start + count)
    first_n, last_n = first or 0, last or 0
    middle_stages = pp - (first is not None) - (last is not None)
    middle_chunk = (spec.layers - first_n - last_n) // vpp  # middle layers per chunk index
    per_round = first_n // vpp + middle_chunk + last_n // vpp
    if pp_rank == 0:
        start = chunk * per_round
    else:
        middle_rank = pp_rank if first is None else pp_rank - 1
        per_middle = middle_chunk // middle_stages if middle_stages else 0
        start = chunk * per_round + first_n // vpp + middle_rank * per_middle
    return range(start, start + count)


def rank_layers(spec: GPTSpec, pp: int, vpp: int, pp_rank: int) -> list[range]:
    """Every chunk's layers on stage ``pp_rank``, chunk 0 first."""
    return [chunk_layers(spec, pp, vpp, pp_rank, v) for v in range(vpp)]
