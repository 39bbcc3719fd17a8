"""The chunked loss lives in the causal LM's forward: any call with labels gets it.

Twin models (``copy.deepcopy``): the plain Hugging Face forward against the patched one, on a
GPT-2 with a tied head and a Llama with an untied one, fp32. Bound: loss within rtol 1e-5 and
every gradient within rtol 1e-5 / atol 1e-7 (the chunked sum adds the tokens in another order).
"""

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

from helpers import measured
from memfit.errors import UserError
from memfit.plans import Plan
from memfit.step import build_step
from memfit.techniques.chunked_loss import CHUNKS_ATTR, chunk_lm_loss
from memfit.workload import Workload

VOCAB = 1000


def _gpt2(vocab=VOCAB):
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=vocab, n_positions=128,
                                      bos_token_id=0, eos_token_id=0, attn_pdrop=0, resid_pdrop=0, embd_pdrop=0))


def _llama(vocab=VOCAB):
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                        max_position_embeddings=128))


def _gemma2(vocab=VOCAB):
    from transformers import Gemma2Config, Gemma2ForCausalLM
    return Gemma2ForCausalLM(Gemma2Config(num_hidden_layers=2, hidden_size=64, intermediate_size=128, head_dim=16,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                          max_position_embeddings=128, final_logit_softcapping=3.0,
                                          pad_token_id=0, bos_token_id=0, eos_token_id=0))


def _cohere(vocab=VOCAB):
    from transformers import CohereConfig, CohereForCausalLM
    return CohereForCausalLM(CohereConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                          max_position_embeddings=128, logit_scale=0.5,
                                          pad_token_id=0, bos_token_id=0, eos_token_id=0))


def _granite(vocab=VOCAB):
    from transformers import GraniteConfig, GraniteForCausalLM
    return GraniteForCausalLM(GraniteConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                            max_position_embeddings=128, logits_scaling=8.0,
                                            pad_token_id=0, bos_token_id=0, eos_token_id=0))


MODELS = {"gpt2-tied": _gpt2, "llama-untied": _llama}
TRANSFORMING = {"gemma2-softcap": _gemma2, "cohere-logit-scale": _cohere, "granite-logits-scaling": _granite}
"""Causal LMs that change their logits between the head and the loss (Granite's scaling was skipped,
so its chunked loss differed; Gemma 2 and Cohere were refused)."""


def _twins(build):
    torch.manual_seed(0)
    plain = build()
    return plain, chunk_lm_loss(copy.deepcopy(plain), 4)


def _loss_and_grads(model, **call):
    model.zero_grad()
    out = model(**call)
    loss = out[0] if isinstance(out, tuple) else out.loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, out


def _assert_equal_training(plain, chunked, **call):
    ref_loss, ref, _ = _loss_and_grads(plain, **call)
    loss, grads, out = _loss_and_grads(chunked, **call)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], rtol=1e-5, atol=1e-7, msg=name)
    return out


def _batch(vocab=VOCAB, b=3, t=40):
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (b, t))
    labels = ids.clone()
    labels[:, :7] = -100  # a prompt that is not trained on
    labels[0, -5:] = -100  # padding
    return ids, labels


@pytest.mark.parametrize("arch", MODELS)
def test_labels_give_the_models_loss_and_gradients_without_logits(arch):
    plain, chunked = _twins(MODELS[arch])
    assert (plain.get_output_embeddings().weight is plain.get_input_embeddings().weight) == (arch == "gpt2-tied")
    ids, labels = _batch()
    out = _assert_equal_training(plain, chunked, input_ids=ids, labels=labels)
    assert out.logits is None and getattr(chunked.forward, CHUNKS_ATTR) == 4


@pytest.mark.parametrize("arch", TRANSFORMING)
def test_logits_the_model_soft_caps_or_scales_are_chunked_as_the_model_does(arch):
    plain, chunked = _twins(TRANSFORMING[arch])
    saved = dict(vars(chunked.config)), getattr(chunked, "logit_scale", None)
    ids, labels = _batch()
    out = _assert_equal_training(plain, chunked, input_ids=ids, labels=labels)
    assert out.logits is None
    assert (dict(vars(chunked.config)), getattr(chunked, "logit_scale", None)) == saved  # (switched off for the call)
    assert torch.equal(chunked(input_ids=ids).logits, plain(input_ids=ids).logits)  # (without labels: its own)


class _TanhLlama:
    """A causal LM whose forward changes its logits in a way chunking does not know."""

    @staticmethod
    def build():
        from transformers import LlamaForCausalLM
        from transformers.modeling_outputs import CausalLMOutputWithPast

        class TanhLlama(LlamaForCausalLM):
            def forward(self, input_ids=None, labels=None, **kwargs):
                logits = torch.tanh(self.lm_head(self.model(input_ids=input_ids).last_hidden_state))
                loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size)
                return CausalLMOutputWithPast(loss=loss, logits=logits)

        plain = _llama()
        model = TanhLlama(plain.config)
        model.load_state_dict(plain.state_dict())
        return model


def test_a_forward_that_changes_its_logits_otherwise_is_refused_when_it_runs():
    model = chunk_lm_loss(_TanhLlama.build(), 4)
    ids, labels = _batch()
    with pytest.raises(UserError, match=r"^loss_chunks: TanhLlama.forward changes its logits after the output layer, "
                                        r"which chunking does not reproduce; set loss_chunks: 0$"):
        model(input_ids=ids, labels=labels)


@pytest.mark.parametrize("arch", MODELS)
def test_num_items_in_batch_as_the_trainer_passes_it_with_accumulation(arch):
    """Two micro-batches each divided by the tokens of both (the Trainer's ``num_items_in_batch``):
    the accumulated gradients equal the plain model's."""
    plain, chunked = _twins(MODELS[arch])
    ids, labels = _batch(b=4)
    items = (labels[:, 1:] != -100).sum()
    grads = []
    for model in (plain, chunked):
        model.zero_grad()
        for half in (slice(0, 2), slice(2, 4)):
            model(input_ids=ids[half], labels=labels[half], num_items_in_batch=items).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)


def test_pre_shifted_labels_and_tuple_outputs():
    plain, chunked = _twins(_llama)
    ids, labels = _batch()
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    _assert_equal_training(plain, chunked, input_ids=ids, labels=labels, shift_labels=shifted)
    out = _assert_equal_training(plain, chunked, input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(out, tuple) and out[0].dim() == 0 and all(x.shape[-1] != VOCAB for x in out[1:] if
                                                                  isinstance(x, torch.Tensor))


def test_without_labels_or_in_eval_mode_the_forward_is_unchanged():
    """(Eval mode as Liger-Kernel: evaluation metrics read the logits.)"""
    plain, chunked = _twins(_gpt2)
    ids, labels = _batch()
    assert torch.equal(chunked(input_ids=ids).logits, plain(input_ids=ids).logits)
    plain.eval(), chunked.eval()
    with torch.no_grad():
        ref, got = plain(input_ids=ids, labels=labels), chunked(input_ids=ids, labels=labels)
    assert torch.equal(got.logits, ref.logits) and torch.equal(got.loss, ref.loss)


def test_labels_passed_by_position():
    plain, chunked = _twins(_llama)
    ids, labels = _batch()
    ref = plain(ids, None, None, None, None, labels).loss
    got = chunked(ids, None, None, None, None, labels)
    assert got.logits is None
    torch.testing.assert_close(got.loss, ref, rtol=1e-5, atol=0)


def test_patching_again_replaces_the_chunk_count_and_holds_no_cycle():
    model = chunk_lm_loss(chunk_lm_loss(_gpt2(), 2), 5)
    assert getattr(model.forward, CHUNKS_ATTR) == 5
    ids, labels = _batch()
    model(input_ids=ids, labels=labels).loss.backward()  # one level of patching: the head runs 5 times
    gc.disable()
    try:
        ref = weakref.ref(model)
        del model
        assert ref() is None  # freed by reference counting: the patch holds the model weakly
    finally:
        gc.enable()


def test_a_peft_model_chunks_its_base_models_forward():
    from peft import LoraConfig, get_peft_model
    plain, _ = _twins(_llama)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(2)
    plain = get_peft_model(plain, lora)
    chunked = chunk_lm_loss(copy.deepcopy(plain), 4)
    ids, labels = _batch()
    ref = _assert_equal_training(plain, chunked, input_ids=ids, labels=labels)
    assert ref.logits is None and any("lora_A" in n for n, p in chunked.named_parameters() if p.requires_grad)


class _ScaledHead(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def test_a_model_whose_head_is_not_a_plain_linear_is_refused_in_one_line():
    model = _llama()
    model.lm_head = _ScaledHead(64, VOCAB, bias=False)
    with pytest.raises(UserError, match=r"^loss_chunks: LlamaForCausalLM's output layer is a _ScaledHead, not a plain "
                                        r"nn.Linear .*; set loss_chunks: 0$"):
        chunk_lm_loss(model, 4)
    model = _llama()
    model.loss_function = lambda **kw: None
    with pytest.raises(UserError, match="not transformers' ForCausalLMLoss"):
        chunk_lm_loss(model, 4)


# -- a workload whose loss is a lambda that calls the model with labels ---------------------------

def _lambda_workload(vocab: int, seq_len: int = 64, build=_gpt2) -> Workload:
    return Workload(model=lambda: build(vocab), batch=lambda n: torch.randint(0, vocab, (n, seq_len)),
                    loss=lambda m, b: m(input_ids=b, labels=b).loss, name="gpt2-lambda")


def test_a_lambda_loss_with_labels_trains_as_the_plain_step():
    """Refused before the chunking moved into the forward ('needs a batch dict with labels')."""
    wl = _lambda_workload(VOCAB)
    torch.manual_seed(3)
    batch = wl.batch(4)
    losses, params = [], []
    for plan in (Plan(), Plan(loss_chunks=4)):
        torch.manual_seed(0)
        step = build_step(wl, plan, 4, "cpu")
        losses.append([step(batch) for _ in range(2)])
        params.append({n: p.detach().clone() for n, p in step.model.named_parameters()})
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=1e-5, atol=0)
    for name in params[0]:
        torch.testing.assert_close(params[1][name], params[0][name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("build", [_gpt2, _gemma2], ids=["gpt2", "gemma2-softcap"])
def test_a_lambda_loss_with_labels_saves_memory_as_predicted(build):
    """The profiler's measured peak (independent of the prediction) is lower with chunks, and the
    fake-tensor prediction of each is within 1% of it (Gemma 2: the soft-cap's temporaries too)."""
    wl = _lambda_workload(8000, build=build)
    base = measured(wl, Plan(), batch_size=4, seq_len=None)
    chunked = measured(wl, Plan(loss_chunks=4), batch_size=4, seq_len=None)
    assert chunked.peak_bytes < 0.8 * base.peak_bytes, (chunked.peak_bytes, base.peak_bytes)
    assert abs(base.error_percent) <= 1.0 and abs(chunked.error_percent) <= 1.0, (base.error_percent,
                                                                                   chunked.error_percent)
