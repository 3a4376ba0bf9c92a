"""dilocox.model: the decoder (GPT-2 / OPT / Qwen) and Megatron-style tensor parallelism.

- ``parallel_layers``: TP mappings, column/row-parallel linear, vocab-parallel embedding and
  cross-entropy, global grad-norm clipping across TP x PP.
- ``transformer``: ``build_stage_model`` (one pipeline stage on one TP rank), ``StageModel``,
  ``param_layer_id``, ``model_flops_per_token``.
- ``attention``: kernels sdpa | flash_attn | te.  ``fp8``: float8 linear (``_scaled_mm`` / emulate).
"""

from dilocox.model.parallel_layers import (  # noqa: F401
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    clip_grad_norm_,
    is_tensor_parallel,
    vocab_parallel_cross_entropy,
)
from dilocox.model.transformer import (  # noqa: F401
    StageModel,
    build_model,
    build_stage_model,
    model_flops_per_token,
    param_layer_id,
)
