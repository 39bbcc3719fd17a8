"""Plain-PyTorch workloads: the memory model's test zoo, also usable as built-ins.

Each covers a case that breaks naive memory trackers: BatchNorm and in-place ReLU (``cnn``),
oneDNN RNN workspaces (``lstm``), masks and data-dependent fast-path checks (``transformer``),
``nn.MultiheadAttention`` returning attention weights (``mha``), adaLN modulation with SDPA (``dit``).
Sizes are small so a real step takes well under a second on a laptop CPU; override any config
field (``cnn:width=64,depth=6``).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import UserError
from memfit.workload import Workload, WorkloadInfo
from memfit.workloads.checks import check_value


def _apply_overrides(cfg, overrides: dict, arch: str):
    hints = typing.get_type_hints(type(cfg))
    names = {f.name for f in dataclasses.fields(cfg)}
    values = {}
    for key, value in overrides.items():
        if key not in names:
            raise UserError(f"{arch}: unknown field {key!r}; valid fields: {', '.join(sorted(names))}")
        default = getattr(cfg, key)
        value = check_value(arch, key, value, (hints[key],), example=default)
        if hints[key] is int and value < 1:
            raise UserError(f"{arch}: {key} must be a whole number >= 1, got {value}; write e.g. {arch}:{key}={default}")
        if hints[key] is float and not 0 <= value < 1:  # the zoo's only float fields are dropout rates
            raise UserError(f"{arch}: {key} must be in [0, 1), got {value}; write e.g. {arch}:{key}={default}")
        values[key] = value
    cfg = dataclasses.replace(cfg, **values)
    for a, b in getattr(cfg, "DIVISIBLE", ()):
        if getattr(cfg, a) % getattr(cfg, b):
            raise UserError(f"{arch}: {a}={getattr(cfg, a)} must be divisible by {b}={getattr(cfg, b)}; "
                            f"change {a} or {b}")
    return cfg


def _ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


# -- CNN with BatchNorm and in-place ReLU ---------------------------------------------------
@dataclass(frozen=True)
class CNNConfig:
    width: int = 32
    depth: int = 4
    image_size: int = 32
    classes: int = 10


class ConvNet(nn.Module):
    def __init__(self, c: CNNConfig):
        super().__init__()
        layers, ch = [], 3
        for i in range(c.depth):
            out = c.width * (2 ** min(i, 3))
            layers += [nn.Conv2d(ch, out, 3, stride=2 if i % 2 else 1, padding=1, bias=False),
                       nn.BatchNorm2d(out), nn.ReLU(inplace=True)]
            ch = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(ch, c.classes)

    def forward(self, x):
        return self.head(F.adaptive_avg_pool2d(self.features(x), 1).flatten(1))


def _cnn_batch(c: CNNConfig, b: int):
    return torch.randn(b, 3, c.image_size, c.image_size), torch.randint(0, c.classes, (b,))


def _cnn_loss(m, batch):
    return F.cross_entropy(m(batch[0]), batch[1])


# -- LSTM language model ----------------------------------------------------------------------
@dataclass(frozen=True)
class LSTMConfig:
    vocab: int = 1000
    dim: int = 128
    hidden: int = 256
    layers: int = 2
    seq_len: int = 64


class LSTMLM(nn.Module):
    def __init__(self, c: LSTMConfig):
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.rnn = nn.LSTM(c.dim, c.hidden, c.layers, batch_first=True)
        self.out = nn.Linear(c.hidden, c.vocab)

    def forward(self, ids):
        h, _ = self.rnn(self.embed(ids))
        return self.out(h)


def _token_batch(c, b: int):
    return torch.randint(0, c.vocab, (b, c.seq_len + 1))


def _next_token_loss(m, ids):
    return _ce(m(ids[:, :-1]), ids[:, 1:])


# -- nn.Transformer with padding and causal masks ---------------------------------------------
@dataclass(frozen=True)
class TransformerConfig:
    vocab: int = 1000
    d_model: int = 128
    nhead: int = 4
    layers: int = 2
    ff: int = 256
    seq_len: int = 32
    dropout: float = 0.1
    DIVISIBLE: typing.ClassVar = (("d_model", "nhead"),)


class Seq2Seq(nn.Module):
    def __init__(self, c: TransformerConfig):
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.d_model)
        self.core = nn.Transformer(c.d_model, c.nhead, c.layers, c.layers, c.ff, c.dropout, batch_first=True)
        self.out = nn.Linear(c.d_model, c.vocab)

    def forward(self, src, tgt, src_pad):
        t = tgt.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(t, device=tgt.device)
        h = self.core(self.embed(src), self.embed(tgt), tgt_mask=causal, src_key_padding_mask=src_pad,
                      memory_key_padding_mask=src_pad)
        return self.out(h)


def _seq2seq_batch(c: TransformerConfig, b: int):
    src = torch.randint(0, c.vocab, (b, c.seq_len))
    pad = torch.zeros(b, c.seq_len, dtype=torch.bool)
    pad[:, -(c.seq_len // 4):] = True  # the last quarter of every source is padding
    return src, torch.randint(0, c.vocab, (b, c.seq_len + 1)), pad


def _seq2seq_loss(m, batch):
    src, tgt, pad = batch
    return _ce(m(src, tgt[:, :-1], pad), tgt[:, 1:])


# -- nn.MultiheadAttention blocks -------------------------------------------------------------
@dataclass(frozen=True)
class MHAConfig:
    vocab: int = 1000
    dim: int = 128
    heads: int = 4
    layers: int = 2
    seq_len: int = 64
    dropout: float = 0.0
    """Attention dropout (nn.MultiheadAttention's): with it the CPU's SDPA takes its math path."""
    DIVISIBLE: typing.ClassVar = (("dim", "heads"),)


class MHABlock(nn.Module):
    def __init__(self, dim, heads, dropout=0.0):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.ln1(x)
        a, _ = self.attn(h, h, h)  # weights returned and discarded, as most user code does
        x = x + a
        return x + self.mlp(self.ln2(x))


class MHAModel(nn.Module):
    def __init__(self, c: MHAConfig):
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleList(MHABlock(c.dim, c.heads, c.dropout) for _ in range(c.layers))
        self.out = nn.Linear(c.dim, c.vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


# -- Diffusion-style block with adaLN modulation ----------------------------------------------
@dataclass(frozen=True)
class DiTConfig:
    channels: int = 4
    image_size: int = 16
    patch: int = 2
    dim: int = 128
    heads: int = 4
    layers: int = 2
    DIVISIBLE: typing.ClassVar = (("dim", "heads"), ("image_size", "patch"))


class DiTBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x, c):
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(c).unsqueeze(1).chunk(6, dim=-1)
        h = self.norm1(x) * (1 + scale1) + shift1
        b, t, d = h.shape
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = x + gate1 * self.proj(a)
        return x + gate2 * self.mlp(self.norm2(x) * (1 + scale2) + shift2)


class DiT(nn.Module):
    def __init__(self, c: DiTConfig):
        super().__init__()
        self.c = c
        self.patch = nn.Conv2d(c.channels, c.dim, c.patch, stride=c.patch)
        self.t_embed = nn.Sequential(nn.Linear(1, c.dim), nn.SiLU(), nn.Linear(c.dim, c.dim))
        self.blocks = nn.ModuleList(DiTBlock(c.dim, c.heads) for _ in range(c.layers))
        self.out = nn.Linear(c.dim, c.patch * c.patch * c.channels)

    def forward(self, x, t):
        h = self.patch(x).flatten(2).transpose(1, 2)
        c = self.t_embed(t[:, None])
        for blk in self.blocks:
            h = blk(h, c)
        return self.out(h)


def _dit_batch(c: DiTConfig, b: int):
    x = torch.randn(b, c.channels, c.image_size, c.image_size)
    return x, torch.rand(b), torch.randn(b, (c.image_size // c.patch) ** 2, c.patch * c.patch * c.channels)


def _dit_loss(m, batch):
    x, t, target = batch
    return F.mse_loss(m(x, t), target)


def _builder(arch: str, config: type, model: type, batch, loss, *, batch_size: int = 8):
    """The builder of a zoo workload: its config with the user's overrides (and ``--seq-len``, for
    models with a ``seq_len`` field), the model class, batch(config, n) and loss(model, batch)."""
    def build(overrides: dict, seq_len: int | None) -> Workload:
        takes_seq = "seq_len" in {f.name for f in dataclasses.fields(config)}
        if seq_len is not None and not takes_seq:
            raise UserError(f"{arch}: --seq-len does not apply to this workload; override {arch}:image_size=N "
                            "instead")
        c = _apply_overrides(config(), overrides, arch)
        if seq_len:
            c = dataclasses.replace(c, seq_len=seq_len)
        return Workload(model=lambda: model(c), batch=lambda b: batch(c, b), loss=loss, name=arch,
                        default_batch_size=batch_size,
                        info=WorkloadInfo(arch=arch, seq_len=getattr(c, "seq_len", None), config=dataclasses.asdict(c)))
    return build


BUILDERS = {
    "cnn": (_builder("cnn", CNNConfig, ConvNet, _cnn_batch, _cnn_loss, batch_size=16),
            "CNN with BatchNorm and in-place ReLU (plain torch)"),
    "lstm": (_builder("lstm", LSTMConfig, LSTMLM, _token_batch, _next_token_loss),
             "LSTM language model (plain torch, oneDNN RNN on CPU)"),
    "transformer": (_builder("transformer", TransformerConfig, Seq2Seq, _seq2seq_batch, _seq2seq_loss),
                    "nn.Transformer encoder-decoder with padding and causal masks"),
    "mha": (_builder("mha", MHAConfig, MHAModel, _token_batch, _next_token_loss),
            "nn.MultiheadAttention blocks (attention weights returned)"),
    "dit": (_builder("dit", DiTConfig, DiT, _dit_batch, _dit_loss),
            "diffusion-style blocks with adaLN modulation and SDPA"),
}
