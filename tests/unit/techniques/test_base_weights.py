"""base_weights: bitsandbytes' quantized base weights, predicted on fake tensors and measured."""

from __future__ import annotations

import math
import warnings
from collections import Counter

import pytest
import torch

from memfit.errors import UserError
from memfit.memory.faketrace import run_tracked
from memfit.memory.measure import profile
from memfit.plans import Plan
from memfit.target import Target
from memfit.workload import Workload

bnb = pytest.importorskip("bitsandbytes")
warnings.filterwarnings("ignore", module="bitsandbytes")

LAYERS, HIDDEN, FFN, VOCAB, SEQ = 2, 128, 256, 256, 32
LINEAR_SHAPES = [(HIDDEN, HIDDEN)] * 4 + [(FFN, HIDDEN)] * 2 + [(HIDDEN, FFN)]  # q k v o, gate up, down


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
                                        max_position_embeddings=64, tie_word_embeddings=False))


def user_qlora():
    """A user's own QLoRA: bitsandbytes modules, peft's kbit preparation and LoRA, in model()."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    model = tiny_llama()
    for name, linear in [(n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear and n != "lm_head"]:
        parent, _, child = name.rpartition(".")
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=False, compute_dtype=torch.float32,
                                  quant_type="nf4", compress_statistics=True)
        layer.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4")
        setattr(model.get_submodule(parent), child, layer.to(linear.weight.device))
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def workload(model=tiny_llama):
    return Workload(model=model, batch=lambda n: torch.randint(0, VOCAB, (n, SEQ)),
                    loss=lambda m, b: m(input_ids=b, labels=b).loss, name="tiny-llama")


def quantized_layers(model):
    return [m for m in model.modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))]


def nbytes(t):
    return t.numel() * t.element_size()


@pytest.mark.parametrize("value", ["nf4", "nf4:double_quant=true", "int8"])
def test_quantized_weights_have_exact_bytes_on_fake_and_real_tensors(value):
    for fake in (True, False):
        step = run_tracked(Target.resolve(workload(), Plan(base_weights=value), 1), fake=fake, steps=0).step
        layers = quantized_layers(step.model)
        assert [(m.out_features, m.in_features) for m in layers] == LINEAR_SHAPES * LAYERS  # not lm_head
        for layer in layers:
            n = layer.out_features * layer.in_features
            w = layer.weight
            assert not w.requires_grad
            if value == "int8":
                assert (w.dtype, nbytes(w), nbytes(w.SCB)) == (torch.int8, n, 4 * layer.out_features)
                continue
            qs = w.quant_state
            assert (w.dtype, nbytes(w)) == (torch.uint8, n // 2)
            if value == "nf4":
                assert (qs.nested, qs.absmax.dtype, nbytes(qs.absmax)) == (False, torch.float32, 4 * n // 64)
            else:  # 8-bit absmax, one fp32 scale per 256 blocks, an fp32 offset
                assert (qs.nested, nbytes(qs.absmax), nbytes(qs.state2.absmax)) == (True, n // 64, 4 * (n // 64 // 256))
        assert step.model.lm_head.weight.requires_grad and type(step.model.lm_head) is torch.nn.Linear


@pytest.mark.parametrize("value", ["nf4", "nf4:double_quant=true", "int8"])
def test_estimate_matches_the_measured_peak_on_cpu(value):
    r = profile(workload(), Plan(base_weights=value), batch_size=2, repeats=0)
    assert abs(r.error_percent) < 1.0, (r.predicted_peak_bytes, r.peak_bytes)


def test_users_own_qlora_workload_is_predicted_within_1_percent():
    r = profile(workload(user_qlora), Plan(), batch_size=2, repeats=0)
    assert abs(r.error_percent) < 1.0, (r.predicted_peak_bytes, r.peak_bytes)
    assert r.measured.breakdown["optimizer_states"] > 0  # the LoRA weights train


def users_lora():
    """A user's own PEFT LoRA, with no quantization: memfit's base_weights makes it a QLoRA."""
    from peft import LoraConfig, get_peft_model
    return get_peft_model(tiny_llama(), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                   lora_dropout=0.0))


def test_base_weights_quantize_the_base_under_a_users_peft_adapter_and_train_the_adapter():
    """The adapter's own matrices stay full-precision linears and keep training; every base linear
    under them and beside them is 4-bit and frozen (it was: every linear quantized, everything
    frozen, "the workload's model has no trainable parameters")."""
    trainable = {n for n, p in users_lora().named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    step = run_tracked(Target.resolve(workload(users_lora), Plan(base_weights="nf4"), 1), fake=False, steps=1).step
    model = step.model
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
    assert all(type(m) is torch.nn.Linear for n, m in model.named_modules() if n.endswith(("lora_A.default",
                                                                                             "lora_B.default")))
    assert [(m.out_features, m.in_features) for m in quantized_layers(model)] == LINEAR_SHAPES * LAYERS
    assert all(p.grad is not None for n, p in model.named_parameters() if n in trainable)
    r = profile(workload(users_lora), Plan(base_weights="nf4"), batch_size=2, repeats=0)
    assert abs(r.error_percent) < 1.0, (r.predicted_peak_bytes, r.peak_bytes)


@pytest.mark.parametrize(("quant_type", "bound"), [("nf4", 0.12), ("fp4", 0.15)])
def test_4bit_output_and_input_gradient_stay_close_to_fp32(quant_type, bound):
    """Relative L2 error of a 128 -> 256 layer's output and input gradient (measured: nf4 0.091,
    fp4 0.110); the bound is about 1.3x that."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(HIDDEN, FFN)
    layer = bnb.nn.Linear4bit(HIDDEN, FFN, compute_dtype=torch.float32, quant_type=quant_type)
    layer.load_state_dict(linear.state_dict())
    layer = layer.to("cpu")
    x = torch.randn(4, SEQ, HIDDEN, requires_grad=True)
    xq = x.detach().clone().requires_grad_(True)
    y, yq = linear(x), layer(xq)
    g = torch.randn_like(y)
    y.backward(g)
    yq.backward(g)
    assert 0 < ((yq - y).norm() / y.norm()).item() < bound
    assert 0 < ((xq.grad - x.grad).norm() / x.grad.norm()).item() < bound


@pytest.mark.parametrize(("device", "batch"), [("h100-80gb", 64), ("cpu", 2)])
def test_each_4bit_matmul_dequantizes_its_weight_in_forward_and_backward(device, batch):
    """NOTE [ 4-bit matmul kernels on fake tensors ]: on CUDA past 1536 rows (64 x 32 tokens) and on
    the CPU at any size, every quantized layer's forward and backward hold its [out, in] fp32 weight. (Its input
    embeddings' output requires grad, as under peft's reentrant checkpointing: else backward stops at the head.)"""
    def input_grads_llama():
        model = tiny_llama()
        model.enable_input_require_grads()
        return model
    run = run_tracked(Target.resolve(workload(input_grads_llama), Plan(base_weights="nf4"), batch, device), fake=True)
    seen = Counter((r.phase, r.nbytes) for r in run.tracker.state.records
                   if r.step == 2 and r.op == "dequantize_4bit")
    expected = Counter({(phase, 4 * o * i): 0 for phase in ("forward", "backward") for o, i in LINEAR_SHAPES})
    for phase in ("forward", "backward"):
        for o, i in LINEAR_SHAPES * LAYERS:
            expected[(phase, 4 * o * i)] += 1
    assert seen == expected


@pytest.mark.parametrize("device", ["h100-80gb", "cpu"])
def test_a_4bit_matmul_under_autocast_returns_what_bitsandbytes_returns(device):
    """NOTE [ The 4-bit matmul under autocast ]: bitsandbytes' own kernel, run with no dispatch mode,
    returns bf16 under bf16 autocast from an fp32 input (its F.linear is autocast); the fake trace's
    kernel returns the same, where it returned fp32."""
    from memfit.devices import get_device
    from memfit.techniques.bnb_kernels import Gemm4bitKernels
    layer = bnb.nn.Linear4bit(HIDDEN, FFN, bias=False, compute_dtype=torch.float32, quant_type="nf4").to("cpu")
    x = torch.randn(64, SEQ, HIDDEN, requires_grad=True)  # 2048 rows: CUDA's fallback, not its fused kernel
    with torch.autocast("cpu", dtype=torch.bfloat16):
        real = bnb.matmul_4bit(x, layer.weight, quant_state=layer.weight.quant_state)
    fake_layer = quantized_layers(run_tracked(Target.resolve(workload(), Plan(base_weights="nf4"), 1), fake=True,
                                              steps=0).step.model)[4]  # gate_proj: 128 -> 256
    fx = fake_layer.weight.fake_mode.from_tensor(x)
    for autocast, expected in ((True, real.dtype), (False, torch.float32)):
        with Gemm4bitKernels(get_device(device)), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = bnb.matmul_4bit(fx, fake_layer.weight, quant_state=fake_layer.weight.quant_state)
        assert (out.shape, out.dtype) == (real.shape, expected)
    assert real.dtype == torch.bfloat16


def test_a_real_4bit_matmul_measured_under_a_dispatch_mode_autocasts_as_without_one():
    """A dispatch mode (memfit's tracker in ``memfit profile``) hides autocast from bitsandbytes' own
    kernel: it ran its F.linear in fp32. The step's context restores it; with no mode active (a
    plain training run) it enters nothing."""
    import contextlib

    from torch.utils._python_dispatch import TorchDispatchMode

    from memfit.devices import get_device
    from memfit.techniques.bnb_kernels import gemm_4bit_kernels

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    layer = bnb.nn.Linear4bit(HIDDEN, FFN, bias=False, compute_dtype=torch.float32, quant_type="nf4").to("cpu")
    x = torch.randn(4, SEQ, HIDDEN, requires_grad=True)
    cpu = get_device("cpu")
    assert isinstance(gemm_4bit_kernels(cpu), contextlib.nullcontext)
    with PassThrough():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = bnb.matmul_4bit(x, layer.weight, quant_state=layer.weight.quant_state)
        with gemm_4bit_kernels(cpu), torch.autocast("cpu", dtype=torch.bfloat16):
            restored = bnb.matmul_4bit(x, layer.weight, quant_state=layer.weight.quant_state)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = bnb.matmul_4bit(x, layer.weight, quant_state=layer.weight.quant_state)
    assert (hidden.dtype, restored.dtype, plain.dtype) == (torch.float32, torch.bfloat16, torch.bfloat16)
    torch.testing.assert_close(restored, plain)


def test_cuda_takes_bitsandbytes_fused_kernel_for_few_rows_only():
    from memfit.devices import get_device
    from memfit.techniques.bnb_kernels import cuda_fused_4bit
    h100 = get_device("h100-80gb")
    assert cuda_fused_4bit(h100, torch.bfloat16, 4, 4096, 4096, 64)
    assert not cuda_fused_4bit(h100, torch.bfloat16, 2048, 4096, 4096, 64)


def test_user_errors_are_one_line_with_the_fix(monkeypatch):
    with pytest.raises(UserError, match="as-is, nf4, fp4, int8"):
        Plan(base_weights="nf3")
    convs = Workload(model=lambda: torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten()),
                     batch=lambda n: torch.randn(n, 3, 8, 8), loss=lambda m, b: m(b).sum(), name="convs")
    with pytest.raises(UserError, match="found no nn.Linear.*base_weights: as-is"):
        run_tracked(Target.resolve(convs, Plan(base_weights="nf4"), 1), fake=True, steps=0)
    import memfit.techniques.optimizers as optimizers
    monkeypatch.setattr(optimizers, "bitsandbytes_available", lambda: False)
    with pytest.raises(UserError, match="pip install bitsandbytes"):
        run_tracked(Target.resolve(workload(), Plan(base_weights="int8"), 1), fake=True, steps=0)


@pytest.mark.parametrize("spec", ["llama:hidden_size=64,intermediate_size=128,num_hidden_layers=2,vocab_size=300",
                                  "gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=300,n_positions=64"])
@pytest.mark.parametrize("adapter", ["lora:r=4", "dora:r=4,targets=all-linear"])
def test_an_adapter_trains_as_many_parameters_on_any_base_weights_as_the_planner_counts(spec, adapter):
    """The planner counts an adapter's parameters on the workload's own weights (memfit.planner.search:
    ``_trainable``); each format's quantized layers keep the linears' features (GPT-2's Conv1D
    included), so the steps that train them train as many."""
    from memfit.memory.faketrace import trainable_parameters
    from memfit.planner.search import _trainable
    target = Target.resolve(spec, None, 1, "rtx4090", seq_len=32)
    counts = {value: trainable_parameters(target.with_plan(Plan(adapter=adapter, base_weights=value)))
              for value in ("nf4", "int8") + (() if adapter.startswith("dora") else ("fp8",))}  # (fp8 takes no DoRA)
    counted = _trainable(target, None, {"adapter": adapter, "base_weights": "nf4"})
    assert counted > 0 and set(counts.values()) == {counted}, (counted, counts)


def test_qdora_is_traced_on_fake_tensors_within_1pct_of_the_profiler():
    """peft's DoRA deep-copies a 4-bit layer to dequantize its weight (QDoRA): the copy of a
    bitsandbytes parameter on fake tensors (NOTE [ bitsandbytes parameters on fake tensors ]), where a
    failed trace fell back to a real run (a 7B model's, on the CPU)."""
    spec = "llama:num_hidden_layers=2,hidden_size=128,intermediate_size=256,num_attention_heads=4,vocab_size=1000"
    r = profile(spec, Plan(adapter="dora:r=8,targets=q_proj+v_proj", base_weights="nf4", precision="bf16",
                           checkpointing="blocks"), batch_size=2, seq_len=64, repeats=0)
    assert r.predicted.method == "fake"
    assert abs(r.error_percent) <= 1.0, r.error_percent


def test_dora_on_8bit_weights_traces_two_steps_on_a_gpu_preset_with_the_layers_scales_kept():
    """On a GPU peft's DoRA leaves an 8-bit weight where it is; fake tensors are CPU tensors, where it
    re-wraps it every forward and bitsandbytes' ``to`` drops the scales the layer holds (its second step
    failed, as on a real CPU). NOTE [ bitsandbytes parameters on fake tensors ]."""
    spec = "llama:num_hidden_layers=2,hidden_size=128,intermediate_size=256,num_attention_heads=4,vocab_size=1000"
    run = run_tracked(Target.resolve(spec, Plan(adapter="dora:r=8", base_weights="int8"), 2, "rtx4090", seq_len=32),
                      fake=True)
    layers = quantized_layers(run.step.model)
    assert len(layers) == 14 and all(m.state.SCB is not None and m.weight.dtype == torch.int8 for m in layers)
    with pytest.raises(UserError, match=r"DoRA over int8 base weights fails on the CPU from its second step .*"
                                        r"use base_weights: nf4 \(QDoRA\)$"):
        profile(spec, Plan(adapter="dora:r=8", base_weights="int8"), batch_size=2, seq_len=32, repeats=0)


def test_quantized_weights_with_nothing_left_to_train_say_to_train_an_adapter():
    """A model with no output layer (a diffusion transformer) has every linear quantized and frozen."""
    head_less = Workload(model=lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)),
                         batch=lambda n: torch.randn(n, 8), loss=lambda m, b: m(b).square().mean(), name="mlp")
    with pytest.raises(UserError, match=r"no trainable parameters under base_weights nf4 .*; train an adapter "
                                        r"\(adapter: lora:r=16\)$"):
        run_tracked(Target.resolve(head_less, Plan(base_weights="nf4"), 2, "rtx4090"), fake=True, steps=0)


@pytest.mark.parametrize("value, precision", [("nf4", "fp32"), ("int8", "fp32"), ("nf4", "bf16")])
def test_compiled_blocks_of_quantized_layers_are_predicted_on_fake_tensors_within_1pct(value, precision):
    """Dynamo wraps a fake bitsandbytes parameter as a tensor, as it wraps the real one (NOTE [
    bitsandbytes parameters on fake tensors ]): QLoRA with compiled blocks traced, where it failed. Under
    bf16 autocast the 4-bit matmul's autocast kernel came back to itself under Dynamo's Python dispatcher
    (a RecursionError, reported as a graph break: NOTE [ The 4-bit matmul under autocast ])."""
    spec = "llama:num_hidden_layers=2,hidden_size=128,intermediate_size=256,num_attention_heads=4,vocab_size=1000"
    r = profile(spec, Plan(adapter="lora:r=8", base_weights=value, compile="blocks", precision=precision), batch_size=2,
                seq_len=64, repeats=0)
    assert r.predicted.method == "fake"
    assert abs(r.error_percent) <= 1.0, r.error_percent


def test_bitsandbytes_leaves_the_modules_kept_in_fp32_unquantized_as_transformers_and_diffusers_do():
    """NOTE [ What bitsandbytes leaves unquantized ]: the linears memfit leaves are those transformers' own rule
    (``should_convert_module`` over T5's ``_keep_in_fp32_modules``) and diffusers' (a whole-name match over
    Wan's) leave; Wan's 4-bit LoRA then trains (its uint8 time embedder took a uint8 timestep and failed)."""
    transformers = pytest.importorskip("transformers")
    diffusers = pytest.importorskip("diffusers")
    from transformers.quantizers.quantizers_utils import should_convert_module

    from memfit.techniques.base_weights import _kept_in_their_dtype
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2))
    wan = diffusers.WanTransformer3DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                                          text_dim=8, freq_dim=8, ffn_dim=16, num_layers=1)
    for model, skipped in ((t5, lambda n: not should_convert_module(n, t5._keep_in_fp32_modules)),
                           (wan, lambda n: any(k + "." in n + "." for k in wan._keep_in_fp32_modules))):
        kept = _kept_in_their_dtype(model)
        linears = [(n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear]
        assert [n for n, m in linears if id(m) in kept] == [n for n, _ in linears if skipped(n)] != []
    from helpers import run_steps
    from memfit.workloads import load_workload
    spec = "dit-wan:num_layers=2,attention_head_dim=16,num_attention_heads=2,ffn_dim=64,text_dim=32,freq_dim=32,frames=5"
    losses = run_steps(load_workload(spec, resolution=64), Plan(adapter="lora:r=4", base_weights="nf4"), steps=2,
                       batch_size=2, seq_len=None)[0]
    assert all(math.isfinite(x) for x in losses)
