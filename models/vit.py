"""Vision Transformer image classifier (Dosovitskiy et al., 2021) in Flax NNX.

Non-overlapping patches are flattened and linearly embedded (the same map as a
Conv with kernel = stride = patch size), a learned CLS token is prepended,
learned positions are added, then pre-LN blocks with exact-GELU MLPs, a final
LayerNorm and a linear head on the CLS token. The presets reproduce ViT-B/16
(86M) and ViT-L/16 (304M) at 224x224 with 1000 classes.

Batch format for `ViT.loss`:
  {"images": float32[batch, height, width, channels] (or [batch, height, width]
             for one channel),
   "labels": int32[batch]}
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models import layers
from models import stages

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class ViTConfig(layers.TransformerConfig):
  """Hyper-parameters of a `ViT` model.

  The block stack's fields (`num_layers`, `hidden`, `num_heads`, `mlp_dim`,
  `remat`, dtypes) come from `models.layers.TransformerConfig`.

  Attributes:
    image_size: height = width of the input images.
    patch_size: side of the square patches; must divide image_size.
    num_channels: input channels (3 for RGB, 1 for the grayscale digits).
    num_classes: number of output classes.
  """

  image_size: int = 224
  patch_size: int = 16
  num_channels: int = 3
  num_classes: int = 1000
  layer_norm_eps: float = 1e-6

  @property
  def num_patches(self) -> int:
    """Number of patches per image (sequence length without the CLS token)."""
    return (self.image_size // self.patch_size) ** 2

  @classmethod
  def vit_base(cls, **overrides: Any) -> ViTConfig:
    """ViT-B/16: 12 layers, width 768, 12 heads (86M parameters)."""
    return cls(**{"num_layers": 12, "hidden": 768, "num_heads": 12, **overrides})

  @classmethod
  def vit_large(cls, **overrides: Any) -> ViTConfig:
    """ViT-L/16: 24 layers, width 1024, 16 heads (304M parameters)."""
    return cls(**{"num_layers": 24, "hidden": 1024, "num_heads": 16, **overrides})

  @classmethod
  def tiny(cls, **overrides: Any) -> ViTConfig:
    """For the 8x8 one-channel sklearn digits (10 classes): 16 patches of 2x2."""
    return cls(**{
        "image_size": 8, "patch_size": 2, "num_channels": 1, "num_classes": 10,
        "num_layers": 2, "hidden": 128, "num_heads": 4, **overrides,
    })

  @classmethod
  def mnist(cls, **overrides: Any) -> ViTConfig:
    """vit_tiny's blocks for the 28x28 MNIST-5k images: 16 patches of 7x7.

    The same 17 positions (16 patches and the CLS token), width and depth as
    `tiny`, so a step costs about what a digits step does; only the patch
    embedding is wider (49 pixels in).
    """
    return cls(**{
        "image_size": 28, "patch_size": 7, "num_channels": 1, "num_classes": 10,
        "num_layers": 2, "hidden": 128, "num_heads": 4, **overrides,
    })

  @classmethod
  def test(cls, **overrides: Any) -> ViTConfig:
    """One layer, width 128: the smoke-test configuration (8x8 digits)."""
    return cls(**{
        "image_size": 8, "patch_size": 2, "num_channels": 1, "num_classes": 10,
        "num_layers": 1, "hidden": 128, "num_heads": 4, **overrides,
    })


class ViT(stages.StagedModel):
  """Vision Transformer classifier; `__call__` maps images to class logits.

  `loss` (`models.stages.StagedModel`'s) is the mean classification
  cross-entropy, with the top-1 accuracy.
  """

  def __init__(self, config: ViTConfig, *, rngs: nnx.Rngs):
    """Initialises the parameters.

    Args:
      config: the model's hyper-parameters.
      rngs: random streams for initialisation (the `params` stream is used).
    """
    if config.image_size % config.patch_size:
      raise ValueError(
          f"patch_size={config.patch_size} does not divide image_size={config.image_size}"
      )
    self.config = config
    dense = dict(
        kernel_init=layers.DEFAULT_INIT, dtype=config.dtype,
        param_dtype=config.param_dtype, rngs=rngs,
    )
    patch_dim = config.patch_size * config.patch_size * config.num_channels
    self.patch_embed = nnx.Linear(patch_dim, config.hidden, **dense)
    self.cls_token = nnx.Param(jnp.zeros((config.hidden,), config.param_dtype))
    self.position_embed = layers.learned_positions(config.num_patches + 1, config, rngs=rngs)
    self.blocks = layers.make_blocks(
        lambda: layers.Block(
            config.hidden, config.num_heads, config.mlp_width, pre_norm=True,
            layer_norm_eps=config.layer_norm_eps,
            gelu_approximate=False, gelu_bits=config.gelu_bits,
            linear_keep_ratio=config.linear_keep_ratio,
            dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs,
        ),
        config.num_layers, scan_layers=config.scan_layers,
    )
    self.final_norm = layers.LayerNorm(
        config.hidden, epsilon=config.layer_norm_eps, dtype=config.dtype,
        param_dtype=config.param_dtype, rngs=rngs,
    )
    # N(0, 0.02) rather than the zero init of ViT fine-tuning: we train from
    # scratch, and a zero head would zero every other gradient at step one.
    self.head = nnx.Linear(config.hidden, config.num_classes, **dense)

  def patchify(self, images: Array) -> Array:
    """[batch, H, W, C] (or [batch, H, W]) -> [batch, num_patches, p * p * C].

    Patches are in row-major order and each is flattened as (row, col,
    channel), which makes the patch Linear equal to a stride-p Conv.
    """
    config = self.config
    if images.ndim == 3:
      images = images[..., None]
    batch, height, width, channels = images.shape
    if (height, width, channels) != (config.image_size, config.image_size, config.num_channels):
      raise ValueError(
          f"expected images of shape [batch, {config.image_size}, {config.image_size}, "
          f"{config.num_channels}], got {images.shape}"
      )
    p = config.patch_size
    x = images.reshape(batch, height // p, p, width // p, p, channels)
    x = x.transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(batch, (height // p) * (width // p), p * p * channels)

  def __call__(self, images: Array) -> Array:
    """Class logits [batch, num_classes] in the compute dtype.

    Args:
      images: float[batch, H, W, C], or float[batch, H, W] for one channel.
    """
    x = self.run_blocks(self.embed(images), None)
    return self.logits(x)

  def embed(self, images: Array) -> Array:
    """CLS token and patch embeddings plus positions: the blocks' input."""
    x = self.patch_embed(self.patchify(images).astype(self.config.dtype))
    batch, _, hidden = x.shape
    cls = jnp.broadcast_to(
        self.cls_token[...].astype(x.dtype)[None, None, :], (batch, 1, hidden)
    )
    x = jnp.concatenate([cls, x], axis=1)
    return x + self.position_embed[...].astype(x.dtype)[None, :, :]

  def logits(self, x: Array) -> Array:
    """Class logits from the last block's output (its CLS token)."""
    return self.head(self.final_norm(x[:, 0]))

  # The loss in three stages (`models.stages.StagedModel`), from a batch.

  def stage_embed(self, batch: dict[str, Array]) -> Array:
    return self.embed(batch["images"])

  def stage_mask(self, x: Array, batch: dict[str, Array]) -> None:
    del x, batch

  def stage_head(self, x: Array, batch: dict[str, Array]) -> tuple[Array, dict[str, Array]]:
    loss, accuracy = layers.cross_entropy(self.logits(x), batch["labels"])
    return loss, {"accuracy": accuracy}
