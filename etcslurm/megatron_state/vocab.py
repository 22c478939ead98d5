"""The vocabulary tensors' padding rows: what a TP change adds, and how they are filled.

Why: megatron pads the vocabulary to a multiple of ``128 * tp``, so a TP change can grow
the embedding and the output layer by rows that no old layout had.  Those rows are not
lost state: the planner reports them as missing and the runtime fills them as
megatron-core's own resharded load does.
"""

from __future__ import annotations

from etcslurm.core.state import Piece

#: tensors whose axis 0 is the (padded) vocabulary
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")
#: how rows no old rank holds are filled: megatron-core's own resharded load
#: (``dist_checkpointing`` with ``allow_shape_mismatch=True`` on the embedding and output
#: layer) zeroes the tensor and reads only the rows the checkpoint has
VOCAB_FILL = "zeros"


def model_key(key: str) -> str:
    """The model tensor a piece key belongs to (``optimizer.state.<kind>.`` stripped)."""
    if key.startswith("optimizer.state."):
        return key.split(".", 3)[3]
    return key


def is_vocab_key(key: str) -> bool:
    """True for the word embedding, the output layer, and their optimizer state."""
    return model_key(key) in VOCAB_KEYS


def vocab_rows(pieces) -> dict[str, int]:
    """Rows held of every vocabulary tensor: ``{key: 1 + last row}`` over ``pieces``
    (analytic or live, one rank's or all ranks')."""
    rows: dict[str, int] = {}
    for p in pieces:
        if is_vocab_key(p.key):
            rows[p.key] = max(rows.get(p.key, 0), p.box[0][1])
    return rows


def vocab_padding(pieces, vocab: int) -> list[Piece]:
    """The parts of ``pieces`` that are vocabulary padding (rows >= ``vocab``, the true
    vocabulary size): never looked up by a token; their values only matter through the
    output layer's softmax."""
    out = []
    for p in pieces:
        (lo, hi), rest = p.box[0], p.box[1:]
        if is_vocab_key(p.key) and hi > max(lo, vocab):
            out.append(Piece(p.key, ((max(lo, vocab), hi), *rest), p.dtype))
    return out


def split_vocab_fill(missing, old_rows: dict[str, int] | int) -> tuple[list[Piece], list[Piece]]:
    """Split slices no surviving rank holds into ``(fill, lost)``.

    ``fill``: the parts in rows no OLD layout had at all -- vocabulary padding that
    appears because a TP change grew the padded vocabulary (rows ``[old_rows, new_rows)``
    of a vocabulary tensor).  They are not lost state: the runtime fills them as
    megatron-core's resharded load does (:data:`VOCAB_FILL`: zeros, for the param, its
    fp32 main copy and both Adam moments alike).  ``lost``: everything else (real state
    whose holders are gone).  ``old_rows``: :func:`vocab_rows` of the old holdings, or one
    row count for every vocabulary key (``padded_vocab(spec, old.tp)``).
    """
    fill: list[Piece] = []
    lost: list[Piece] = []
    for p in missing:
        if not is_vocab_key(p.key):
            lost.append(p)
            continue
        rows = old_rows if isinstance(old_rows, int) else old_rows.get(p.key, 0)
        (lo, hi), rest = p.box[0], p.box[1:]
        if hi > max(lo, rows):
            fill.append(Piece(p.key, ((max(lo, rows), hi), *rest), p.dtype))
        if lo < rows:
            lost.append(Piece(p.key, ((lo, min(hi, rows)), *rest), p.dtype))
    return fill, lost
