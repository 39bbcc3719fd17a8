"""Wan 2.2 A14B's two experts as ai-toolkit trains them (memfit.workloads.wan_experts): which expert each batch
trains, low_vram's host copies (bit-exact training, the device's bytes), and the prediction against the profiler."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_same_training, run_steps
from memfit.errors import UserError
from memfit.memory.estimate import estimate
from memfit.memory.measure import profile
from memfit.plans import Plan
from memfit.workloads import load_workload

pytest.importorskip("diffusers")
pytest.importorskip("peft")

WAN = "dit-wan:num_layers=2,attention_head_dim=16,num_attention_heads=2,ffn_dim=64,text_dim=32,freq_dim=32,frames=5"
LORA = Plan(adapter="lora:r=4")


def _changed(spec: str, plan: Plan, batch_size: int = 2) -> list[set[str]]:
    """The experts whose parameters changed in steps 2 and 3 of a run, each against the step before."""
    _, params, _ = run_steps(load_workload(spec, resolution=64), plan, steps=3, batch_size=batch_size, seq_len=None)
    return [{n.split("transformer_")[1][0] for n in after if "transformer_" in n and not torch.equal(after[n], before[n])}
            for before, after in zip(params, params[1:])]


@pytest.mark.parametrize("switch, micro, expected", [
    ("batch", None, [{"2"}, {"1"}]),         # one batch a step: the experts take turns
    ("step", 1, [{"2"}, {"1"}]),             # two micro-batches a step, a switch where each step begins
    ("batch", 1, [{"1", "2"}, {"1", "2"}]),  # ai-toolkit's switch between the micro-batches of a step: both train
    ("none", None, [{"1"}, {"1"}]),          # the low-noise expert carried, never run
])
def test_each_batch_trains_the_expert_the_switch_says(switch, micro, expected):
    plan = LORA.replace(micro_batch_size=micro) if micro else LORA
    assert _changed(f"{WAN},experts=2,switch={switch}", plan) == expected


@pytest.mark.parametrize("fields", [{}, {"checkpointing": "blocks", "precision": "bf16-pure"}, {"base_weights": "nf4"}])
def test_low_vram_trains_bit_exactly_as_both_experts_on_the_device(fields):
    wl = load_workload(f"{WAN},experts=2", resolution=64)
    low = load_workload(f"{WAN},experts=2,low_vram=true", resolution=64)
    plan = LORA.replace(**fields)
    assert_same_training(run_steps(wl, plan, steps=3, batch_size=2, seq_len=None),
                         run_steps(low, plan, steps=3, batch_size=2, seq_len=None))


@pytest.mark.parametrize("options, fields", [("experts=2", {}),  # (low_vram alone: slow; its nf4 case stays)
                                             pytest.param("experts=2,low_vram=true", {}, marks=pytest.mark.slow),
                                             ("experts=2,switch=step", {}),
                                             ("experts=2,low_vram=true", {"base_weights": "nf4"})])
def test_two_experts_predicted_within_1pct_of_the_profiler(options, fields):
    """On a CPU the host is the device: the profiler's peak is device and host bytes together."""
    r = profile(f"{WAN},{options}", LORA.replace(**fields), batch_size=2, resolution=64, repeats=0)
    assert r.predicted.method == "fake"
    assert (r.predicted.host_peak_bytes > 0) == ("low_vram" in options)
    assert abs(r.error_percent) <= 1.0, (options, r.predicted.process_peak_bytes, r.peak_bytes)


def _expert_bytes(plan: Plan) -> tuple[int, int, int]:
    """(one expert's frozen weight bytes, the same in the caching allocator's 512-byte blocks, both experts'
    adapter weights in those blocks), counted on the model the step builds."""
    from memfit.step import build_step
    step = build_step(load_workload(f"{WAN},experts=2", resolution=64), plan, 1, "cpu")
    one = step.model.base_model.model.transformer_2 if hasattr(step.model, "base_model") else step.model.transformer_2
    frozen = [p.numel() * p.element_size() for p in one.parameters() if not p.requires_grad]
    adapters = [p.numel() * p.element_size() for p in step.model.parameters() if p.requires_grad]
    return sum(frozen), _in_blocks(frozen), _in_blocks(adapters)


def _in_blocks(sizes: list[int]) -> int:
    return sum(-(-b // 512) * 512 for b in sizes)


def test_low_vram_keeps_one_experts_frozen_weights_on_the_host_and_both_states_on_the_device():
    """On a GPU preset, counted from the model built without low_vram: the device's parameters fall by exactly
    one expert's frozen weights, both experts' optimizer states stay (twice one expert's: the steady state,
    from the third step), and the host holds both experts' frozen weights at a switch (as ai-toolkit's: the running
    one is moved out before the other is moved in)."""
    plan = LORA.replace(precision="bf16-pure")
    both = estimate(f"{WAN},experts=2", plan, batch_size=1, resolution=64, device="rtx4090")
    low = estimate(f"{WAN},experts=2,low_vram=true", plan, batch_size=1, resolution=64, device="rtx4090")
    frozen, in_blocks, adapters = _expert_bytes(plan)
    assert low.host_peak_bytes == 2 * frozen and both.host_peak_bytes == 0
    assert both.breakdown["parameters"] - low.breakdown["parameters"] == in_blocks
    one = estimate(WAN, plan, batch_size=1, resolution=64, device="rtx4090")  # (musubi-tuner's: one expert a run)
    assert low.breakdown["optimizer_states"] == both.breakdown["optimizer_states"] == 2 * one.breakdown["optimizer_states"]
    assert one.breakdown["optimizer_states"] >= adapters  # (two moments of each adapter weight, and its step count)


@pytest.mark.parametrize("spec, problem", [
    (f"{WAN},experts=3", "experts=3"),
    (f"{WAN},experts=2,switch=often", "switch=often is not one of batch, step, none"),
    (f"{WAN},low_vram=true", "add experts=2"),
    ("dit-wan-5b:experts=2", "TI2V 5B is one model"),
])
def test_bad_expert_options_get_one_line(spec, problem):
    with pytest.raises(UserError, match=problem):
        load_workload(spec, resolution=64)


def test_low_vram_with_every_weight_trained_gets_one_line():
    with pytest.raises(UserError, match="train an adapter"):
        estimate(f"{WAN},experts=2,low_vram=true", Plan(), batch_size=1, resolution=64, device="rtx4090")


@pytest.mark.parametrize("options", ["experts=2", "experts=2,low_vram=true"])
def test_a_checkpoint_resumes_with_the_expert_that_ran_last(options):
    """Three steps, a checkpoint's state saved and loaded into a new step, two more: the losses of five steps in one
    run (after an odd number of steps the expert that runs next is the second)."""
    import io

    from memfit.step import build_step
    from memfit.training.checkpoint import load_step_state, step_state
    wl = load_workload(f"{WAN},{options}", resolution=64)

    def run(step, steps):
        out = []
        for i in range(steps):
            torch.manual_seed(100 + i)
            out.append(step(batch))
        return out
    torch.manual_seed(0)
    whole = build_step(wl, LORA, 2, "cpu")
    torch.manual_seed(1)
    batch = wl.batch(2)
    torch.manual_seed(0)
    first = build_step(wl, LORA, 2, "cpu")
    expected, before = run(whole, 5), run(first, 3)
    saved = io.BytesIO()
    torch.save(step_state(first), saved)
    saved.seek(0)
    torch.manual_seed(0)
    second = build_step(wl, LORA, 2, "cpu")
    load_step_state(second, torch.load(saved, weights_only=True))
    assert before + run(second, 2) == expected


WAN_CONFIG = {"_class_name": "WanTransformer3DModel", "attention_head_dim": 16, "num_attention_heads": 2, "num_layers": 2,
              "ffn_dim": 64, "text_dim": 32, "freq_dim": 32, "patch_size": [1, 2, 2]}


def _wan_pipeline(root, second: dict | None) -> str:
    """A Wan pipeline folder as users download it: Wan 2.2 A14B's names transformer_2 too (``second``: its config)."""
    import json
    index = {"_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"]}
    if second is not None:
        index.update(transformer_2=["diffusers", "WanTransformer3DModel"], boundary_ratio=0.875)
    (root / "transformer").mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps(index))
    (root / "transformer" / "config.json").write_text(json.dumps(WAN_CONFIG))
    if second is not None:
        (root / "transformer_2").mkdir()
        (root / "transformer_2" / "config.json").write_text(json.dumps(second))
    return str(root)


def test_a_wan22_pipeline_folder_takes_experts_as_the_built_in_and_predicts_the_same_bytes(tmp_path):
    """NOTE [ A Wan 2.2 pipeline's two experts ]: a folder's ``experts=2,low_vram=true`` is the built-in's two
    experts (they were refused as config fields before), to the byte, device and host."""
    folder = _wan_pipeline(tmp_path / "wan22", WAN_CONFIG)
    options = "frames=5,experts=2,low_vram=true"
    assert hasattr(load_workload(f"{folder}:num_layers=1,{options}", resolution=64).model(), "transformer_2")  # (both overridden)
    wl = load_workload(f"{folder}:{options}", resolution=64)
    assert wl.name.endswith("2 experts low_vram") and hasattr(wl.model(), "transformer_2")
    ours = estimate(f"{folder}:{options}", LORA, batch_size=2, resolution=64)
    built_in = estimate(f"{WAN},{options}", LORA, batch_size=2, resolution=64)
    assert (ours.peak_bytes, ours.host_peak_bytes) == (built_in.peak_bytes, built_in.host_peak_bytes) != (0, 0)
    # (so within 1% of the profiler as the built-in is: test_two_experts_predicted_within_1pct_of_the_profiler)


def test_experts_on_a_pipeline_with_one_denoiser_or_unequal_experts_get_one_line(tmp_path):
    with pytest.raises(UserError, match="this one has one denoiser: drop experts=2"):
        load_workload(f"{_wan_pipeline(tmp_path / 'wan21', None)}:experts=2", resolution=64)
    with pytest.raises(UserError, match="its two experts differ in num_layers"):
        load_workload(f"{_wan_pipeline(tmp_path / 'odd', {**WAN_CONFIG, 'num_layers': 3})}:experts=2", resolution=64)


def test_ai_toolkits_wan22_arch_on_a_local_folder_trains_both_experts(tmp_path):
    """ai-toolkit's ``arch: wan22_14b`` with ``name_or_path`` a local pipeline folder: both experts, as for its
    published ids (before, the folder was read as one expert)."""
    from memfit.devices import get_device
    from memfit.integrations.ai_toolkit import map_config
    folder = _wan_pipeline(tmp_path / "wan22", WAN_CONFIG)
    config = {"job": "extension", "config": {"name": "w", "process": [{
        "type": "sd_trainer", "network": {"type": "lora", "linear": 4, "linear_alpha": 4},
        "datasets": [{"folder_path": "/data", "resolution": [256], "num_frames": 5}],
        "train": {"batch_size": 1, "steps": 10, "dtype": "bf16", "optimizer": "adamw8bit", "switch_boundary_every": 10},
        "model": {"name_or_path": folder, "arch": "wan22_14b", "low_vram": True, "quantize": False}}]}}
    read = map_config(config, "wan22.yaml", get_device("rtx4090"))
    assert "experts=2" in read.workload and "low_vram=true" in read.workload.lower()
    wl = load_workload(read.workload, resolution=64)
    assert hasattr(wl.model(), "transformer_2")
