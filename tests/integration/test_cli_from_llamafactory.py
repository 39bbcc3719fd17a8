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
            "micro_batch_size=2, checkpointing=blocks, max_grad_norm=1.0") in captured.out


def test_a_config_memfit_cannot_carry_is_one_line_exit_2(tmp_path, model, capsys):
    config = tmp_path / "dpo.yaml"
    config.write_text(f"model_name_or_path: {model}\nstage: dpo\ndo_train: true\n")
    assert main(["estimate", "--from", str(config), "--device", "rtx4060"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"memfit estimate: error: --from {config}: stage: dpo: memfit traces supervised fine-tuning") and \
        "\n" not in err
