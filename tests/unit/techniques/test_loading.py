"""Loading as users load (memfit.techniques.loading): built-in, hub and folder models are built on
the meta device and each weight materialised on the device in its final form, cast or quantized
while loading, as transformers' ``from_pretrained`` does; the full-precision model never exists.

Checked: a QLoRA step no longer reserves the full-precision model (it did, 3x its allocated bytes),
the load's own peak is predicted against the profiler (memfit's real run and transformers'
``from_pretrained`` of a saved folder), and a loaded model has the values its library gives it
(initialised before quantizing, rotary tables computed, tied weights tied)."""

import dataclasses
import gc
import json

import pytest
import torch

import memfit
from memfit.memory.estimate import estimate
from memfit.memory.measure import profile
from memfit.memory.profiler_events import allocator_events, memory_profiler
from memfit.quiet import QuietProfiler
from memfit.step import build_step
from memfit.target import Target
from memfit.workloads import load_workload

LLAMA = "llama:num_hidden_layers=2,hidden_size=64,intermediate_size=160,num_attention_heads=4," \
        "num_key_value_heads=2,vocab_size=320"
LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "vocab_size": 320, "max_position_embeddings": 64}


def test_a_qlora_step_no_longer_reserves_the_full_precision_model():
    """Four layers of Llama-2-7B: QLoRA reserved 3.0x its allocated bytes when the fp32 model was built
    on the device and quantized there; loaded as from_pretrained loads it, under 1.1x, and so is the load
    itself. Under bf16 autocast, peft's preparation then casts the bf16 embeddings to fp32 (NOTE [ QLoRA
    loads in 16 bits ]): the freed bf16 copies stay reserved, 1.19x the load's peak here."""
    for precision in ("bf16-pure", "bf16"):
        plan = memfit.Plan(base_weights="nf4", adapter="lora:r=16", checkpointing="blocks", precision=precision)
        r = estimate("llama:num_hidden_layers=4", plan, batch_size=1, seq_len=512, device="rtx4090")
        assert r.reserved_bytes <= 1.10 * r.peak_bytes, (precision, r.reserved_bytes, r.peak_bytes)
        assert r.weights_load_reserved_bytes <= 1.10 * r.weights_load_peak_bytes, precision
        assert r.load_reserved_bytes <= (1.10 if precision == "bf16-pure" else 1.25) * r.load_peak_bytes, precision


@pytest.mark.slow  # (two full traces of a 7B model: a minute on 2 cores)
@pytest.mark.parametrize("precision", ["bf16-pure", None])  # (None: the plan's default, fp32 master weights)
def test_a_7b_qlora_step_reserves_within_5_percent_of_allocated_with_expandable_segments(precision):
    """Issue 49's QLoRA at full size (Llama-2-7B, batch 2 x 2048, r=16, blocks, 8 loss chunks, rtx4090):
    with PyTorch's default segments the step's own fragmentation (bitsandbytes' dequantized weights of
    another size per projection, between the activations) reserves 10-12% over its allocated peak;
    the same trace replayed with expandable segments, within 5% (NOTE [ Reserved bytes with expandable
    segments, from the same trace ]). Under bf16 autocast it is 6.0% (8.29 GiB for 7.82): not asserted."""
    plan = memfit.Plan(base_weights="nf4", adapter="lora:r=16", checkpointing="blocks", loss_chunks=8,
                       **({"precision": precision} if precision else {}))
    r = estimate("llama", plan, batch_size=2, seq_len=2048, device="rtx4090")
    assert r.reserved_bytes > 1.05 * r.peak_bytes
    assert r.peak_bytes < r.expandable_reserved_bytes <= 1.05 * r.peak_bytes


def test_the_load_holds_one_weight_in_full_precision_at_a_time():
    """The load's peak: the quantized model plus, at most, the largest linear in full precision and
    its quantized copy (the moment bitsandbytes quantizes it)."""
    spec = "llama:num_hidden_layers=4"
    target = Target.resolve(spec, memfit.Plan(base_weights="nf4", precision="bf16-pure"), 1, "rtx4090", seq_len=256)
    r = estimate(target.workload, target.plan, batch_size=1, device="rtx4090")
    with torch.device("meta"):
        model = load_workload(spec, seq_len=256).model()
    widest = max(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.lm_head)
    full_bf16 = sum(p.numel() for p in model.parameters()) * 2
    quantized = r.breakdown["parameters"]  # the steady step's parameters: the model as loaded
    assert r.load_peak_bytes <= quantized + widest * 2 * 1.2 + (8 << 20)
    assert r.load_peak_bytes < full_bf16 / 2


def _peak_of(prof) -> int:
    live = peak = 0
    for _, nbytes in allocator_events(prof):
        live += nbytes
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_load_peak_matches_from_pretrained_of_a_saved_folder(tmp_path, dtype):
    """transformers' from_pretrained of a saved folder, measured by the profiler, against memfit's
    prediction of the same folder's load (the checkpoint's dtype is the load dtype, so what is read
    is what the model keeps)."""
    import transformers
    torch_dtype = getattr(torch, dtype)
    config = transformers.LlamaConfig(**{k: v for k, v in LLAMA_CONFIG.items() if k not in ("architectures",)})
    transformers.LlamaForCausalLM(config).to(torch_dtype).save_pretrained(tmp_path)
    gc.collect()
    with QuietProfiler(memory_profiler()) as q:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch_dtype)
    measured = _peak_of(q)
    assert next(model.parameters()).dtype == torch_dtype
    del model
    plan = memfit.Plan(precision="bf16-pure" if dtype == "bfloat16" else "fp32")
    predicted = estimate(str(tmp_path), plan, batch_size=1, seq_len=16).load_peak_bytes
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)


def test_memfit_s_real_load_is_measured_as_predicted():
    """The same load for real on this CPU, its peak from the profiler's allocator events."""
    for plan in (memfit.Plan(precision="bf16-pure"), memfit.Plan(base_weights="nf4", adapter="lora:r=4")):
        result = profile(LLAMA, plan, batch_size=2, seq_len=16, repeats=0)
        assert result.predicted.load_peak_bytes > 0
        assert abs(result.predicted.load_peak_bytes - result.load_peak_bytes) <= 0.01 * result.load_peak_bytes, plan


def test_a_loaded_model_has_its_library_s_values():
    """Initialised as transformers initialises the keys a checkpoint lacks: finite weights with the
    config's std, rotary tables computed, tied weights tied; a 4-bit weight quantized from
    initialised values."""
    import transformers
    torch.manual_seed(0)
    step = build_step(Target.resolve(LLAMA, memfit.Plan(), 2, "cpu", seq_len=16))
    model = step.model
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert abs(model.model.layers[0].mlp.up_proj.weight.std().item() - 0.02) < 0.003
    reference = transformers.LlamaForCausalLM(model.config)
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    loss = step(memfit.step.make_batch(step.target))
    assert loss == loss and loss > 0

    tied = build_step(Target.resolve("gpt2:n_layer=1,n_embd=32,n_head=2,vocab_size=100", memfit.Plan(), 2, "cpu",
                                     seq_len=8)).model
    assert tied.lm_head.weight is tied.transformer.wte.weight

    import bitsandbytes.functional as F
    q = build_step(Target.resolve(LLAMA, memfit.Plan(base_weights="nf4", adapter="lora:r=4"), 2, "cpu", seq_len=16))
    layer = q.model.model.layers[0].mlp.up_proj  # (LoRA targets q_proj and v_proj)
    weight = F.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    assert abs(weight.float().std().item() - 0.02) < 0.004


def test_a_workload_that_builds_on_the_device_is_told_what_its_build_left_reserved(tmp_path):
    """A user's model built in full precision on the device and quantized there keeps that behaviour;
    the estimate says what the build left reserved and how to avoid it."""
    (tmp_path / "wl.py").write_text(
        "import torch, transformers, memfit\n"
        "cfg = transformers.LlamaConfig(num_hidden_layers=2)\n"
        "def wl():\n"
        "    return memfit.Workload(model=lambda: transformers.LlamaForCausalLM(cfg),\n"
        "        batch=lambda n: {'input_ids': torch.zeros(n, 64, dtype=torch.long), 'labels': torch.zeros(n, 64, dtype=torch.long)},\n"
        "        loss=lambda m, b: m(**b).loss)\n")
    built = estimate(f"{tmp_path / 'wl.py'}:wl", memfit.Plan(base_weights="nf4", adapter="lora:r=8"), batch_size=1,
                     device="rtx4090")
    assert any("building the model on the device left" in a for a in built.approximations)
    loaded = estimate("llama:num_hidden_layers=2", memfit.Plan(base_weights="nf4", adapter="lora:r=8"), batch_size=1,
                      seq_len=64, device="rtx4090")
    assert not any("building the model" in a for a in loaded.approximations)
    assert loaded.reserved_bytes < 0.6 * built.reserved_bytes
    json.dumps(loaded.to_json())


def _folder(path, quantization_config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "quantization_config": quantization_config}))
    return str(path)


def test_a_pre_quantized_checkpoint_loads_in_its_own_format(tmp_path):
    """config.json's quantization_config (bitsandbytes) is the base weights' format; another format
    in the plan, a method that would train the full-precision weights, or a format memfit does not
    model (GPTQ) is refused in one line."""
    from memfit.errors import UserError
    bnb = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
           "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16"}
    folder = _folder(tmp_path / "qlora", bnb)
    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    assert load_workload(folder, seq_len=16).info.quantized == "nf4:double_quant=true"
    pre = estimate(folder, memfit.Plan(adapter="lora:r=4"), batch_size=2, seq_len=16)
    same = estimate(str(full), memfit.Plan(adapter="lora:r=4", base_weights="nf4:double_quant=true"), batch_size=2,
                    seq_len=16)
    assert pre.plan["base_weights"] == "nf4:double_quant=true"
    assert abs(pre.peak_bytes - same.peak_bytes) <= 0.001 * same.peak_bytes
    with pytest.raises(UserError, match="pre-quantized checkpoint .*not int8; drop --base-weights"):
        Target.resolve(folder, memfit.Plan(base_weights="int8"), 2, "cpu", seq_len=16)
    # each unmodelled format names the modelled one of its size (an fp8 checkpoint was told nf4)
    for method, q, nearest in (("gptq", {"bits": 4, "group_size": 128}, "nf4"), ("gptq", {"bits": 8}, "int8"),
                               ("fbgemm_fp8", {"activation_scale_ub": 1200.0}, "fp8"), ("awq", {"w_bit": 4}, "nf4")):
        with pytest.raises(UserError, match=f"pre-quantized {method} checkpoint, a format memfit does not model.*"
                                            f"with --base-weights {nearest} instead"):
            load_workload(_folder(tmp_path / f"{method}{nearest}", {"quant_method": method, **q}), seq_len=16)
    assert load_workload(_folder(tmp_path / "int8", {"quant_method": "bitsandbytes", "load_in_8bit": True}),
                         seq_len=16).info.quantized == "int8"


def test_an_mxfp4_checkpoint_is_planned_dequantized_as_transformers_trains_it(tmp_path):
    """gpt-oss stores its weights in MXFP4, which transformers refuses to train; its fine-tuning recipes load it
    with ``Mxfp4Config(dequantize=True)``. It was refused as a format memfit does not model, with nf4 suggested:
    now it is the full-precision model, predicted as the same config without quantization_config, and the
    report says how it was loaded."""
    folder = _folder(tmp_path / "mxfp4", {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]})
    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    wl = load_workload(folder, seq_len=16)
    assert wl.info.quantized is None and "Mxfp4Config(dequantize=True)" in wl.info.loaded
    plan = memfit.Plan(adapter="lora:r=4", precision="bf16-pure")
    mx, same = (estimate(f, plan, batch_size=2, seq_len=16, device="rtx4090") for f in (folder, str(full)))
    assert mx.peak_bytes == same.peak_bytes and mx.plan["base_weights"] == "as-is"
    assert wl.info.loaded in mx.facts and wl.info.loaded not in same.facts


FINE_GRAINED_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                    "weight_block_size": [128, 128]}  # (Qwen3-8B-FP8's)


def test_a_fine_grained_fp8_checkpoint_is_fp8_on_a_card_with_fp8_kernels_and_bf16_on_one_without(tmp_path):
    """NOTE [ FP8 checkpoints by card ]: transformers keeps an FP8 checkpoint's float8 weights where it finds FP8
    kernels (compute capability 8.9: the RTX 4090, H100) and dequantizes them to bf16 as it loads on an earlier card
    (the RTX 3090, A100). It was refused as a format memfit does not model."""
    folder = _folder(tmp_path / "fp8", FINE_GRAINED_FP8)
    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    wl = load_workload(folder, seq_len=16)
    assert wl.info.quantized == "fp8" and "8.9" in wl.info.loaded
    plan = memfit.Plan(adapter="lora:r=4", precision="bf16-pure")
    kw = dict(batch_size=2, seq_len=16)
    on_4090 = estimate(folder, plan, device="rtx4090", **kw)
    fp8_base = estimate(str(full), plan.replace(base_weights="fp8"), device="rtx4090", **kw)
    assert on_4090.plan["base_weights"] == "fp8" and on_4090.peak_bytes == fp8_base.peak_bytes
    on_3090, bf16 = (estimate(f, plan, device="rtx3090", **kw) for f in (folder, str(full)))
    assert on_3090.plan["base_weights"] == "as-is" and on_3090.peak_bytes == bf16.peak_bytes
    assert wl.info.loaded in on_4090.facts and wl.info.loaded in on_3090.facts
    from memfit.errors import UserError
    with pytest.raises(UserError, match="pre-quantized checkpoint .*fp8.*its base_weights is fp8, not nf4"):
        estimate(folder, plan.replace(base_weights="nf4"), device="h100-80gb", **kw)
    # the lora method's base weights are the card's too (memfit plan --methods, memfit fit)
    from memfit.planner.methods import on_checkpoint, parse_methods
    (lora,) = on_checkpoint(parse_methods("lora", "lora:r=4"), wl, "--methods")
    method_plan = memfit.Plan(**lora.keys)
    assert [Target.resolve(folder, method_plan, 2, card, seq_len=16).plan.base_weights
            for card in ("rtx4090", "rtx3090")] == ["fp8", "as-is"]
    # plan --methods on one card: every method where the card loads it in bf16, an adapter over fp8 where not
    methods = parse_methods("full,lora,qlora", "lora:r=4")
    assert on_checkpoint(methods, wl, "--methods", "rtx3090") == methods
    with pytest.raises(UserError, match="only lora trains it .*use --methods lora"):
        on_checkpoint(methods, wl, "--methods", "rtx4090")
    # a trainer's config leaves the format to the checkpoint (it was told kohya's --fp8_base; axolotl refused it)
    from memfit.devices import get_device
    from memfit.integrations.axolotl_export import to_axolotl
    from memfit.integrations.export import to_hf
    from memfit.target import as_exported
    chosen = memfit.Plan(base_weights="fp8", adapter="lora:r=4", precision="bf16-base")
    exported, said = as_exported(chosen, wl, get_device("h100-80gb"))
    assert exported.base_weights == "as-is" and "the checkpoint's own format" in said[0]
    assert not any("fp8" in n for n in to_hf(exported, 2, "h100-80gb").notes)
    assert not to_axolotl(exported, 2, folder, 16, "h100-80gb").unmapped
    assert as_exported(chosen, load_workload(str(full), seq_len=16), get_device("h100-80gb")) == (chosen, [])
    dequantized = _folder(tmp_path / "fp8-dequantized", {**FINE_GRAINED_FP8, "dequantize": True})
    assert load_workload(dequantized, seq_len=16).info.quantized is None


def test_an_fp8_checkpoint_fine_tunes_fully_on_a_card_that_dequantizes_it_and_not_on_one_that_keeps_fp8(tmp_path):
    """``fit`` asks every card full fine-tuning of an FP8 checkpoint too: a card without FP8 kernels loads its
    weights in bf16, which train; a card with them keeps them in float8, frozen, and its cell says so, card first
    (it offered LoRA alone, which hid full fine-tuning on the RTX 3090 and A100). ``plan --methods`` on one card that
    keeps float8 still refuses it up front."""
    from memfit.errors import UserError
    from memfit.planner.methods import on_checkpoint, parse_methods
    folder = _folder(tmp_path / "fp8", FINE_GRAINED_FP8)
    wl = load_workload(folder, seq_len=16)
    methods = on_checkpoint(parse_methods("full,lora", "lora:r=4"), wl, "fit --methods")
    full = memfit.Plan(**methods[0].keys)
    assert methods[0].name == "full" and full.adapter == "none"
    assert Target.resolve(folder, full, 2, "rtx3090", seq_len=16).plan.base_weights == "as-is"
    with pytest.raises(UserError, match=r"^its weights load in float8 on this card .* add --adapter lora:r=16"):
        Target.resolve(folder, full, 2, "rtx4090", seq_len=16)
    with pytest.raises(UserError, match="only lora trains it"):
        on_checkpoint(parse_methods("full,lora", "lora:r=4"), wl, "--methods", "h100-80gb")
    with pytest.raises(UserError, match="only full or lora trains it"):
        on_checkpoint(parse_methods("qlora", "lora:r=4"), wl, "fit --methods")


@pytest.mark.slow  # (45 s here: two cards' searches; the methods' per-card plans are checked above in seconds)
def test_fit_of_an_fp8_checkpoint_trains_a_lora_and_says_how_each_card_loads_it(tmp_path, capsys):
    from memfit.cli.main import main
    folder = _folder(tmp_path / "fp8", FINE_GRAINED_FP8)
    assert main(["fit", folder, "--seq-len", "16", "--devices", "rtx3090,rtx4090"]) == 0
    out = capsys.readouterr().out
    header, rows = out.splitlines()[1], {line.split()[0]: line for line in out.splitlines()[2:] if line[:3] == "rtx"}
    assert " full" in header and " lora" in header and "compute capability 8.9 or later" in out, out
    assert "n/a: its weights load in" in rows["rtx4090"] and rows["rtx3090"].split()[3].startswith("b="), out


def test_a_compressed_tensors_checkpoint_is_planned_dequantized_as_transformers_fine_tunes_it(tmp_path):
    """compressed-tensors' FP8 kernels are inference-only in transformers ("load with `dequantize=True` to
    fine-tune"): the checkpoint is the full-precision model, as MXFP4's (NOTE [ Checkpoints trained dequantized ])."""
    folder = _folder(tmp_path / "ct", {"quant_method": "compressed-tensors", "format": "float-quantized",
                                       "config_groups": {"group_0": {"targets": ["Linear"],
                                                                     "weights": {"num_bits": 8, "type": "float"}}}})
    wl = load_workload(folder, seq_len=16)
    assert wl.info.quantized is None and "CompressedTensorsConfig(dequantize=True)" in wl.info.loaded


@pytest.mark.parametrize("spec", ["dit-lumina2:num_layers=2", "dit-sd3:num_layers=2"])
def test_a_diffusion_qlora_loads_each_weight_in_its_final_form(spec):
    """The built-in diffusers models load as diffusers' ``from_pretrained`` loads them. Built on the
    device in bf16 and quantized there, two full-width blocks of Lumina2 and SD3 at 512 px held the
    bf16 model while loading (0.96 and 0.84 GiB, above the step's own peak of 0.59 and 0.30), and
    the allocator kept it (reserved 2.0x and 3.9x the step's peak on the rtx4090 preset)."""
    plan = memfit.Plan(base_weights="nf4", adapter="lora:r=16", checkpointing="blocks", precision="bf16-pure")
    r = estimate(spec, plan, batch_size=1, resolution=512, device="rtx4090")
    assert not any("building the model" in a for a in r.approximations)
    assert r.load_peak_bytes < r.peak_bytes, (r.load_peak_bytes, r.peak_bytes)
    assert r.load_reserved_bytes <= 1.10 * r.load_peak_bytes


WAN = "dit-wan:num_layers=2,attention_head_dim=16,num_attention_heads=2,ffn_dim=64,text_dim=32,freq_dim=32,frames=5"
SD3 = ("dit-sd3:num_layers=2,num_attention_heads=2,attention_head_dim=16,joint_attention_dim=32,caption_projection_dim=32,"
       "pooled_projection_dim=16,pos_embed_max_size=96")


def test_a_buffer_made_in_fp32_arrives_in_bf16_with_its_librarys_values():
    """SD3's sin-cos position table is made in fp32 by its ``__init__`` (a persistent buffer: the checkpoint
    holds it); loaded with ``dtype=torch.bfloat16`` it reaches the device in bf16, never in fp32 to be
    cast there: on the rtx4090 preset the load holds less than the table alone in fp32 (96 x 96 positions
    x 32 wide: 1.18 MB). Its values are those diffusers' build computes (NOTE [ Buffers of a meta build ]),
    not a stand-in fill, as are Wan's rotary tables (non-persistent). On this CPU the host is the device,
    so the replay's fp32 table counts there, and memfit's real load is measured by the profiler as predicted."""
    import diffusers
    plan = memfit.Plan(precision="bf16-pure")
    assert estimate(SD3, plan, batch_size=1, resolution=128, device="rtx4090").load_peak_bytes < 96 * 96 * 32 * 4
    result = profile(SD3, plan, batch_size=1, resolution=128, repeats=0)
    assert abs(result.predicted.load_peak_bytes - result.load_peak_bytes) <= 0.01 * result.load_peak_bytes
    model = build_step(Target.resolve(SD3, plan, 1, "cpu", resolution=128)).model
    table = model.pos_embed.pos_embed
    assert table.dtype == torch.bfloat16
    assert torch.equal(table, diffusers.SD3Transformer2DModel(**model.config).pos_embed.pos_embed.to(torch.bfloat16))
    wan = build_step(Target.resolve(WAN, memfit.Plan(), 1, "cpu", resolution=64)).model
    built = dict(diffusers.WanTransformer3DModel(**wan.config).named_buffers())
    assert all(torch.equal(b, built[name]) for name, b in wan.named_buffers())


def test_a_buffer_the_librarys_init_fills_keeps_the_inits_values(tmp_path):
    """Gemma 4's vision tower makes ``std_scale`` and ``std_bias`` with ``torch.empty`` and fills them in
    ``_init_weights`` (ones and zeros): the build's replay must not copy uninitialised memory over them
    (it did, after the init, with the first replay of buffers)."""
    pytest.importorskip("transformers", minversion="5.5")
    import transformers
    if not hasattr(transformers, "Gemma4VisionModel"):
        pytest.skip("transformers without Gemma 4")
    (tmp_path / "g.py").write_text(
        "import torch, transformers, memfit\n"
        "cfg = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,\n"
        "    num_attention_heads=2, num_key_value_heads=2, head_dim=16, standardize=True)\n"
        "def wl():\n"
        "    return memfit.Workload(model=lambda: transformers.Gemma4VisionModel(cfg), batch=lambda n: torch.zeros(n),\n"
        "                           loss=lambda m, b: b.sum(), from_checkpoint=True)\n")
    for plan in (memfit.Plan(), memfit.Plan(precision="bf16-pure")):
        buffers = dict(build_step(Target.resolve(f"{tmp_path / 'g.py'}:wl", plan, 1, "cpu")).model.named_buffers())
        assert torch.equal(buffers["std_scale"], torch.ones_like(buffers["std_scale"])), buffers["std_scale"][:4]
        assert torch.equal(buffers["std_bias"], torch.zeros_like(buffers["std_bias"]))


@pytest.mark.parametrize("precision", ["bf16-pure", "bf16-base"])
def test_a_bf16_model_keeps_the_dtypes_from_pretrained_gives_it(tmp_path, precision):
    """bf16-pure and bf16-base of a saved folder hold every parameter and buffer in the dtype
    ``from_pretrained(dtype=torch.bfloat16)`` gives it: the weights in bf16, the rotary ``inv_freq`` that
    Llama makes in fp32 on purpose in fp32 (a bf16 one rounds its frequencies to 8 bits: positions past a
    few hundred turn by the wrong angle), with its values. A model a workload builds itself is converted
    whole, as ``model.to(torch.bfloat16)`` does."""
    import transformers
    config = transformers.LlamaConfig(**{k: v for k, v in LLAMA_CONFIG.items() if k not in ("architectures",)})
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    adapter = {"adapter": "lora:r=4"} if precision == "bf16-base" else {}
    ours = build_step(Target.resolve(str(tmp_path), memfit.Plan(precision=precision, **adapter), 1, "cpu",
                                     seq_len=16)).model
    buffers = dict(theirs.named_buffers())
    assert buffers and {n: b.dtype for n, b in ours.named_buffers()} == {n: b.dtype for n, b in buffers.items()}
    assert buffers["model.rotary_emb.inv_freq"].dtype == torch.float32
    assert torch.equal(ours.get_buffer("model.rotary_emb.inv_freq"), buffers["model.rotary_emb.inv_freq"])
    assert {p.dtype for n, p in ours.named_parameters() if "lora_" not in n} == {torch.bfloat16}
    built = build_step(Target.resolve("cnn", memfit.Plan(precision="bf16-pure"), 2, "cpu")).model
    assert any(b.is_floating_point() for b in built.buffers())  # (BatchNorm's running statistics)
    assert {t.dtype for t in [*built.parameters(), *built.buffers()] if t.is_floating_point()} == {torch.bfloat16}


@pytest.mark.parametrize("arch,precision", [("t5", "fp16-base"), ("glm4_moe", "bf16-pure"), ("glm4_moe", "bf16-base")])
def test_what_the_models_class_keeps_in_fp32_arrives_in_fp32(tmp_path, arch, precision):
    """A 16-bit load keeps in fp32 what the model's class names (transformers' ``_keep_in_fp32_modules``:
    T5's feed-forward output ``wo`` in fp16; ``_keep_in_fp32_modules_strict``: GLM-4.5's router bias in bf16
    and fp16), and so does memfit's 16-bit precision of a saved folder: every parameter and buffer in the
    dtype ``from_pretrained(dtype=...)`` gives it. A model a workload builds itself is converted whole."""
    import transformers
    dtype = torch.float16 if precision.startswith("fp16") else torch.bfloat16
    if arch == "t5":
        config = transformers.T5Config(vocab_size=128, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                                       decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        auto, kept = transformers.AutoModelForSeq2SeqLM, "encoder.block.0.layer.1.DenseReluDense.wo.weight"
    else:
        config = transformers.Glm4MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, head_dim=16,
                                            moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                                            num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                                            first_k_dense_replace=1, n_shared_experts=1)
        auto, kept = transformers.AutoModelForCausalLM, "model.layers.1.mlp.gate.e_score_correction_bias"
    auto.from_config(config).to(dtype).save_pretrained(tmp_path)
    theirs = auto.from_pretrained(str(tmp_path), dtype=dtype)
    adapter = {"adapter": "lora:r=4"} if precision.endswith("-base") else {}
    ours = build_step(Target.resolve(str(tmp_path), memfit.Plan(precision=precision, **adapter), 1, "cpu",
                                     seq_len=16)).model
    expected = {n: t.dtype for n, t in [*theirs.named_parameters(), *theirs.named_buffers()]}
    assert expected[kept] == torch.float32
    got = {n.removeprefix("base_model.model.").replace(".base_layer", ""): t.dtype
           for n, t in [*ours.named_parameters(), *ours.named_buffers()] if "lora_" not in n}
    assert got == expected
    if arch == "t5":  # (the built-in loads as a checkpoint, as from_pretrained does; a user's own build does not)
        from memfit.workloads import load_workload
        wl = load_workload("t5:d_model=32,d_kv=16,d_ff=64,num_layers=2,num_heads=2,vocab_size=128", seq_len=16)
        assert wl.from_checkpoint
        for workload, kept_dtype in ((wl, torch.float32), (dataclasses.replace(wl, from_checkpoint=False), dtype)):
            built = build_step(Target.resolve(workload, memfit.Plan(precision=precision, **adapter), 1, "cpu")).model
            assert [p.dtype for n, p in built.named_parameters() if n.endswith(kept)] == [kept_dtype]
