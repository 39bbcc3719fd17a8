"""HiDream-I1's four text encoders in the step, as ai-toolkit's ``hidream`` trainer holds them.

Memory/compute trade-off. diffusers' HiDream LoRA script encodes its prompt once and trains on the cached states
(``dit-hidream``'s default, ``text_encoders=cached``): no encoder weight is on the device. ai-toolkit's HiDream
trainer keeps all four on the device and encodes each step's captions under ``no_grad``, unless a dataset caches
them (``cache_text_embeddings``). That is 13.6B frozen parameters beside the DiT's 17.1B:

- CLIP-L and CLIP-G with their projections (123M and 695M), whose projected pooled outputs, side by side, are the
  DiT's ``pooled_embeds`` (768 + 1280 = 2048);
- T5-XXL's encoder (4.76B), whose last hidden states are ``encoder_hidden_states_t5``;
- Llama-3.1-8B as ``LlamaForCausalLM`` (8.03B: its 525M-parameter output layer included), whose 32 layers' hidden
  states, stacked layer first, are ``encoder_hidden_states_llama3`` (``HiDreamImagePipeline._get_llama3_prompt_embeds``:
  ``output_hidden_states=True``; the logits over its 128,256-token vocabulary are a transient of the encoding). The
  pipeline asks for ``output_attentions=True`` too, which transformers' SDPA attention, the default, does not return:
  it says so and returns none, so memfit does not ask.

In bf16 they weigh 27.2 GB, with one-byte linear weights (ai-toolkit's ``quantize_te``, qfloat8) 14.4 GB: what makes its
HiDream LoRA a 48 GB recipe, where the cached states take 32 MiB a sample. The encodings' activations are small
(128 tokens a caption: ``max_sequence_length``, for all four, CLIP's padded to it too).
"""

from __future__ import annotations

import torch

from memfit.workloads import text_encoders as te

LLAMA_VOCAB, LLAMA_LAYERS, LLAMA_HEADS, LLAMA_KV_HEADS, LLAMA_FF = 128256, 32, 32, 8, 14336
"""Llama-3.1-8B (``unsloth/Meta-Llama-3.1-8B-Instruct``, ai-toolkit's default ``llama_model_path``): 4096 wide."""
CLIP_POSITIONS = 248
"""HiDream's CLIP encoders' position table: Long-CLIP's 248 (HiDream-I1's report, arXiv 2505.22705: "Long-Context CLIP
(L/14 and G/14)"; the pipeline pads their captions to 128 tokens, more than CLIP's usual 77). The table is 0.4 MB;
only its size depends on this."""


def hidream_configs(pooled: int, t5: int, llama: int, layers: int, text_layers: int | None) -> list:
    """The configs of CLIP-L and CLIP-G (projected, their pooled outputs ``pooled`` wide together), T5-XXL (``t5``
    wide) and Llama-3.1-8B (``llama`` wide, ``layers`` deep: the DiT reads that many layers' states); ``text_layers``
    sets the CLIPs' and T5's depth (a test's small model)."""
    import transformers
    clips = te._clip_pair(pooled, None, text_layers, "dit-hidream: text_emb_dim", "CLIP-L and CLIP-G side by side")
    for c in clips:
        c.max_position_embeddings = CLIP_POSITIONS
    full = llama == 4096
    heads = LLAMA_HEADS if full else 1
    config = transformers.LlamaConfig(vocab_size=LLAMA_VOCAB, hidden_size=llama,
                                      intermediate_size=LLAMA_FF if full else 4 * llama, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=LLAMA_KV_HEADS if full else 1,
                                      max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                                      tie_word_embeddings=False, use_cache=False)
    return [*clips, te._t5(t5, text_layers), config]


def hidream_token_ids(batch_size: int, tokens: int, configs: list) -> list[torch.Tensor]:
    """A caption's token ids for each encoder, every one padded to ``tokens`` (the pipeline's
    ``max_sequence_length``)."""
    return [torch.randint(0, c.vocab_size - 1, (batch_size, tokens)) for c in configs]


class HiDreamWithTextEncoders(te.WithTextEncoders):
    """HiDream-I1 with its four text encoders in the step, frozen: ``forward`` takes the DiT's keywords with the
    captions' token ids in place of ``encoder_hidden_states_t5``, ``encoder_hidden_states_llama3`` and
    ``pooled_embeds``, as HiDreamImagePipeline encodes a prompt (see the module docstring)."""

    @staticmethod
    def projected(i: int, configs: list) -> bool:
        return te._is_clip(configs[i])

    def encode(self, ids: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T5's last hidden states; Llama's layers' hidden states, stacked layer first; the CLIPs' projected pooled
        outputs side by side)."""
        pooled = torch.cat([self._run(i, ids[i], output_hidden_states=True).text_embeds for i in (0, 1)], dim=-1)
        t5 = self._run(2, ids[2]).last_hidden_state
        out = self._run(3, ids[3], output_hidden_states=True)  # (no attentions: see the module docstring)
        return t5, torch.stack(out.hidden_states[1:], dim=0), pooled

    def forward(self, ids: list[torch.Tensor], return_dict: bool = False, **inputs):
        t5, llama, pooled = self.encode(ids)
        return self.denoiser(encoder_hidden_states_t5=t5, encoder_hidden_states_llama3=llama, pooled_embeds=pooled,
                             return_dict=return_dict, **inputs)
