"""Adapters (memfit.techniques.adapter) and PEFT models built by the workload itself.

The memory claims are checked against the profiler's allocator events (``profile``), the training
claims against a plain PyTorch loop over the same PEFT model.
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_same_run, measured, peft_loop, run_steps
from memfit.errors import UserError
from memfit.memory.estimate import estimate
from memfit.plans import Plan
from memfit.step import build_step
from memfit.workloads import load_workload

pytest.importorskip("peft")

LLAMA = ("llama:num_hidden_layers=2,hidden_size=128,intermediate_size=256,num_attention_heads=4,"
         "num_key_value_heads=4,vocab_size=1000")
GPT2 = "gpt2:n_layer=2,n_embd=128,n_head=4,vocab_size=1000,n_positions=128"
CASES = {
    "lora-llama": (LLAMA, "lora:r=8,alpha=16,dropout=0.05"),
    "lora-gpt2-save": (GPT2, "lora:r=8,targets=c_attn,save=lm_head"),
    "dora-llama": (LLAMA, "dora:r=8,targets=q_proj+v_proj"),
}


# Each case keeps one precision and checkpointing in the default tier (lora-llama both), the rest are slow
# (keeps the default suite under 10 minutes).
DEFAULT_TIER = {("lora-llama", "fp32", "none"), ("lora-llama", "bf16", "blocks"),
                ("lora-gpt2-save", "bf16", "blocks"), ("dora-llama", "bf16", "blocks")}


@pytest.mark.parametrize("precision,checkpointing,case", [
    pytest.param(p, c, case, marks=() if (case, p, c) in DEFAULT_TIER else pytest.mark.slow)
    for p, c in (("fp32", "none"), ("bf16", "blocks"), ("bf16", "none"), ("fp32", "blocks")) for case in sorted(CASES)])
def test_adapter_prediction_within_1pct_of_the_profiler(precision, checkpointing, case):
    spec, adapter = CASES[case]
    if "save" in adapter:  # NOTE [ A profiler crash after modules_to_save ]: its own process, as a user runs it
        error = _profiled_in_a_process(spec, adapter, precision, checkpointing)
    else:
        error = measured(spec, Plan(adapter=adapter, precision=precision, checkpointing=checkpointing),
                         batch_size=2).error_percent
    assert abs(error) <= 1.0, (case, precision, checkpointing, error)


# NOTE [ A profiler crash after modules_to_save ]
# After a fake trace of a PEFT model with modules_to_save (ModulesToSaveWrapper deep-copies the
# saved module), a later CPU profiler session in the same process dies freeing kineto's activity
# buffers (heap corruption: "corrupted double-linked list"). One estimate and one profile per
# process (the CLI) never meet it; the cause is not found yet. Until it is, these cases run as
# `memfit profile` runs them.
def _profiled_in_a_process(spec, adapter, precision, checkpointing) -> float:
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "memfit.cli.main", "profile", spec, "-b", "2", "--seq-len", "64",
                          "--repeats", "1", "--json", "--adapter", adapter, "--precision", precision,
                          "--checkpointing", checkpointing], capture_output=True, text=True, check=True).stdout
    return json.loads(out)["error_percent"]


def _trainable(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def test_frozen_base_weights_get_no_gradients_and_no_optimizer_states():
    step = build_step(load_workload(LLAMA, seq_len=32), Plan(adapter="lora:r=4"), 2, "cpu")
    trainable = _trainable(step.model)
    assert trainable and all("lora_" in n for n in trainable)
    n_trainable = sum(p.numel() for p in trainable.values())
    assert n_trainable == 2 * 2 * 4 * (128 + 128)  # 2 layers x (q_proj, v_proj) x r=4 x (in + out)
    step(step.target.workload.batch(2))
    assert sum(p.numel() for g in step.optimizer.param_groups for p in g["params"]) == n_trainable
    assert all(p.grad is None for n, p in step.model.named_parameters() if n not in trainable)
    report = estimate(LLAMA, Plan(adapter="lora:r=4"), batch_size=2, seq_len=32)
    states = report.breakdown["optimizer_states"]
    assert 8 * n_trainable <= states <= 8 * n_trainable + 64 * len(trainable)  # exp_avg, exp_avg_sq (+ step scalars)


def test_adapter_saves_the_full_models_gradients_and_states():
    full = measured(LLAMA, Plan(), batch_size=2)
    lora = measured(LLAMA, Plan(adapter="lora:r=8"), batch_size=2)
    assert lora.measured.peak_bytes < 0.75 * full.measured.peak_bytes
    assert lora.predicted.breakdown["optimizer_states"] < 0.05 * full.predicted.breakdown["optimizer_states"]


@pytest.mark.parametrize("checkpointing", ["none", "blocks"])
def test_adapter_trains_as_the_users_peft_loop(checkpointing):
    """Same adapter weights as a plain loop over PEFT's model: equal with no technique; block
    checkpointing replays the same ops (dropout from the restored RNG), so equal too."""
    kwargs = dict(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
    plain_losses, plain_params = peft_loop(LLAMA, kwargs)
    losses, params, _ = run_steps(LLAMA, Plan(adapter="lora:r=8,alpha=16,dropout=0.1,targets=q_proj+v_proj",
                                              checkpointing=checkpointing), batch_size=2)
    assert_same_run(losses, params, plain_losses, plain_params)
    assert any(not torch.equal(params[-1][n], params[0][n]) for n in params[0] if "lora_B" in n)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16-base", "fp16-base"])
def test_a_16_bit_base_trains_as_the_users_peft_loop(half):
    """precision bf16-base (fp16-base) is the loop of peft's guides (NOTE [ The adapter users' precision ]):
    the base model loaded in 16 bits, the adapter in fp32, autocast (fp16: the loss scaled). Same losses
    and weights, bit for bit; the adapter, its gradients and its AdamW states in fp32, the frozen weights
    in 16 bits."""
    kwargs = dict(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
    plain_losses, plain_params = peft_loop(LLAMA, kwargs, half=half)
    name = "bf16-base" if half == torch.bfloat16 else "fp16-base"
    plan = Plan(adapter="lora:r=8,alpha=16,dropout=0.1,targets=q_proj+v_proj", precision=name)
    losses, params, step = run_steps(LLAMA, plan, batch_size=2)
    assert_same_run(losses, params, plain_losses, plain_params)
    dtypes = {n: p.dtype for n, p in step.model.named_parameters()}
    assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if "lora_" not in n} == {half}
    states = [t for s in step.optimizer.state.values() for t in s.values() if t.dim()]
    assert states and {t.dtype for t in states} == {torch.float32}
    assert any(not torch.equal(params[-1][n], params[0][n]) for n in params[0] if "lora_B" in n)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_16_bit_base_without_autocast_trains_as_ai_toolkits_loop(half):
    """precision bf16-base-noautocast (fp16-) is the same loop with no autocast and no loss scaling (NOTE
    [ ai-toolkit's LoRA: no autocast ]): same losses and weights, bit for bit, and not those of bf16-base;
    each adapted layer's input reaches the adapter in fp32."""
    kwargs = dict(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
    plain_losses, plain_params = peft_loop(LLAMA, kwargs, half=half, autocast=False)
    name = ("bf16" if half == torch.bfloat16 else "fp16") + "-base-noautocast"
    adapter = "lora:r=8,alpha=16,dropout=0.1,targets=q_proj+v_proj"
    losses, params, step = run_steps(LLAMA, Plan(adapter=adapter, precision=name), batch_size=2)
    assert_same_run(losses, params, plain_losses, plain_params)
    assert losses != run_steps(LLAMA, Plan(adapter=adapter, precision=name[:-len("-noautocast")]), batch_size=2)[0]
    seen = []
    lora_a = next(m for n, m in step.model.named_modules() if n.endswith("q_proj.lora_A.default"))
    lora_a.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    step(step.target.workload.batch(2))
    assert seen == [torch.float32] and step.precision.grad_scaler("cpu").__class__.__name__ == "NoScaler"


def test_a_16_bit_base_without_an_adapter_or_with_fp16_modules_to_train_is_one_line():
    """Nothing to keep in fp32; fp16-base with a module trained beside the adapter (peft leaves it in fp16,
    and a GradScaler cannot unscale fp16 gradients: Trainer(fp16=True) fails on it at its first step)."""
    for plan, needle in ((Plan(precision="bf16-base"), "plan trains no adapter; add one"),
                         (Plan(precision="fp16-base", adapter="lora:r=4,save=lm_head"), "lm_head.modules_to_save")):
        with pytest.raises(UserError, match=needle) as e:
            estimate(LLAMA, plan, batch_size=2, seq_len=32)
        assert "\n" not in str(e.value)
    assert estimate(LLAMA, Plan(precision="bf16-base", adapter="lora:r=4,save=lm_head"), batch_size=2, seq_len=32)


@pytest.mark.parametrize("text,problem", [
    ("lora:r=0", "r must be a whole number >= 1"),
    ("lora:r=8,targets=nope", "match no module"),
    ("lora:r=8,save=nope", "save=nope matches no module"),
    ("lora:rank=8", "option 'rank=8' is not valid"),
    ("lora:r=8,skip=nope", "skip=nope is in no linear layer's name"),
    ("lora:r=8,only=nope", "only=nope is in no linear layer's name"),
    ("lorax", "is not valid"),
    ("lokr:r=8,dropout=0.1", "LoKr has no dropout"),
    ("lokr:r=8,params=experts.gate_up_proj", "LoKr adapts linear layers only"),
    ("lokr:r=8,factor=0", "factor must be -1 or a whole number"),
    ("lokr:r=8,factor=two", "factor=two is not a whole number"),
    ("lokr:r=8,factored=maybe", "factored=maybe is not 0/1"),
    ("lokr:r=8,decompose=1", "option 'decompose=1' is not valid"),
    ("lora:r=8,factor=4", "option 'factor=4' is not valid"),
    ("lokr:r=8,targets=nope", "match no module"),  # (LoKr's: memfit.techniques.lokr)
])
def test_bad_adapters_get_one_line(text, problem):
    with pytest.raises(UserError, match=problem) as e:
        estimate(LLAMA, Plan(adapter=text), batch_size=2, seq_len=32)
    assert "\n" not in str(e.value)


def test_adapter_text_round_trips():
    plan = Plan(adapter="dora:r=16,alpha=32,targets=q_proj+v_proj,dropout=0.05,save=lm_head,skip=layers.1.,only=mlp")
    assert plan.adapter == "dora:r=16,alpha=32,targets=q_proj+v_proj,dropout=0.05,save=lm_head,skip=layers.1.,only=mlp"
    assert Plan.from_dict(plan.to_dict()) == plan
    assert Plan().adapter == "none"


DIT = ("dit-lumina2:num_layers=2,num_refiner_layers=1,hidden_size=64,num_attention_heads=4,num_kv_heads=2,"
       "cap_feat_dim=32,axes_dim_rope=8/4/4,multiple_of=16")
UNET = ("unet-sdxl:block_out_channels=32/64/64,attention_head_dim=2,transformer_layers_per_block=1,"
        "cross_attention_dim=32,addition_time_embed_dim=8,projection_class_embeddings_input_dim=80")


@pytest.mark.parametrize("spec,precision,checkpointing", [
    pytest.param(DIT, "fp32", "none", id="fp32-none-dit-lumina2", marks=pytest.mark.slow),  # (test_diffusion_workloads)
    pytest.param(DIT, "bf16", "blocks", id="bf16-blocks-dit-lumina2"),
    pytest.param(UNET, "fp32", "none", id="fp32-none-unet-sdxl", marks=pytest.mark.slow),
    pytest.param(UNET, "bf16", "blocks", id="bf16-blocks-unet-sdxl", marks=pytest.mark.slow),  # (test_diffusion_workloads)
])
def test_diffusion_lora_predicted_within_1pct(spec, precision, checkpointing):
    """LoRA of a diffusers DiT and UNet (diffusers' attention projections by default)."""
    pytest.importorskip("diffusers")
    from memfit.memory.measure import profile
    r = profile(spec, Plan(adapter="lora:r=8", precision=precision, checkpointing=checkpointing), batch_size=2,
                resolution=128, repeats=0)
    assert abs(r.error_percent) <= 1.0, (spec, precision, checkpointing, r.error_percent)
    step = build_step(load_workload(spec, resolution=128), Plan(adapter="lora:r=8"), 2, "cpu")
    trainable = _trainable(step.model)
    assert trainable and all("lora_" in n and any(f".{t}." in n for t in ("to_q", "to_k", "to_v", "to_out.0"))
                             for n in trainable)


def test_diffusers_add_adapter_in_the_workload(tmp_workload_file):
    """The path diffusers' and kohya-style LoRA scripts take: freeze the model, ``add_adapter``."""
    pytest.importorskip("diffusers")
    from memfit.memory.measure import profile
    body = f'''
from peft import LoraConfig
from memfit.workload import Workload
from memfit.workloads import load_workload

base = load_workload({DIT!r}, resolution=128)

def model():
    m = base.model()
    m.requires_grad_(False)
    m.add_adapter(LoraConfig(r=8, lora_alpha=8, init_lora_weights="gaussian",
                             target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    return m

wl = Workload(model=model, batch=base.batch, loss=lambda m, b: base.loss(m, b))
'''
    spec = f"{tmp_workload_file(body)}:wl"
    r = profile(spec, Plan(), batch_size=2, repeats=0)
    assert abs(r.error_percent) <= 1.0, r.error_percent
    plan_key = estimate(DIT, Plan(adapter="lora:r=8,alpha=8"), batch_size=2, resolution=128)
    assert r.predicted.breakdown["optimizer_states"] == plan_key.breakdown["optimizer_states"]


def _llama4_text(folder) -> str:
    """A tiny Llama 4 text model, whose router subclasses ``nn.Linear`` and returns a pair."""
    import transformers
    transformers.AutoConfig.for_model(
        "llama4_text", hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, num_hidden_layers=2, num_local_experts=4,
        interleave_moe_layer_step=2).save_pretrained(folder)
    return str(folder)


def test_a_text_config_of_a_multimodal_family_takes_its_familys_targets(tmp_path):
    """PEFT names Llama 4's targets under ``llama4``, not ``llama4_text``: its default LoRA adapts q_proj and
    v_proj as PEFT would for the family, where all-linear wrapped the router (a pair out of a Linear)."""
    import peft

    from memfit.techniques.adapter import _default_targets
    workload = load_workload(_llama4_text(tmp_path), seq_len=64)
    with torch.device("meta"):
        assert _default_targets(workload.model(), peft) == ["q_proj", "v_proj"]
    assert estimate(workload, Plan(adapter="lora:r=4"), batch_size=2).peak_bytes > 0  # (all-linear: the error below)


def test_a_failure_in_peft_layers_names_the_targets_to_choose(tmp_path):
    """A failure inside PEFT's layers is not the config's: one line saying which layers to adapt."""
    with pytest.raises(UserError, match=r"failed in PEFT's adapter layers with AttributeError: .*; name the layers "
                                        r"to adapt \(e\.g\. --adapter lora:r=16,targets=q_proj\+v_proj\)"):
        estimate(_llama4_text(tmp_path), Plan(adapter="lora:r=4,targets=all-linear"), batch_size=2, seq_len=64)


def test_a_regular_expression_of_targets_is_passed_whole_and_a_familys_is_not_borrowed(monkeypatch):
    """PEFT maps gemma4 to a regular expression over its multimodal paths: it is the target of that model type (it
    was split into characters), and no target for the family's text-only type (gemma4_text), whose layers the
    expression does not name; a family's names are (llama4_text takes llama4's)."""
    import types

    import peft

    from memfit.techniques.adapter import ALL_LINEAR, _default_targets
    expression = r".*language_model\..*\.(q_proj|v_proj)"
    mapping = dict(peft.utils.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, family=expression, named=["q_proj"])
    monkeypatch.setattr(peft.utils, "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING", mapping)
    model = torch.nn.Linear(2, 2)
    for model_type, targets in [("family", expression), ("family_text", ALL_LINEAR), ("named_text", ["q_proj"])]:
        model.config = types.SimpleNamespace(model_type=model_type)
        assert _default_targets(model, peft) == targets


def _falcon_h1(folder) -> str:
    import transformers
    transformers.AutoConfig.for_model(
        "falcon_h1", hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=512, num_hidden_layers=2, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
        mamba_n_groups=1, mamba_chunk_size=16).save_pretrained(folder)
    return str(folder)


def test_the_default_all_linear_leaves_out_the_layers_peft_refuses(tmp_path):
    """A Mamba mixer's out_proj and conv1d: PEFT raises on them, so the default all-linear (Falcon-H1 has no PEFT
    mapping) leaves them out; naming one is a one-line error, not PEFT's traceback."""
    workload = load_workload(_falcon_h1(tmp_path), seq_len=32)
    step = build_step(workload, Plan(adapter="lora:r=4"), batch_size=2)
    adapted = {n.rsplit(".", 1)[-1] for n, m in step.model.named_modules() if hasattr(m, "lora_A")}
    assert adapted and not adapted & {"out_proj", "conv1d"} and "in_proj" in adapted
    with pytest.raises(UserError, match=r"PEFT refuses it on this model \(.*out_proj.*\); name the layers to adapt"):
        build_step(workload, Plan(adapter="lora:r=4,targets=out_proj"), batch_size=2)


def test_the_default_all_linear_leaves_out_a_router_that_subclasses_linear(tmp_path):
    """PhiMoE's router subclasses ``nn.Linear`` and returns scores and indices; PEFT's all-linear wraps it and its
    layer fails adding the update to a pair. The default leaves it out and adapts the other linear layers."""
    import transformers
    transformers.AutoConfig.for_model(
        "phimoe", hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, num_hidden_layers=2, num_local_experts=4).save_pretrained(tmp_path)
    workload = load_workload(str(tmp_path), seq_len=32)
    step = build_step(workload, Plan(adapter="lora:r=4"), batch_size=2)
    adapted = {n.rsplit(".", 1)[-1] for n, m in step.model.named_modules() if hasattr(m, "lora_A")}
    assert "router" not in adapted and {"q_proj", "o_proj"} <= adapted
    assert estimate(workload, Plan(adapter="lora:r=4"), batch_size=2).peak_bytes > 0


def test_the_report_says_which_layers_the_adapter_took_and_what_it_trains():
    """The default targets are PEFT's for the model's type (Llama: q_proj and v_proj), or every linear
    layer: the report names what they became, counted here from the sizes (r x (in + out) a layer)."""
    hidden, r = 256, 8
    wl = f"llama:num_hidden_layers=2,hidden_size={hidden},intermediate_size=688,num_attention_heads=4,num_key_value_heads=4"
    report = estimate(wl, Plan(adapter=f"lora:r={r}"), batch_size=1, seq_len=16)
    trained = 4 * r * (hidden + hidden)  # (2 layers x q_proj and v_proj, each [hidden, hidden])
    assert f"adapter: 4 layers adapted (self_attn.q_proj x2, self_attn.v_proj x2); {trained:,} parameters trained" in report.facts
    assert not any(f.startswith("adapter:") for f in estimate(wl, Plan(), batch_size=1, seq_len=16).facts)


FLUX = ("dit-flux:num_layers=2,num_single_layers=2,attention_head_dim=16,num_attention_heads=2,"
        "joint_attention_dim=32,pooled_projection_dim=16,in_channels=16,axes_dims_rope=4/6/6")


def test_in_blocks_adapts_the_linear_layers_of_the_repeated_blocks_alone_and_is_predicted_within_1pct():
    """``targets=in-blocks`` (ai-toolkit's ``transformer_only``): FLUX's double and single blocks' linear layers
    (modulations too), none of the embedders, the final norm's modulation or the output layer that
    ``all-linear`` takes beside them; measured as predicted."""
    pytest.importorskip("diffusers")
    from memfit.memory.measure import profile

    def adapted(targets):
        model = build_step(load_workload(FLUX, resolution=64), Plan(adapter=f"lora:r=4,targets={targets}"), 1,
                           "cpu").model
        return {n.rsplit(".lora_A", 1)[0] for n in _trainable(model) if ".lora_A." in n}
    blocks, everything = adapted("in-blocks"), adapted("all-linear")
    assert blocks and all(n.startswith(("transformer_blocks.", "single_transformer_blocks.")) for n in blocks)
    assert {"transformer_blocks.0.norm1.linear", "single_transformer_blocks.1.proj_out"} <= blocks
    outside = everything - blocks
    assert blocks < everything and {"x_embedder", "context_embedder", "norm_out.linear"} <= outside
    assert not any(n.startswith(("transformer_blocks.", "single_transformer_blocks.")) for n in outside)
    r = profile(FLUX, Plan(adapter="lora:r=4,targets=in-blocks", precision="bf16-base-noautocast",
                           checkpointing="blocks"), batch_size=1, resolution=64, repeats=0)
    assert abs(r.error_percent) <= 1.0, r.error_percent


def test_skip_leaves_out_the_layers_whose_names_hold_it_as_ai_toolkits_ignore_if_contains():
    """``skip=`` (ai-toolkit's ``ignore_if_contains``): every linear layer whose name holds one of its strings is left
    out, matched as memfit names it or as diffusers does under ``transformer.`` (ai-toolkit's examples write
    ``transformer.single_transformer_blocks.``); a string in no name but another's is allowed, as there; the
    adapter's weights and the step's peak are what is left, measured as predicted."""
    pytest.importorskip("diffusers")
    from memfit.memory.measure import profile

    def adapted(adapter):
        model = build_step(load_workload(FLUX, resolution=64), Plan(adapter=adapter), 1, "cpu").model
        return {n.rsplit(".lora_A", 1)[0] for n in _trainable(model) if ".lora_A." in n}
    every = adapted("lora:r=4,targets=in-blocks")
    kept = adapted("lora:r=4,targets=in-blocks,skip=transformer.single_transformer_blocks.+ff.net+nowhere")
    assert kept == {n for n in every if not n.startswith("single_transformer_blocks.") and "ff.net" not in n}
    assert kept and {"transformer_blocks.0.attn.to_q", "transformer_blocks.1.ff_context.net.2"} <= kept
    only = adapted("lora:r=4,targets=in-blocks,skip=attn.to_q,only=transformer.single_transformer_blocks.+ff.net")
    assert only == {n for n in every if (n.startswith("single_transformer_blocks.") or "ff.net" in n)
                    and "attn.to_q" not in n}  # (only_if_contains, with ignore_if_contains winning: as ai-toolkit)
    plan = Plan(adapter="lora:r=4,targets=in-blocks,skip=single_transformer_blocks.", precision="bf16-base-noautocast")
    r = profile(FLUX, plan, batch_size=1, resolution=64, repeats=0)
    assert abs(r.error_percent) <= 1.0, r.error_percent
    assert r.peak_bytes < profile(FLUX, plan.replace(adapter="lora:r=4,targets=in-blocks"), batch_size=1,
                                  resolution=64, repeats=0).peak_bytes


def test_in_blocks_on_a_model_without_repeated_blocks_is_one_line(tmp_workload_file):
    body = """
import torch
from memfit.workload import Workload
wl = Workload(model=lambda: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)),
              batch=lambda n: torch.randn(n, 8), loss=lambda m, b: m(b).square().mean())
"""
    with pytest.raises(UserError, match="no repeated blocks") as e:
        estimate(f"{tmp_workload_file(body)}:wl", Plan(adapter="lora:r=4,targets=in-blocks"), batch_size=2, device="cpu")
    assert "\n" not in str(e.value)


def test_a_model_that_cannot_answer_peft_is_one_line(monkeypatch):
    """PEFT asks a model with tied embeddings for its input embeddings; a model that raises NotImplementedError
    there (transformers' PP-FormulaNet) is refused in one line, not an internal error."""
    import transformers

    def unanswered(self):
        raise NotImplementedError(f"`get_input_embeddings` not auto-handled for {type(self).__name__}")
    monkeypatch.setattr(transformers.GPT2LMHeadModel, "get_input_embeddings", unanswered)
    workload = load_workload("gpt2:n_layer=1,n_embd=32,n_head=2,vocab_size=100", seq_len=16)
    with pytest.raises(UserError, match=r"PEFT refuses it on this model \(`get_input_embeddings` not auto-handled"):
        build_step(workload, Plan(adapter="lora:r=4"), batch_size=2)


def test_a_plans_lora_targets_that_match_no_layer_are_said():
    """PEFT adapts the targets it finds and says nothing of the others (Phi-3's q_proj, fused into qkv_proj in
    transformers' model): the estimate says which named targets matched no layer."""
    import memfit
    from memfit.plans import Plan
    spec = ("llama:num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=2,"
            "vocab_size=256")
    facts = memfit.estimate(spec, Plan(adapter="lora:r=4,targets=q_proj+qkv_proj+gate_up_proj"), batch_size=1,
                            seq_len=16).facts
    assert [f for f in facts if "match no layer" in f] == [
        "adapter: targets qkv_proj, gate_up_proj match no layer of this model, and PEFT adapts the others without a "
        "word; name its own layers (`memfit estimate ... --modules 20` lists them)"]
    assert not [f for f in memfit.estimate(spec, Plan(adapter="lora:r=4,targets=q_proj+self_attn.v_proj"), batch_size=1,
                                           seq_len=16).facts if "match no layer" in f]
