"""Mixture-of-experts models as transformers runs them: the grouped GEMM on fake tensors in every
dtype (NOTE [ Grouped GEMM on fake tensors ]), the CUDA kernels a GPU preset gets for it, total
and active parameters, and a failure inside the trace blamed on memfit (NOTE [ Whose failure ])."""

import contextlib
import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.cli.main import main
from memfit.memory import adapters
from memfit.memory.estimate import estimate
from memfit.memory.faketrace import run_tracked
from memfit.memory.grouped_mm import grouped_mm_meta, meta_refuses
from memfit.memory.tracker import MemoryTracker
from memfit.memory.workspaces import _measure
from memfit.plans import Plan
from memfit.target import Target
from memfit.workloads.small_configs import SMALL_FOLDERS, write_folder

aten = torch.ops.aten
E, S, K, N = 4, 96, 64, 48


def grouped_calls(dtype):
    """The three grouped GEMMs of an expert layer's step: forward (2-D x 3-D, the weight stored
    transposed as transformers passes it), the input's gradient and the weight's (2-D x 2-D)."""
    a = torch.randn(S, K, dtype=dtype)
    w = torch.randn(E, N, K, dtype=dtype).transpose(-2, -1)
    offs = torch.tensor([20, 50, 50, S], dtype=torch.int32)  # one expert gets nothing
    g = torch.randn(S, N, dtype=dtype)
    return [(a, w, offs), (g, w.transpose(-2, -1), offs), (g.t(), a, offs)]


def test_pytorch_meta_still_refuses_fp32_else_this_registration_goes():
    """If this fails, PyTorch's meta kernel accepts fp32 grouped GEMMs itself: remove
    memfit.memory.grouped_mm and its use in memfit.memory.adapters.real_code_paths."""
    from torch._subclasses import fake_impls
    assert isinstance(fake_impls.op_implementations_checks, list)  # where fake mode looks first
    assert meta_refuses(torch.float32) and meta_refuses(torch.float16) and not meta_refuses(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fake_grouped_mm_is_the_real_kernels_output_and_no_scratch(dtype):
    for a, b, offs in grouped_calls(dtype):
        real = aten._grouped_mm.default(a, b, offs)
        measured = _measure(aten._grouped_mm.default, (a, b, offs), {})  # the profiler's allocator events
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, grouped_mm_meta():
            fake = aten._grouped_mm.default(*(mode.from_tensor(t) for t in (a, b, offs)))
        assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)
        assert measured.output_nbytes == (fake.untyped_storage().nbytes(),)
        if dtype == torch.float32:  # fp32: mm_out into the output, nothing else (bf16 packs: probed)
            assert measured.scratch_bytes == 0


def test_it_checks_as_the_real_kernel_and_acts_in_the_trace_only():
    def call(*shapes, mode=contextlib.nullcontext):
        FakeTensorMode.cache_clear()  # (fake mode caches what ops returned, across modes)
        with FakeTensorMode(), mode():
            return aten._grouped_mm.default(*(torch.randn(s) for s in shapes), torch.zeros(E, dtype=torch.int32))
    assert call((S, K), (E, K, N), mode=grouped_mm_meta).shape == (S, N)
    with pytest.raises(RuntimeError, match="16 bytes"):  # what the real kernel refuses, refused
        call((S, 6), (E, 6, 6), mode=grouped_mm_meta)
    with pytest.raises(RuntimeError, match="Expected mat_a to be BFloat16"):
        call((S, K), (E, K, N))


def test_a_failure_inside_the_fake_trace_is_memfits_and_names_op_module_and_line(tmp_path, monkeypatch, capsys):
    """Without the registration, the issue's error: it must not tell the user to fix the config."""
    monkeypatch.setattr(adapters, "grouped_mm_meta", contextlib.nullcontext)
    big = dict(SMALL_FOLDERS["mixtral"], hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_local_experts=8, vocab_size=32000, num_attention_heads=32, num_key_value_heads=8)
    (tmp_path / "config.json").write_text(json.dumps(big))
    assert main(["estimate", str(tmp_path), "--device", "rtx4090", "-b", "1", "--seq-len", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "fix its config.json" not in err
    assert "memfit's fake-tensor trace of loss(model, batch) failed at aten._grouped_mm.default in module " \
           "MixtralExperts (transformers/integrations/moe.py:" in err
    assert "memfit does not model this yet (the model is not at fault)" in err


def test_only_a_fake_kernels_failure_in_the_step_is_memfits():
    from memfit.errors import TraceError, UserError
    from memfit.workloads.checks import blamed

    def grouped(*_):  # an op whose meta kernel refuses what its real kernel runs
        return aten._grouped_mm.default(torch.randn(S, K), torch.randn(E, K, N), torch.zeros(E, dtype=torch.int32))

    def bad_config(*_):  # the model's own code refusing its config
        raise ValueError("n_embd must be divisible by n_head")
    fix = "fix its config.json"
    FakeTensorMode.cache_clear()
    with FakeTensorMode():
        with pytest.raises(TraceError, match=r"^acme/moe: memfit's fake-tensor trace of loss\(model, batch\) failed "
                                             r"at aten._grouped_mm.default"):
            blamed("acme/moe", fix, "loss(model, batch)", grouped)()
        with pytest.raises(UserError, match="building the model failed with ValueError: n_embd .*; fix its config"):
            blamed("acme/moe", fix, "building the model", bad_config)()
        with pytest.raises(UserError, match="loss.* failed with ValueError: n_embd .*; fix its config"):
            blamed("acme/moe", fix, "loss(model, batch)", bad_config)()


def test_a_small_model_failing_the_trace_is_measured_for_real_instead(monkeypatch):
    monkeypatch.setattr(adapters, "grouped_mm_meta", contextlib.nullcontext)
    r = estimate(write_folder("mixtral"), Plan(), batch_size=2, seq_len=32)
    assert r.method == "real-fallback" and "aten._grouped_mm.default in module MixtralExperts" in r.approximations[0]


def experts_params(folder):
    """Total parameters and those of the experts' 3-D weights, counted on the meta device."""
    import transformers
    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and p.dim() >= 2)
    return total, experts


def test_active_and_total_parameters_side_by_side():
    folder = write_folder("qwen2_moe")  # 8 experts, top-2, and a shared expert (always active)
    total, experts = experts_params(folder)
    r = estimate(folder, Plan(), batch_size=2, seq_len=32)
    active = total - experts * 6 / 8
    assert r.facts[0] == (f"mixture of experts: {total / 1e3:.2f} K parameters, {active / 1e3:.2f} K active per "
                          "token (top-2 of 8 experts in 2 layers)")
    assert "router's choices do not change this step's memory" in r.facts[1] and r.worst_routing_peak_bytes is None
    adapted = estimate(folder, Plan(adapter="lora:r=8,params=experts.gate_up_proj+experts.down_proj"), batch_size=2,
                       seq_len=32)  # (the model card's counts: the adapter's parameters are not the model's)
    assert adapted.facts[0] == r.facts[0] and any("parameters trained" in f for f in adapted.facts)


def booked(target) -> dict[str, int]:
    run = run_tracked(target, fake=True)
    out: dict[str, int] = {}
    for rec in run.tracker.state.records:
        out[rec.op] = out.get(rec.op, 0) + 1
    return out


def test_gpu_presets_take_the_cards_grouped_gemm():
    folder = write_folder("mixtral")
    plan = Plan(precision="bf16-pure")
    hopper = booked(Target.resolve(folder, plan, 2, "h100-80gb", seq_len=32))
    ada = booked(Target.resolve(folder, plan, 2, "rtx4090", seq_len=32))
    turing = booked(Target.resolve(folder, Plan(precision="fp16"), 2, "t4", seq_len=32))
    calls = 2 * 2 * 3 * 2  # steps x layers x (forward + 2 gradients) x (gate_up, down)
    assert hopper["cutlass grouped gemm arguments"] == hopper["cutlass grouped gemm workspace"] == calls
    assert hopper["_grouped_mm"] == ada["_grouped_mm"] == calls and "cutlass grouped gemm arguments" not in ada
    assert "_grouped_mm" not in turing and turing["grouped_mm_fallback"] == 2 * 2 * 2  # transformers' own op


def test_quantized_base_weights_leave_the_experts_3d_weights_as_they_are_and_say_so():
    """Mixtral's QLoRA on a 24 GB card: 85 GiB of parameters with nf4, because the experts are 3-D
    weights, not nn.Linear layers; transformers' BitsAndBytesConfig leaves them so too. The report
    says which bytes stayed, counted here on the meta device."""
    pytest.importorskip("bitsandbytes")
    folder = write_folder("mixtral")
    _, experts = experts_params(folder)
    r = estimate(folder, Plan(base_weights="nf4", adapter="lora:r=16"), batch_size=2, seq_len=32)
    line = next(f for f in r.facts if f.startswith("base weights:"))
    from memfit.units import fmt_bytes
    assert line.startswith(f"base weights: the experts' 3-D weights ({fmt_bytes(experts * 4)} in float32) are not "
                           "nn.Linear layers, so they are not quantized")
    plain = estimate(folder, Plan(adapter="lora:r=16"), batch_size=2, seq_len=32)
    assert not any(f.startswith("base weights:") for f in plain.facts)
    from memfit.errors import WeightsExceedBudget
    from memfit.planner.search import plan
    with pytest.raises(WeightsExceedBudget, match=f"{fmt_bytes(experts * 2)} of them the experts' 3-D weights, which "
                                                  "nf4 leaves unquantized"):  # (a planner's refusal says why, too)
        plan(folder, budget="1KiB", device="rtx4090", batch_size=2, seq_len=32,
             fixed={"base_weights": "nf4", "adapter": "lora:r=16"})


def test_sizes_an_op_refuses_in_the_fake_trace_are_the_configs_and_name_op_module_and_line(tmp_path, capsys):
    """A DeepSeek-V3 config whose head_dim (12) is not its rope and nope dims' sum (8 + 16): on a GPU
    preset the planner's trace refused a broadcast in a fake kernel, and the error blamed memfit
    ("the model is not at fault"). The device's kernel refuses those sizes too: the config is at fault."""
    from memfit.errors import TraceError, UserError
    from memfit.workloads.checks import blamed
    config = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=64,
                  intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
                  num_hidden_layers=2, first_k_dense_replace=1, vocab_size=1000, n_routed_experts=4,
                  num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=12)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", str(tmp_path), "--device", "rtx4090", "-b", "1", "--seq-len", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "memfit does not model this yet" not in err and err.endswith("fix its config.json")
    assert "loss(model, batch) failed at aten.mul.Tensor in module DeepseekV3Attention " \
           "(transformers/models/deepseek_v3/modeling_deepseek_v3.py:" in err
    assert "the op refuses its operands' sizes" in err

    def broadcast(*_):
        return torch.randn(2, 3) * torch.randn(2, 4)
    FakeTensorMode.cache_clear()
    with FakeTensorMode():  # a config's sizes: the user's; a built-in without overrides: still memfit's own
        with pytest.raises(UserError, match="refuses its operands' sizes.*; fix its config.json$"):
            blamed("acme/moe", "fix its config.json", "loss(model, batch)", broadcast)()
        with pytest.raises(TraceError, match="memfit does not model this yet"):
            blamed("llama", None, "loss(model, batch)", broadcast)()

    def from_an_assumed_count(x):  # (sizes made from a value the trace assumed: memfit's, as JetMoE's expert counts)
        n = int(x.sum().item())
        return torch.randn(n + 2, 4) * torch.randn(3, 4)
    FakeTensorMode.cache_clear()
    with FakeTensorMode(), MemoryTracker(assume_scalars=True):
        with pytest.raises(TraceError, match="memfit does not model this yet"):
            blamed("acme/moe", "fix its config.json", "loss(model, batch)", from_an_assumed_count)(torch.ones(3))
