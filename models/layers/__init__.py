"""Transformer building blocks shared by the GPT, BERT, ViT and Llama models.

Everything here is deterministic (no dropout) so that a model's loss is a pure
function of its parameters and a batch, which is what `lax.scan` over
micro-batches in `optax_adama.microbatch_step` needs. The code is written to run
under `jax_numpy_rank_promotion="raise"` and `jax_numpy_dtype_promotion="strict"`:
broadcasts are explicit and mixed dtypes are cast by hand.

This front names every building block (`layers.Block`, `layers.apply_blocks`);
they live by topic in `config` (the stack's settings, remat policies, init),
`norms`, `attention` (with the rotary embedding), `blocks` (MLPs, blocks and
how a stack of them runs) and `losses`.
"""

from models.layers.attention import GroupedQueryAttention
from models.layers.attention import MultiHeadAttention
from models.layers.attention import RopeScaling
from models.layers.attention import apply_rotary
from models.layers.attention import rotary_inverse_frequencies
from models.layers.blocks import MLP
from models.layers.blocks import Block
from models.layers.blocks import GatedMLP
from models.layers.blocks import LlamaBlock
from models.layers.blocks import apply_blocks
from models.layers.blocks import apply_layer
from models.layers.blocks import make_blocks
from models.layers.config import CHECKPOINT_NAMES
from models.layers.config import COMPUTE_DTYPES
from models.layers.config import DEFAULT_INIT
from models.layers.config import REMAT_POLICIES
from models.layers.config import TransformerConfig
from models.layers.config import embedding
from models.layers.config import learned_positions
from models.layers.config import residual_init
from models.layers.losses import cross_entropy
from models.layers.norms import LayerNorm
from models.layers.norms import RMSNorm

__all__ = [
    "CHECKPOINT_NAMES",
    "COMPUTE_DTYPES",
    "DEFAULT_INIT",
    "MLP",
    "REMAT_POLICIES",
    "Block",
    "GatedMLP",
    "GroupedQueryAttention",
    "LayerNorm",
    "LlamaBlock",
    "MultiHeadAttention",
    "RMSNorm",
    "RopeScaling",
    "TransformerConfig",
    "apply_blocks",
    "apply_layer",
    "apply_rotary",
    "cross_entropy",
    "embedding",
    "learned_positions",
    "make_blocks",
    "residual_init",
    "rotary_inverse_frequencies",
]
