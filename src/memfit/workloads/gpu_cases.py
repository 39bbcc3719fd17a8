"""User-style workloads for GPU ground truth: models nobody has predicted yet.

Each public function returns a ``memfit.Workload`` built the way a user would write one (see the
README's "From Python"): plain torch modules, Hugging Face models from config classes (no weights,
no download) and timm models (``pretrained=False``). Name them on the command line as
``memfit.workloads.gpu_cases:NAME``; ``tools/gpu/ground_truth.py`` measures them on a real GPU, and
the rows of tests/data/ it recorded name them so.

Sizes default to real widths (a few layers of the big language models) so that the GPU kernels
that matter run at the shapes they run at in practice; every size is a keyword argument, so a
CPU smoke test can build a tiny version (``resnet50(image_size=32)``).

timm is imported inside the builders: this file imports without it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memfit.workload import Workload, WorkloadInfo

# -- image classifiers from timm ------------------------------------------------------------------


def _timm(name: str, image_size: int, classes: int, default_batch: int, **kwargs) -> Workload:
    def model():
        try:
            import timm
        except ImportError:
            raise ImportError(f"workload {name} needs timm: pip install timm") from None
        return timm.create_model(name, pretrained=False, num_classes=classes, **kwargs)

    return Workload(model=model,
                    batch=lambda n: (torch.randn(n, 3, image_size, image_size), torch.randint(0, classes, (n,))),
                    loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                    name=f"timm-{name}", default_batch_size=default_batch,
                    info=WorkloadInfo(config={"arch": name, "image_size": image_size, "classes": classes}))


def resnet50(image_size: int = 224, classes: int = 1000) -> Workload:
    """timm ResNet-50 (25.6M parameters): cuDNN convolutions, BatchNorm, in-place ReLU."""
    return _timm("resnet50", image_size, classes, 64)


def vit_small(image_size: int = 224, classes: int = 1000) -> Workload:
    """timm ViT-S/16 (22M): fused attention (SDPA) over 197 tokens, head_dim 64."""
    kwargs = {} if image_size == 224 else {"img_size": image_size}
    return _timm("vit_small_patch16_224", image_size, classes, 128, **kwargs)


def convnext_tiny(image_size: int = 224, classes: int = 1000) -> Workload:
    """timm ConvNeXt-T (28.6M): depthwise 7x7 convolutions, LayerNorm in channels-last."""
    return _timm("convnext_tiny", image_size, classes, 64)


# -- recurrent language models (cuDNN RNN) --------------------------------------------------------


class RNNLM(nn.Module):
    def __init__(self, cell: str, vocab: int, dim: int, hidden: int, layers: int, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rnn = getattr(nn, cell)(dim, hidden, layers, batch_first=True, dropout=dropout)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, ids):
        h, _ = self.rnn(self.embed(ids))
        return self.out(h)


def _rnn(cell: str, vocab: int, dim: int, hidden: int, layers: int, seq_len: int, dropout: float) -> Workload:
    return Workload(model=lambda: RNNLM(cell, vocab, dim, hidden, layers, dropout),
                    batch=lambda n: torch.randint(0, vocab, (n, seq_len + 1)),
                    loss=lambda m, ids: F.cross_entropy(m(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten()),
                    name=f"{cell.lower()}-lm", default_batch_size=32,
                    info=WorkloadInfo(config={"cell": cell, "vocab": vocab, "dim": dim, "hidden": hidden,
                                              "layers": layers, "seq_len": seq_len}))


def lstm_lm(vocab: int = 32000, dim: int = 512, hidden: int = 1024, layers: int = 3, seq_len: int = 256,
            dropout: float = 0.1) -> Workload:
    """3-layer LSTM LM (cuDNN RNN: its reserve space is what backward reads, plus a workspace)."""
    return _rnn("LSTM", vocab, dim, hidden, layers, seq_len, dropout)


def gru_lm(vocab: int = 32000, dim: int = 512, hidden: int = 1024, layers: int = 3, seq_len: int = 256,
           dropout: float = 0.1) -> Workload:
    """3-layer GRU LM (cuDNN RNN)."""
    return _rnn("GRU", vocab, dim, hidden, layers, seq_len, dropout)


# -- residual MLP (repeated blocks, large matmuls) -----------------------------------------------


class MLPBlock(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ResMLP(nn.Module):
    def __init__(self, inputs: int, width: int, hidden: int, depth: int, classes: int):
        super().__init__()
        self.stem = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList(MLPBlock(width, hidden) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def mlp(inputs: int = 1024, width: int = 2048, hidden: int = 8192, depth: int = 8, classes: int = 1000) -> Workload:
    """Residual MLP, 8 blocks of 2048 -> 8192 -> 2048 (270M parameters), rows of 1024 features."""
    return Workload(model=lambda: ResMLP(inputs, width, hidden, depth, classes),
                    batch=lambda n: (torch.randn(n, inputs), torch.randint(0, classes, (n,))),
                    loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                    name="resmlp", default_batch_size=4096,
                    info=WorkloadInfo(config={"width": width, "hidden": hidden, "depth": depth}))


# -- small UNet (diffusion-style denoiser) --------------------------------------------------------


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(8, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(8, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x) + h


class UNet(nn.Module):
    def __init__(self, channels: int, base: int, levels: int, blocks: int):
        super().__init__()
        self.stem = nn.Conv2d(channels, base, 3, padding=1)
        widths = [base * 2 ** i for i in range(levels)]
        self.down = nn.ModuleList()
        self.pool = nn.ModuleList()
        c = base
        for i, w in enumerate(widths):
            self.down.append(nn.Sequential(*[ResBlock(c if j == 0 else w, w) for j in range(blocks)]))
            c = w
            self.pool.append(nn.Conv2d(w, w, 3, stride=2, padding=1) if i < levels - 1 else nn.Identity())
        self.up = nn.ModuleList()
        for w in reversed(widths[:-1]):
            self.up.append(nn.Sequential(*[ResBlock(c + w if j == 0 else w, w) for j in range(blocks)]))
            c = w
        self.out = nn.Conv2d(c, channels, 3, padding=1)

    def forward(self, x):
        h = self.stem(x)
        skips = []
        for block, pool in zip(self.down, self.pool):
            h = block(h)
            skips.append(h)
            h = pool(h)
        skips.pop()
        for block in self.up:
            h = F.interpolate(h, scale_factor=2.0, mode="nearest")
            h = block(torch.cat([h, skips.pop()], dim=1))
        return self.out(h)


def unet(image_size: int = 128, channels: int = 3, base: int = 64, levels: int = 4, blocks: int = 2) -> Workload:
    """UNet denoiser (GroupNorm + SiLU + 3x3 convs, skip concatenations), MSE to a noise target."""
    return Workload(model=lambda: UNet(channels, base, levels, blocks),
                    batch=lambda n: (torch.randn(n, channels, image_size, image_size),
                                     torch.randn(n, channels, image_size, image_size)),
                    loss=lambda m, b: F.mse_loss(m(b[0]).float(), b[1]),
                    name="unet", default_batch_size=16,
                    info=WorkloadInfo(config={"image_size": image_size, "base": base, "levels": levels, "blocks": blocks}))


# -- Hugging Face language models from configs (a few layers at real width) ----------------------


def _hf_lm(config_cls: str, model_cls: str, name: str, seq_len: int, default_batch: int, **fields) -> Workload:
    import transformers
    transformers.logging.set_verbosity_error()
    config = getattr(transformers, config_cls)(**fields)
    config.use_cache = False
    vocab = config.vocab_size

    def batch(n):
        ids = torch.randint(0, vocab, (n, seq_len))
        return {"input_ids": ids, "labels": ids.clone()}

    return Workload(model=lambda: getattr(transformers, model_cls)(config), batch=batch,
                    loss=lambda m, b: m(**b).loss, name=name, default_batch_size=default_batch,
                    info=WorkloadInfo(config={"config": config_cls, "seq_len": seq_len, **fields}))


def qwen2_4l(layers: int = 4, seq_len: int = 2048, hidden: int = 1536, intermediate: int = 8960, heads: int = 12,
             kv_heads: int = 2, vocab: int = 151936) -> Workload:
    """Qwen2-1.5B width (GQA 12/2 heads, tied 152k embedding), 4 layers, seq 2048."""
    return _hf_lm("Qwen2Config", "Qwen2ForCausalLM", "qwen2-4l", seq_len, 4, num_hidden_layers=layers,
                  hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, vocab_size=vocab, tie_word_embeddings=True,
                  max_position_embeddings=max(seq_len, 32))


def mistral_4l(layers: int = 4, seq_len: int = 2048, hidden: int = 4096, intermediate: int = 14336, heads: int = 32,
               kv_heads: int = 8, vocab: int = 32000) -> Workload:
    """Mistral-7B width (GQA 32/8 heads, sliding window 4096), 4 layers, seq 2048."""
    return _hf_lm("MistralConfig", "MistralForCausalLM", "mistral-4l", seq_len, 2, num_hidden_layers=layers,
                  hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=max(seq_len, 32))


def bert_large_8l(layers: int = 8, seq_len: int = 1024, hidden: int = 1024, intermediate: int = 4096, heads: int = 16,
                  vocab: int = 30522) -> Workload:
    """BERT-large width (1024, 16 heads), 8 layers, masked LM at seq 1024 (dropout 0.1 in attention)."""
    return _hf_lm("BertConfig", "BertForMaskedLM", "bert-large-8l", seq_len, 8, num_hidden_layers=layers,
                  hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads, vocab_size=vocab,
                  max_position_embeddings=max(seq_len, 32))


# -- a second set, added after the CUDA rules were fitted (a blind check of them) ---------------


def efficientnet_b0(image_size: int = 224, classes: int = 1000) -> Workload:
    """timm EfficientNet-B0 (5.3M): depthwise convolutions, squeeze-excitation, SiLU."""
    return _timm("efficientnet_b0", image_size, classes, 128)


def swin_tiny(image_size: int = 224, classes: int = 1000) -> Workload:
    """timm Swin-T (28M): windowed attention with a relative position bias (an SDPA mask)."""
    return _timm("swin_tiny_patch4_window7_224", image_size, classes, 64)


def phi3_4l(layers: int = 4, seq_len: int = 2048, hidden: int = 3072, intermediate: int = 8192, heads: int = 32,
            vocab: int = 32064) -> Workload:
    """Phi-3-mini width (fused qkv and gate-up projections), 4 layers, seq 2048."""
    return _hf_lm("Phi3Config", "Phi3ForCausalLM", "phi3-4l", seq_len, 4, num_hidden_layers=layers,
                  hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                  num_key_value_heads=heads, vocab_size=vocab, max_position_embeddings=max(seq_len, 32),
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)


def gemma_4l(layers: int = 4, seq_len: int = 1024, hidden: int = 2048, intermediate: int = 16384, heads: int = 8,
             kv_heads: int = 1, head_dim: int = 256, vocab: int = 256000) -> Workload:
    """Gemma-2B width (multi-query attention, head_dim 256, 256k vocabulary), 4 layers, seq 1024."""
    return _hf_lm("GemmaConfig", "GemmaForCausalLM", "gemma-4l", seq_len, 2, num_hidden_layers=layers,
                  hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
                  max_position_embeddings=max(seq_len, 32))


def neox_4l(layers: int = 4, seq_len: int = 2048, hidden: int = 2048, intermediate: int = 8192, heads: int = 16,
            vocab: int = 50304) -> Workload:
    """GPT-NeoX (Pythia-1.4B width: parallel attention and MLP, partial rotary), 4 layers, seq 2048."""
    return _hf_lm("GPTNeoXConfig", "GPTNeoXForCausalLM", "neox-4l", seq_len, 4, num_hidden_layers=layers,
                  hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads, vocab_size=vocab,
                  max_position_embeddings=max(seq_len, 32))


WORKLOADS = {f.__name__: f for f in (resnet50, vit_small, convnext_tiny, lstm_lm, gru_lm, mlp, unet, qwen2_4l,
                                     mistral_4l, bert_large_8l, efficientnet_b0, swin_tiny, phi3_4l, gemma_4l,
                                     neox_4l)}
