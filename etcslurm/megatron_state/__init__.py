"""megatron-core's training state, computed without torch: which pieces of which global
tensors every rank of a layout holds, as the generic core's :class:`~etcslurm.core.state.Piece`.

This mirrors megatron-core 0.16.1 (local GPT layer spec, ``GPTModel.sharded_state_dict()``
keys, DDP buffers and the distributed optimizer's shards) so that a plan for 10k GPUs needs
no GPU.  The generic core (layouts, pieces, the planner) knows nothing of megatron; this
package is what ties the two, and the one place to change when megatron-core's layout does.

* :mod:`.params`: one pipeline stage's parameters (TP/EP splits, SwiGLU halves, MoE);
* :mod:`.buffers`: DDP's param-and-grad buffers and the ZeRO-1 shards of them;
* :mod:`.expand`: every rank's holdings under a layout, grouped into classes;
* :mod:`.vocab`: the vocabulary padding rows a TP change adds, and their fill;
* :mod:`.planning`: plans for a GPT model between layouts (``plan_migration``).
"""

from etcslurm.megatron_state.buffers import buffer_layout, ddp_bucket_size
from etcslurm.megatron_state.expand import (
    OPTIMIZERS,
    LayoutState,
    check_model,
    check_optimizer,
    expand,
    rank_pieces,
)
from etcslurm.megatron_state.params import (
    DEFAULT_VOCAB_PAD_TP,
    ParamDef,
    padded_vocab,
    stage_params,
)
from etcslurm.megatron_state.vocab import (
    VOCAB_FILL,
    VOCAB_KEYS,
    is_vocab_key,
    model_key,
    split_vocab_fill,
    vocab_padding,
    vocab_rows,
)

__all__ = [
    "DEFAULT_VOCAB_PAD_TP", "OPTIMIZERS", "VOCAB_FILL", "VOCAB_KEYS", "LayoutState",
    "ParamDef", "buffer_layout", "check_model", "check_optimizer", "ddp_bucket_size",
    "expand", "is_vocab_key", "model_key", "padded_vocab", "rank_pieces", "split_vocab_fill",
    "stage_params", "vocab_padding", "vocab_rows",
]
