"""``memfit estimate --from`` a LLaMA-Factory config: the config's line, its warnings, its errors in one line."""

import json

import pytest

from memfit.cli.main import main

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 512,
              "max_position_embeddings": 512, "torch_dtype": "bfloat16"}


@pytest.fixture
def model(tmp_path):
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return folder


def test_estimate_from_a_llamafactory_qlora_config(tmp_path, model, capsys):
    config = tmp_path / "qlora.yaml"
    config.write_text(f"### model\nmodel_name_or_path: {model}\nquantization_bit: 4\n\n### method\nstage: sft\n"
                      "do_train: true\nfinetuning_type: lora\nlora_rank: 8\nlora_target: all\n\n### dataset\n"
                      "dataset: identity,alpaca_en_demo\ntemplate: llama3\ncutoff_len: 64\n\n### train\n"
                      "per_device_train_batch_size: 2\ngradient_accumulation_steps: 4\nbf16: true\nupcast_layernorm: true\n")
    assert main(["estimate", "--from", str(config), "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert captured.err.strip() == (f"memfit: warning: LLaMA-Factory config {config}: upcast_layernorm is not mapped; "
                                    "the estimate ignores it")
    assert (f"from {config}: {model} · batch 8 (2 a micro-batch x 4 accumulated) · seq 64 · "
            "base_weights=nf4:double_quant=true, adapter=lora:r=8,alpha=16,targets=linear-modules, precision=bf16-base, "
            "micro_batch_size=2, checkpointing=blocks:reentrant=true, max_grad_norm=1.0") in captured.out


def test_a_config_memfit_cannot_carry_is_one_line_exit_2(tmp_path, model, capsys):
    config = tmp_path / "dpo.yaml"
    config.write_text(f"model_name_or_path: {model}\nstage: dpo\ndo_train: true\n")
    assert main(["estimate", "--from", str(config), "--device", "rtx4060"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"memfit estimate: error: --from {config}: stage: dpo: memfit traces supervised fine-tuning") and \
        "\n" not in err


@pytest.mark.slow  # (a search on a GPU preset: 30 s on 2 cores)
def test_plan_from_a_config_writes_llamafactorys_fields_back(tmp_path, model, capsys):
    """``plan --from config.yaml --format llamafactory``: the search kept to what LLaMA-Factory's fields carry, the
    chosen plan as those fields, which ``--from`` reads back as the chosen plan."""
    from memfit.devices import get_device
    from memfit.integrations.llamafactory import map_config
    from memfit.plans import Plan
    config = tmp_path / "lora.yaml"
    config.write_text(f"model_name_or_path: {model}\nstage: sft\ndo_train: true\nfinetuning_type: lora\nlora_target: all\n"
                      "cutoff_len: 256\nper_device_train_batch_size: 4\nbf16: true\n")
    assert main(["plan", "--from", str(config), "--device", "rtx4060", "--format", "llamafactory", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    chosen = Plan(**{k: tuple(v) if isinstance(v, list) else v for k, v in out["chosen"]["plan"].items()})
    assert out["llamafactory_unmapped"] == []
    assert map_config(out["llamafactory_fields"], "exported.yaml", get_device("rtx4060")).plan == chosen


@pytest.mark.parametrize("trainer, name", [("llamafactory", "LLaMA-Factory"), ("axolotl", "axolotl")])
def test_a_diffusion_model_in_a_language_models_trainer_is_one_line(capsys, trainer, name):
    assert main(["plan", "dit", "--device", "rtx4090", "--format", trainer]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"memfit plan: error: --format {trainer}: {name} trains language models, and dit is not one; for a "
                   "diffusion model use --format kohya or ai-toolkit, or leave --format out")
