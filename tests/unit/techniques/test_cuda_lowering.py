"""A GPU preset's compiled region predicted without a GPU through Inductor's CUDA path
(NOTE [ Inductor's CUDA path without a GPU ]): Triton's wrapper generated for the preset's card,
padded matmuls chosen by NOTE [ Padded matmuls without timing ], nothing of the emulated card left
behind, wrappers cached per card, Triton needed and no C++ compiler. The prediction's accuracy is
checked against an H100's measurements in tests/unit/test_gpu_ground_truth.py (c-gpt2-bf16-*)."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.devices import get_device
from memfit.errors import UserError
from memfit.techniques import compiled as compiled_module
from memfit.techniques import cuda_lowering, fake_wrapper
from memfit.techniques.compiled import compiled

TOKENS, WIDTH, VOCAB = 2048, 256, 1001  # a compute-bound vocabulary matmul on an H100, VOCAB unaligned


def lm_loss(hidden, weight, labels):
    """A language model's head and loss under bf16 autocast: the fp32 weight cast in the graph."""
    return F.cross_entropy(F.linear(hidden, weight.to(torch.bfloat16)).float(), labels)


def _predict(region, monkeypatch, device="h100-80gb"):
    """Run ``region`` forward and backward on fake CPU tensors while ``device``'s CUDA path lowers it,
    as a GPU preset's trace does; returns the wrapper sources generated and the padding choices
    (mat1 shape, mat2 shape) -> padded."""
    sources, choices = [], {}
    load = fake_wrapper._load

    def spy_load(graph, code, emulated):
        sources.append(code.value)
        return load(graph, code, emulated)

    choose = cuda_lowering._PadTiming.padded_is_faster

    def spy_choice(self, key):
        padded = choose(self, key)
        choices[tuple(tuple(t.shape) for t in self.asked[1:3])] = padded
        return padded

    monkeypatch.setattr(fake_wrapper, "_load", spy_load)
    monkeypatch.setattr(cuda_lowering._PadTiming, "padded_is_faster", spy_choice)
    torch._dynamo.reset()
    with FakeTensorMode() as mode:
        hidden = torch.empty(TOKENS, WIDTH, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.empty(VOCAB, WIDTH, requires_grad=True)
        labels = torch.zeros(TOKENS, dtype=torch.long)
    with cuda_lowering.lowering_for_cuda(get_device(device)), mode, \
            torch._inductor.config.patch(force_disable_caches=True):  # (compiled here, not loaded from a cache)
        loss = region(hidden, weight, labels)
        loss.backward()
    assert hidden.grad.device.type == weight.grad.device.type == "cpu"  # the trace's device
    return sources, choices


def test_a_gpu_presets_region_is_generated_by_triton_and_pads_as_the_h100_did(monkeypatch):
    from torch.utils._triton import has_triton
    props, capability, triton_here = torch.cuda.get_device_properties, torch.cuda.get_device_capability, has_triton()
    sources, choices = _predict(compiled(lm_loss, name="lm loss", dynamic=False), monkeypatch)
    assert len(sources) == 2 and all("async_compile.triton(" in s and "empty_strided_cuda" in s for s in sources)
    assert all("cpp_fused" not in s for s in sources)  # not the CPU's code generator
    # NOTE [ Padded matmuls without timing ]: only the input gradient's matmul, whose padded operands
    # Inductor writes itself (the forward's and the weight gradient's would need a strided copy)
    assert choices == {((TOKENS, WIDTH), (WIDTH, VOCAB)): False, ((TOKENS, VOCAB), (VOCAB, WIDTH)): True,
                       ((VOCAB, TOKENS), (TOKENS, WIDTH)): False}
    padded = VOCAB + 7
    assert f"{padded}" not in sources[0] and f"{padded}" in sources[1]  # the backward holds the padded copy
    # nothing of the emulated card is left behind
    assert torch.cuda.get_device_properties is props and torch.cuda.get_device_capability is capability
    assert has_triton() == triton_here  # (answered from the card while compiling only)


def test_a_run_pads_by_the_rule_its_prediction_pads_by(monkeypatch):
    """NOTE [ Padded matmuls without timing ]: pad_mm's timing padded GPT-2's vocabulary matmuls otherwise on an
    H200 than on an H100 (+0.8 GB); a region compiled for real tensors, as a run on a GPU compiles it, takes the
    prediction's rule in place of a timing."""
    from torch._inductor import compile_fx as inductor
    from torch._inductor.fx_passes import pad_mm
    rules = []

    def compile_fx(gm, example_inputs, **kwargs):  # (Inductor's entry, spied on: the graph runs as captured)
        rules.append((getattr(pad_mm.get_cached_should_pad, "__self__", None),
                      getattr(pad_mm.should_pad_bench_key, "__self__", None)))
        return gm

    monkeypatch.setattr(inductor, "compile_fx", compile_fx)
    torch._dynamo.reset()
    doubled = compiled(lambda x: (x * 2).sum(), name="doubled", dynamic=False)
    assert doubled(torch.ones(3)).item() == 6
    assert len(rules) == 1 and all(isinstance(r, cuda_lowering._PadTiming) for r in rules[0])
    assert rules[0][0] is rules[0][1]  # (one rule: the key it is asked for is the one it answers)
    assert not isinstance(getattr(pad_mm.get_cached_should_pad, "__self__", None), cuda_lowering._PadTiming)


def test_predicted_wrappers_are_keyed_by_card():
    """A card's facts change the CUDA path's choices (its SMs split reductions, its FLOP/s decide
    which matmuls pad): its wrappers are cached apart (NOTE [ Predicted wrappers in Inductor's caches ])."""
    keys = {}
    for name in ("h100-80gb", "rtx4090"):
        with cuda_lowering.lowering_for_cuda(get_device(name)):
            keys[name] = fake_wrapper.PREDICTION_PASS.uuid()
    keys["cpu"] = fake_wrapper.PREDICTION_PASS.uuid()
    assert len(set(keys.values())) == 3


def test_predicted_wrappers_are_keyed_by_the_torch_attention_rules(monkeypatch):
    """The attention kernel a region takes follows the torch release's rules (memfit.sdpa_backends), which a
    recorded GPU row's prediction sets to its own torch's (tools/gpu/rows.py): its wrappers are cached apart."""
    from memfit import sdpa_backends
    with cuda_lowering.lowering_for_cuda(get_device("h100-80gb")):
        installed = fake_wrapper.PREDICTION_PASS.uuid()
        monkeypatch.setattr(sdpa_backends, "TORCH_CHECKS_CUDNN_DROPOUT", not sdpa_backends.TORCH_CHECKS_CUDNN_DROPOUT)
        assert fake_wrapper.PREDICTION_PASS.uuid() != installed


def test_a_gpu_presets_compile_needs_triton_and_no_cpu_compiler(monkeypatch):
    import shutil
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no C++ compiler here
    sources, _ = _predict(compiled(lm_loss, name="lm loss", dynamic=False), monkeypatch, device="rtx4090")
    assert len(sources) == 2
    monkeypatch.setattr(compiled_module, "has_triton", lambda: False)
    with pytest.raises(UserError, match="compile for h100-80gb needs Triton .*pip install triton"):
        _predict(compiled(lm_loss, name="lm loss", dynamic=False), monkeypatch)


def test_the_planner_searches_a_gpu_presets_compile_by_triton_not_a_cpu_compiler(monkeypatch):
    import shutil

    from memfit.planner.space import default_space, model_facts
    from memfit.techniques import compile as compile_technique
    from memfit.workloads import load_workload

    facts = model_facts(load_workload("gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=500,n_positions=128", seq_len=64))

    def modes(device):
        space = default_space(facts, get_device(device), 8, compile_modes=("none", "blocks"))
        return space.values["compile"], space.notes

    monkeypatch.setattr(shutil, "which", lambda name: None)  # no C++ compiler: the CPU's compile is left out
    assert modes("a100-40gb")[0] == ["none", "blocks"]
    compiles, notes = modes("cpu")
    assert compiles == ["none"] and any("C++ compiler" in n for n in notes)
    monkeypatch.setattr(compile_technique, "has_triton", lambda: False)
    compiles, notes = modes("a100-40gb")
    assert compiles == ["none"] and any("needs Triton (pip install triton)" in n for n in notes), notes


def test_a_nested_compile_region_is_lowered_for_the_card_too(monkeypatch):
    """A region the model marks with ``torch.compiler.nested_compile_region`` (compiled once, called
    per slice) is a subgraph of the joint graph, with its inputs' fake values recorded apart
    (``eager_input_vals``): it is moved to CUDA with the rest, and Triton generates its kernels. Left on
    the CPU, Inductor lowered its softmax for the CPU inside a CUDA wrapper and failed."""
    one_slice = torch.compiler.nested_compile_region(lm_loss)

    def sliced(hidden, weight, labels):
        return sum(one_slice(h, weight, y) for h, y in zip(hidden.chunk(2), labels.chunk(2)))

    sources, _ = _predict(compiled(sliced, name="sliced loss", dynamic=False), monkeypatch)
    assert len(sources) == 2 and all("cpp_fused" not in s for s in sources)
    subgraphs = [s.split("def partitioned_fw_subgraph_0_0(args):")[1].split("\ndef ")[0] for s in sources
                 if "def partitioned_fw_subgraph_0_0(args):" in s]
    assert subgraphs and all("empty_strided_cuda" in s and "empty_strided_cpu" not in s for s in subgraphs)
