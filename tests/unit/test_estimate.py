"""estimate: GPU presets, fallback for untraceable workloads, speed on a 7B model."""

import pytest
import torch
from torch import nn

from memfit.errors import TraceError, UserError
from memfit.memory import estimate as estimate_module
from memfit.memory.estimate import estimate
from memfit.memory.measure import profile
from memfit.plans import Plan
from memfit.workload import Workload


def test_gpu_preset_reports_reserved_context_and_fit():
    r = estimate("gpt2:n_layer=2", Plan(precision="bf16"), batch_size=2, seq_len=128, device="a100-40gb")
    assert r.reserved_bytes >= r.peak_bytes > 0
    assert r.cuda_context_bytes > 0 and r.device_total_bytes == 42_505_273_344
    assert r.fits is True
    assert sum(r.breakdown.values()) == r.peak_bytes
    big = estimate("gpt2", Plan(), batch_size=64, seq_len=1024, device="t4")
    assert big.fits is False


def test_auto_precision_follows_the_device():
    t4 = estimate("mha", Plan(precision="auto"), batch_size=2, device="t4")
    h100 = estimate("mha", Plan(precision="auto"), batch_size=2, device="h100-80gb")
    assert (t4.precision, h100.precision) == ("fp16", "bf16")
    with pytest.raises(UserError, match="no bf16"):
        estimate("mha", Plan(precision="bf16"), batch_size=2, device="v100-16gb")


def _masked_workload():
    def loss(m, x):
        y = m(x)
        return y[y > 0].sum()  # boolean-mask indexing: output size depends on the data
    return Workload(model=lambda: nn.Linear(64, 64), batch=lambda n: torch.randn(n, 64), loss=loss,
                    default_batch_size=8, name="masked")


def test_untraceable_workload_falls_back_to_a_real_run_and_says_so():
    r = estimate(_masked_workload(), batch_size=8)
    assert r.method == "real-fallback"
    assert "nonzero" in r.approximations[0] or "dynamic" in r.approximations[0].lower()
    measured = profile(_masked_workload(), batch_size=8, repeats=0)
    assert abs(measured.error_percent) <= 1.0


def test_untraceable_and_too_big_names_the_op(monkeypatch):
    monkeypatch.setattr(estimate_module, "available_host_bytes", lambda: 1 << 20)
    with pytest.raises(TraceError, match="fake-tensor tracing failed at .*nonzero"):
        estimate(_masked_workload(), batch_size=8)


def test_llama_7b_width_traces_on_fake_tensors():
    """Two Llama-2-7B layers at full width, batch 1, seq 2048: every parameter and AdamW state is
    counted (their number taken independently, from the model built on the meta device)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    with torch.device("meta"):
        n = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(num_hidden_layers=2)).parameters())
    r = estimate("llama:num_hidden_layers=2", Plan(precision="bf16"), batch_size=1, seq_len=2048)
    assert r.method == "fake"
    assert r.breakdown["parameters"] == n * 4
    assert r.breakdown["optimizer_states"] == pytest.approx(2 * n * 4, rel=1e-6)  # + step counters


@pytest.mark.slow
def test_llama_7b_traces_on_fake_tensors():
    """Llama-2-7B sizes, batch 1, seq 2048: parameters are 6.74B fp32 values. The speed target
    (<= 10 s per process) is measured by bench/estimate_speed.py; this only bounds it generously."""
    r = estimate("llama", Plan(precision="bf16"), batch_size=1, seq_len=2048)
    assert r.method == "fake"
    assert r.breakdown["parameters"] == pytest.approx(6.738e9 * 4, rel=1e-3)
    assert r.breakdown["optimizer_states"] == pytest.approx(2 * 6.738e9 * 4, rel=1e-3)
    assert r.trace_seconds < 120


def test_transformers_fake_tensor_adapter_still_applies():
    """NOTE [ Libraries that branch on fake tensors ]: fails loudly if transformers moves the check."""
    import transformers.utils.import_utils as iu
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.memory.adapters import real_code_paths
    with FakeTensorMode():
        t = torch.ones(2)
    assert iu.is_tracing(t) is True
    with real_code_paths():
        assert iu.is_tracing(t) is False
    assert iu.is_tracing(t) is True


@pytest.mark.parametrize("workload", ["lstm", "cnn"])
def test_gpu_presets_trace_rnns_and_convolutions_with_a_consistent_breakdown(workload):
    """Issue 10: lstm/cnn on a GPU preset failed an internal assert (breakdown != peak by 1 KiB,
    from zero-byte storages that the allocator gives no block)."""
    r = estimate(workload, Plan(), batch_size=4, device="h100-80gb")
    assert sum(r.breakdown.values()) == r.peak_bytes
    assert not any("internal check" in a for a in r.approximations)


def test_an_inconsistent_breakdown_is_a_warning_not_a_crash(monkeypatch):
    from memfit.memory import report as report_module
    real_live_at = report_module.live_at

    def lossy_live_at(tracker, device, index):
        live = real_live_at(tracker, device, index)
        live.pop(next(iter(live)))  # lose one storage: the breakdown no longer sums to the peak
        return live
    monkeypatch.setattr(report_module, "live_at", lossy_live_at)
    with pytest.warns(RuntimeWarning, match="internal check"):
        r = estimate("mha", Plan(), batch_size=2, device="h100-80gb")
    assert sum(r.breakdown.values()) == r.peak_bytes
    assert any("internal check" in a for a in r.approximations)


def test_adamw8bit_without_bitsandbytes_is_estimated_as_the_fallback_that_runs(monkeypatch):
    from memfit.techniques import optimizers
    plan = Plan(precision="bf16", optimizer="adamw8bit")
    with_bnb = estimate("gpt2:n_layer=2,n_embd=128,n_head=4", plan, batch_size=2, seq_len=64, device="h100-80gb")
    monkeypatch.setattr(optimizers, "bitsandbytes_available", lambda: False)
    without = estimate("gpt2:n_layer=2,n_embd=128,n_head=4", plan, batch_size=2, seq_len=64, device="h100-80gb")
    adamw = estimate("gpt2:n_layer=2,n_embd=128,n_head=4", Plan(precision="bf16"), batch_size=2, seq_len=64,
                     device="h100-80gb")
    assert without.breakdown["optimizer_states"] == adamw.breakdown["optimizer_states"]
    assert without.breakdown["optimizer_states"] > 3 * with_bnb.breakdown["optimizer_states"]
    assert "bitsandbytes" in without.approximations[0] and "fallback" in without.approximations[0]
    assert not any("bitsandbytes" in a for a in with_bnb.approximations)


def test_planner_leaves_out_adamw8bit_without_bitsandbytes_and_says_why(monkeypatch):
    from memfit.devices import get_device
    from memfit.planner.space import default_space, model_facts
    from memfit.techniques import optimizers
    facts = model_facts(Workload(model=lambda: nn.Linear(8, 8), batch=lambda n: torch.randn(n, 8),
                                 loss=lambda m, b: m(b).sum()))
    assert "adamw8bit" in default_space(facts, get_device("h100-80gb"), 8).values["optimizer"]
    monkeypatch.setattr(optimizers, "bitsandbytes_available", lambda: False)
    with pytest.warns(UserWarning, match="adamw8bit, adamw8bit-paged, adamw-paged left out.*bitsandbytes"):
        space = default_space(facts, get_device("h100-80gb"), 8)
    assert space.values["optimizer"] == [o for o in optimizers.ADAMW_CLASS
                                         if o not in ("adamw8bit", "adamw8bit-paged", "adamw-paged")]
    assert "pip install bitsandbytes" in space.notes[0]


def test_module_conversions_on_fake_tensors():
    """NOTE [ Module conversions on fake tensors ]: ``Linear.to`` fails under fake mode in torch
    (pytorch#148977) and works inside memfit's trace; fails loudly if torch fixes it or moves the swap."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.memory.adapters import real_code_paths
    # (fake mode's dispatch cache, shared by the process: an op answered from it makes a tensor no memo
    # holds, so after other tests' traces ``plain.to`` could swap, and this test failed by its order)
    FakeTensorMode.cache_clear()
    with FakeTensorMode(allow_non_fake_inputs=True):
        plain = torch.nn.Linear(4, 4)
        with pytest.raises(RuntimeError, match="Couldn't swap"):
            plain.to("cpu", dtype=torch.float32)
        with real_code_paths():
            layer = torch.nn.Linear(4, 4)
            weight = layer.weight
            layer.to("cpu", dtype=torch.bfloat16)
    assert layer.weight is weight and weight.dtype == torch.bfloat16


class _TruncInit(nn.Linear):
    """A weight whose initialisation reads its own values: ``trunc_normal_``'s rejection loop asks
    ``.any()`` of each draw (std 1 in [-2, 2])."""

    def reset_parameters(self):
        nn.init.trunc_normal_(self.weight, std=1.0)
        nn.init.zeros_(self.bias)


def test_a_loaded_models_initialisation_is_not_listed_among_the_steps_assumptions():
    """memfit's stand-in for a checkpoint's values is not the user's step (NOTE [ Assumed scalars ]):
    Gemma 3's vision tower listed "a data-dependent .any() assumed False at
    transformers/initialization.py:137 (x163)". An assumption the step itself makes still is."""
    def loss(m, x):
        y = m(x)
        return y.sum() * 2 if bool((y > 0).any()) else y.sum()
    wl = Workload(model=lambda: _TruncInit(64, 64), batch=lambda n: torch.randn(n, 64), loss=loss,
                  default_batch_size=4, name="trunc-init", from_checkpoint=True)
    r = estimate(wl, Plan(), batch_size=4)
    listed = [str(a) for a in r.approximations if "data-dependent" in str(a)]
    assert len(listed) == 1 and "test_estimate.py" in listed[0], listed


def test_a_distributions_argument_check_is_assumed_to_pass_as_all_is():
    """torch.distributions validates its arguments with ``torch._is_all_true`` (BLT's ``Categorical`` over its
    byte logits): a value fake mode cannot know, assumed True as ``.all()`` is (NOTE [ Assumed scalars ]), where
    it was assumed 0, the check failed, and the trace with it. The estimate is the profiler's."""
    def loss(m, x):
        # (validate_args named: Dynamo turns torch.distributions' default off for the process once it compiles)
        dist = torch.distributions.Categorical(logits=m(x), validate_args=True)
        return -dist.log_prob(torch.zeros(len(x), dtype=torch.long)).mean()
    wl = Workload(model=lambda: nn.Linear(64, 64), batch=lambda n: torch.randn(n, 64), loss=loss,
                  default_batch_size=8, name="categorical")
    r = estimate(wl, Plan(), batch_size=8)
    assert r.method == "fake" and any(".all() assumed True" in str(a) for a in r.approximations)
    measured = profile(wl, batch_size=8, repeats=0)
    assert abs(measured.error_percent) <= 1.0
