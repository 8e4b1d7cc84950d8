"""A compact CLIP model (a ViT image tower in open_clip's layout, whose ``blocks.*`` linears
``swap_linear_layers`` reaches; a text MLP) and synthetic image–text pairs."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class VisionConfig:
    image_size: int = 224
    patch_size: int = 16
    width: int = 768
    layers: int = 12
    heads: int = 12
    mlp_width: int = 3072
    embed_dim: int = 512  # the joint image–text space

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens(self) -> int:  # patches and the class token
        return self.grid**2 + 1


@dataclass(frozen=True)
class TextConfig:
    text_dim: int = 256  # width of the fixed text embeddings
    hidden: int = 1024
    latent_dim: int = 64  # what an image and its text share (SyntheticPairs)


VIT_B_16 = VisionConfig()  # CLIP ViT-B/16's shapes
TEXT_SMALL = TextConfig()
# --quick: a training step on a CPU in milliseconds
VIT_TINY = VisionConfig(image_size=32, patch_size=8, width=32, layers=2, heads=2, mlp_width=128,
                        embed_dim=16)
TEXT_TINY = TextConfig(text_dim=24, hidden=32, latent_dim=8)


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, width)
        batch, tokens, width = x.shape
        q, k, v = self.qkv(x).view(batch, tokens, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)  # (B, heads, T, width / heads)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, width))


class Mlp(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, mlp_width: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = Mlp(width, mlp_width)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class VisionTransformer(nn.Module):
    """Images (B, 3, H, W) → image embeddings (B, embed_dim), not normalized."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        width, scale = config.width, config.width**-0.5
        self.patch_embed = nn.Conv2d(3, width, config.patch_size, config.patch_size, bias=False)
        self.class_embedding = nn.Parameter(scale * torch.randn(width))
        self.positional_embedding = nn.Parameter(scale * torch.randn(config.tokens, width))
        self.ln_pre = nn.LayerNorm(width)
        self.blocks = nn.ModuleList(Block(width, config.heads, config.mlp_width)
                                    for _ in range(config.layers))
        self.ln_post = nn.LayerNorm(width)
        self.proj = nn.Linear(width, config.embed_dim, bias=False)

    def forward(self, images: Tensor) -> Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, grid², width)
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + self.positional_embedding.to(x.dtype)
        x = self.ln_pre(x)
        for block in self.blocks:
            x = block(x)
        return self.proj(self.ln_post(x[:, 0]))


class ClipModel(nn.Module):
    """``forward`` → L2-normalized image and text features (B, embed) and ``logit_scale.exp()``
    clamped at 100, as open_clip passes them to its ``ClipLoss``."""

    def __init__(self, vision: VisionConfig, text: TextConfig) -> None:
        super().__init__()
        self.visual = VisionTransformer(vision)
        self.text = nn.Sequential(nn.Linear(text.text_dim, text.hidden), nn.GELU(),
                                  nn.Linear(text.hidden, vision.embed_dim))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, images: Tensor, texts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        image_features = F.normalize(self.visual(images), dim=-1)
        text_features = F.normalize(self.text(texts), dim=-1)
        return image_features, text_features, self.logit_scale.exp().clamp(max=100.0)


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class SyntheticPairs:
    """Pairs sharing a latent z_i ~ N(0, I): image = a fixed random linear map of z_i to a
    (3, grid, grid) picture, upsampled bilinearly, plus N(0, 0.5²) noise; text = tanh(z_i A) B
    (unit variance) plus N(0, 0.25²) noise. Maps from a CPU generator, batches from a device
    one, both seeded with ``seed``: the same batches in the same order every run."""

    IMAGE_NOISE = 0.5
    TEXT_NOISE = 0.25

    def __init__(self, vision: VisionConfig, text: TextConfig, seed: int,
                 device: torch.device) -> None:
        generator = torch.Generator().manual_seed(seed)
        latent, grid = text.latent_dim, vision.grid
        self.vision, self.text, self.device = vision, text, device
        self.image_map = (torch.randn(latent, 3 * grid * grid, generator=generator)
                          / latent**0.5).to(device)
        self.text_hidden = (torch.randn(latent, 4 * latent, generator=generator)
                            * (2 / latent**0.5)).to(device)
        text_out = torch.randn(4 * latent, text.text_dim, generator=generator) / (4 * latent)**0.5
        probe = torch.tanh(torch.randn(4096, latent, generator=generator)
                           @ self.text_hidden.cpu()) @ text_out
        self.text_out = (text_out / probe.std(dim=0)).to(device)
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def batch(self, batch_size: int) -> tuple[Tensor, Tensor]:
        """(images (B, 3, S, S), texts (B, text_dim)), float32 on the device."""
        grid, size = self.vision.grid, self.vision.image_size

        def randn(*shape: int) -> Tensor:
            return torch.randn(shape, generator=self.generator, device=self.device)

        z = randn(batch_size, self.text.latent_dim)
        small = (z @ self.image_map).view(batch_size, 3, grid, grid)
        images = F.interpolate(small, size=(size, size), mode="bilinear", align_corners=False)
        images = images + self.IMAGE_NOISE * randn(*images.shape)
        texts = torch.tanh(z @ self.text_hidden) @ self.text_out
        return images, texts + self.TEXT_NOISE * randn(*texts.shape)
