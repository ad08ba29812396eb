"""Frozen, validated configuration for the dual-codebook tokenizer, plus named presets.

One root config (`TokenizerConfig`) holds one sub-config per part. Every knob carries a comment; every config checks
itself in `__post_init__` so a bad value fails at construction, not deep inside a forward pass. Presets:
`tiny` (CPU tests), `tokenflow-b` (CLIP ViT-B/16 @224, 14x14 grid), `tokenflow-xl` (SigLIP-SO400M/14 @384, 27x27 grid).
Nothing here imports torch, so the CLI can build and check configs cheaply.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from tokenflow_ray.checks import require

SEMANTIC_KINDS = ("clip", "siglip", "cnn")
INDEX_MODES = ("shared", "separate")
RESIDUAL_MODES = ("official", "var")


@dataclass(frozen=True)
class QuantizerConfig:
    codebook_size: int = 32768  # K, the same for both tables (the shared index selects row i of each)
    sem_dim: int = 32  # semantic code width
    pix_dim: int = 8  # pixel code width
    w_sem: float = 1.0  # weight of d_sem in the index rule; 0 turns the rule into pixel-only VQ (arm P)
    w_dis: float = 1.0  # weight of d_pix (the paper's w_dis, 1.0 in every variant); 0 gives semantic-only (arm S)
    index_mode: str = "shared"  # "shared": one index per token; "separate": independent sem/pix indices (TF-sep)
    beta: float = 0.25  # commitment weight in VQ + beta * commitment
    # Multi-scale residual VQ (multiscale.py). "official": as ByteFlow-AI/TokenFlow's vq_model.py: the residual stays
    # unnormalised, each scale's downsampled residual is normalised per branch before its search, the VQ loss is
    # taken per scale against that normalised residual, codewords are added with weight 1. "var": our earlier
    # VAR-style variant: normalise once, loss on the running sum, a learned per-scale gain. One scale: identical.
    residual: str = "official"
    # Block sizes of the chunked search: at most query_chunk x search_chunk scores exist at once (256 x 4096 floats =
    # 4 MiB, cache-friendly: on 2 CPU cores this beats one N x K cdist by >2x, see docs/results/tokenizer.md).
    search_chunk: int = 4096  # codebook rows per block
    query_chunk: int = 256  # query rows per block
    usage_window: int = 131072  # rolling window of recent indices for the usage statistic and dead-code detection

    def __post_init__(self) -> None:
        require(self.codebook_size >= 2, f"codebook_size must be >= 2, got {self.codebook_size}")
        require(self.sem_dim >= 1 and self.pix_dim >= 1, "sem_dim and pix_dim must be >= 1")
        for name in ("w_sem", "w_dis"):
            value = getattr(self, name)
            require(math.isfinite(value) and value >= 0, f"{name} must be finite and >= 0, got {value}")
        require(self.w_sem + self.w_dis > 0, "w_sem and w_dis cannot both be 0: the index rule would be empty")
        require(self.index_mode in INDEX_MODES, f"index_mode must be one of {INDEX_MODES}, got {self.index_mode!r}")
        require(self.beta >= 0, f"beta must be >= 0, got {self.beta}")
        require(self.residual in RESIDUAL_MODES, f"residual must be one of {RESIDUAL_MODES}, got {self.residual!r}")
        require(self.search_chunk >= 1 and self.query_chunk >= 1, "search_chunk and query_chunk must be >= 1")
        require(self.usage_window >= 1, f"usage_window must be >= 1, got {self.usage_window}")


@dataclass(frozen=True)
class SemanticConfig:
    kind: str = "clip"  # "clip" | "siglip" (transformers vision towers) | "cnn" (small teacher CNN, §6 experiment)
    pretrained_path: str | None = None  # local directory of a transformers checkpoint; None builds from the fields below
    image_size: int = 224  # input side the tower sees
    patch_size: int = 16  # ViT patch (or total CNN stride): grid side = image_size // patch_size
    hidden_size: int = 768  # tower width (ignored when loading a checkpoint)
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    feature_dim: int = 512  # width of the teacher target the semantic decoder regresses (CLIP proj 512, SigLIP 1152)
    use_penultimate: bool = False  # SigLIP-XL target: penultimate hidden state instead of the last
    code_dim: int = 32  # Linear-Tanh-Linear projection output = quantizer sem_dim

    def __post_init__(self) -> None:
        require(self.kind in SEMANTIC_KINDS, f"semantic kind must be one of {SEMANTIC_KINDS}, got {self.kind!r}")
        # Not required to divide: SigLIP/14 @384 keeps floor(384 / 14) = 27 patches per side, as its conv does.
        require(self.image_size >= self.patch_size, "semantic image_size must be >= patch_size")
        if self.kind == "cnn":
            require(self.patch_size & (self.patch_size - 1) == 0, "cnn patch_size (stride) must be a power of two")
        else:
            require(self.hidden_size % self.num_heads == 0, "hidden_size must be divisible by num_heads")
        require(min(self.hidden_size, self.num_layers, self.feature_dim, self.code_dim) >= 1,
                "semantic sizes must be >= 1")

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size


@dataclass(frozen=True)
class PixelConfig:
    ch: int = 128  # base channels of the VQGAN CNN
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)  # one level per entry; len-1 downsamplings (16x by default)
    num_res_blocks: int = 2  # encoder ResBlocks per level
    dec_num_res_blocks: int = 3  # decoder ResBlocks per level (the paper's decoder uses 3)
    z_channels: int = 256  # width before the 1x1 conv to the code
    code_dim: int = 8  # pixel code width = quantizer pix_dim
    attn_at_lowest: bool = True  # self-attention block at the lowest resolution

    def __post_init__(self) -> None:
        require(len(self.ch_mult) >= 1 and all(m >= 1 for m in self.ch_mult), "ch_mult must be non-empty, all >= 1")
        require(self.ch >= 1 and self.z_channels >= 1 and self.code_dim >= 1, "pixel widths must be >= 1")
        require(self.num_res_blocks >= 0 and self.dec_num_res_blocks >= 0, "res block counts must be >= 0")

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)


@dataclass(frozen=True)
class SemDecoderConfig:
    width: int = 768  # transformer width of the semantic decoder
    depth: int = 3  # BEiT-v2 style shallow decoder
    num_heads: int = 12

    def __post_init__(self) -> None:
        require(self.width % self.num_heads == 0, "semantic decoder width must be divisible by num_heads")
        require(self.depth >= 0, "semantic decoder depth must be >= 0")


@dataclass(frozen=True)
class LossConfig:
    sem_weight: float = 1.0  # cosine loss to the frozen teacher's features
    vq_weight: float = 1.0  # VQ + beta * commitment, averaged over scales
    mse_weight: float = 1.0
    l1_weight: float = 0.0
    lpips_weight: float = 1.0  # > 0 needs lpips_path (training checks it on the driver before Ray starts)
    lpips_path: str | None = None  # local state dict of the LPIPS VGG reference network (perceptual.py; never downloaded)
    gan_weight: float = 0.5  # lambda_G, hinge PatchGAN
    gan_start_step: int = 20000  # generator GAN term and discriminator updates start here
    disc_ndf: int = 64
    disc_layers: int = 3

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_weight"):
                require(math.isfinite(value) and value >= 0, f"{f.name} must be finite and >= 0, got {value}")
        require(self.gan_start_step >= 0, "gan_start_step must be >= 0")
        require(self.disc_ndf >= 1 and self.disc_layers >= 1, "discriminator sizes must be >= 1")


@dataclass(frozen=True)
class TokenizerConfig:
    image_size: int = 224  # the side callers pass in; branches resize to their own input sides when these differ
    semantic: SemanticConfig = field(default_factory=SemanticConfig)
    pixel: PixelConfig = field(default_factory=PixelConfig)
    quantizer: QuantizerConfig = field(default_factory=QuantizerConfig)
    sem_decoder: SemDecoderConfig = field(default_factory=SemDecoderConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    scales: tuple[int, ...] = (1, 2, 4, 6, 8, 10, 12, 14)  # VAR-style sides; the last equals the token grid
    scale_drop_prob: float = 0.1  # in training, with this probability one non-first scale is skipped for the step

    def __post_init__(self) -> None:
        require(self.image_size >= self.grid, "image_size must be >= the token grid")
        require(len(self.scales) >= 1 and list(self.scales) == sorted(set(self.scales)) and self.scales[0] >= 1,
                f"scales must be strictly increasing positive ints, got {self.scales}")
        require(self.scales[-1] == self.grid, f"last scale {self.scales[-1]} must equal the token grid {self.grid}")
        require(0.0 <= self.scale_drop_prob <= 1.0, "scale_drop_prob must be in [0, 1]")
        require(self.semantic.code_dim == self.quantizer.sem_dim, "semantic.code_dim must equal quantizer.sem_dim")
        require(self.pixel.code_dim == self.quantizer.pix_dim, "pixel.code_dim must equal quantizer.pix_dim")

    @property
    def grid(self) -> int:
        """Token grid side at image_size; each branch resizes its input to grid x its own stride (XL pixel: 432)."""
        return self.semantic.grid

    @property
    def side_multiple(self) -> int:
        """Input sides must be multiples of this so that the token grid is whole (B: 16, XL: 128)."""
        return self.image_size // math.gcd(self.image_size, self.grid)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_overrides(cls, data: dict | None, default_preset: str = "tiny", where: str = "model") -> TokenizerConfig:
        """`{preset: NAME, <any field or sub-config field>: value, ...}`: the preset's tree with the given leaves
        replaced (sub-configs merged key by key), validated once. A key that names no field is a one-line error
        naming its dotted path (`where` is the prefix, e.g. "model")."""
        data = dict(data or {})
        name = data.pop("preset", default_preset)
        if name not in PRESETS:
            raise ValueError(f"{where}.preset: unknown preset {name!r}; choose from {sorted(PRESETS)}")
        merged = merge_tree(PRESETS[name]().to_dict(), data, where)
        return cls.from_dict(merged)

    @classmethod
    def from_dict(cls, data: dict) -> TokenizerConfig:
        subs = {"semantic": SemanticConfig, "pixel": PixelConfig, "quantizer": QuantizerConfig,
                "sem_decoder": SemDecoderConfig, "loss": LossConfig}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        require(not unknown, f"unknown tokenizer config keys: {sorted(unknown)}")
        kwargs = {}
        for key, value in data.items():
            if key in subs:
                kwargs[key] = _build(subs[key], value)
            elif key == "scales":
                kwargs[key] = tuple(value)
            else:
                kwargs[key] = value
        return cls(**kwargs)


def merge_tree(base: dict, override: dict, where: str) -> dict:
    """`base` with `override`'s leaves replaced, recursively; an override key absent from `base` is an error."""
    if not isinstance(override, dict):
        raise ValueError(f"{where} must be a mapping, got {override!r}")
    out = dict(base)
    for key, value in override.items():
        if key not in base:
            raise ValueError(f"unknown key {where}.{key}; expected one of {sorted(base)}")
        out[key] = merge_tree(base[key], value, f"{where}.{key}") if isinstance(base[key], dict) else value
    return out


def leaf_paths(tree: dict, prefix: str = "") -> list[str]:
    """Dotted paths of every leaf of a to_dict() tree: the knobs a YAML or `--set` can reach."""
    out = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        out += leaf_paths(value, path + ".") if isinstance(value, dict) else [path]
    return out


def _build(cls: type, data: dict):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - known
    require(not unknown, f"unknown {cls.__name__} keys: {sorted(unknown)}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def _tiny() -> TokenizerConfig:
    # 16 px images, 4x4 grid: small enough that a forward + backward takes milliseconds on one CPU core.
    return TokenizerConfig(
        image_size=16,
        semantic=SemanticConfig(kind="clip", image_size=16, patch_size=4, hidden_size=32, num_layers=2, num_heads=2,
                                intermediate_size=64, feature_dim=24, code_dim=32),
        pixel=PixelConfig(ch=16, ch_mult=(1, 2, 2), num_res_blocks=1, dec_num_res_blocks=1, z_channels=32,
                          code_dim=8),
        quantizer=QuantizerConfig(codebook_size=64, search_chunk=16, query_chunk=32, usage_window=256),
        sem_decoder=SemDecoderConfig(width=32, depth=1, num_heads=2),
        # LPIPS off: a VGG16 pass would cost 50x the tiny model's step; YAML turns it on with lpips_path.
        loss=LossConfig(lpips_weight=0.0, disc_ndf=8, disc_layers=2, gan_start_step=0),
        scales=(1, 2, 4),
    )


def _tokenflow_b() -> TokenizerConfig:
    return TokenizerConfig()  # the defaults are TokenFlow-B: CLIP ViT-B/16 @224, 14x14, K 32768


def _tokenflow_xl() -> TokenizerConfig:
    # SigLIP-SO400M/14 @384 gives 27x27; the pixel branch sees the image resized to 27 * 16 = 432 (as the paper does).
    return TokenizerConfig(
        image_size=384,
        semantic=SemanticConfig(kind="siglip", image_size=384, patch_size=14, hidden_size=1152, num_layers=27,
                                num_heads=16, intermediate_size=4304, feature_dim=1152, use_penultimate=True),
        sem_decoder=SemDecoderConfig(width=1152, depth=3, num_heads=16),
        scales=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 17, 22, 27),
    )


PRESETS = {"tiny": _tiny, "tokenflow-b": _tokenflow_b, "tokenflow-xl": _tokenflow_xl}


def preset(name: str, **overrides) -> TokenizerConfig:
    """A named preset, optionally with top-level fields replaced (sub-configs replaced whole)."""
    if name not in PRESETS:
        raise ValueError(f"unknown tokenizer preset {name!r}; choose from {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name](), **overrides)
