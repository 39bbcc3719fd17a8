"""``max`` as a value, ``--from config.yml`` and ``memfit fit`` on the command line: the answers, and
each bad input as one line with exit status 2."""

import json
from pathlib import Path

import pytest

from memfit.cli.main import main

pytestmark = pytest.mark.integration

GPT2 = "gpt2:n_layer=2,n_embd=64,n_head=2,vocab_size=256,n_positions=256"
LLAMA6 = ("llama:num_hidden_layers=6,hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=2,"
          "vocab_size=512")
DATA = Path(__file__).resolve().parents[1] / "data" / "axolotl"


def _one_line_error(capsys, *words) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, err
    return err


def test_estimate_batch_max_json(capsys):
    assert main(["estimate", GPT2, "--seq-len", "32", "-b", "max", "--budget", "40MiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    found = out["largest"]
    assert out["batch_size"] == found["value"] and found["next_value"] == found["value"] + 1
    assert found["used_bytes"] <= 40 * 2**20 < found["next_used_bytes"] and found["traces"] <= 6


def test_estimate_seq_max_stops_at_the_models_positions(capsys):
    assert main(["estimate", GPT2, "-b", "1", "--seq-len", "max", "--budget", "4GiB"]) == 0
    out = capsys.readouterr().out
    assert "largest sequence length that fits 4.00 GiB: 256," in out
    assert "sequence length 320 is beyond the model" in out and "n_positions=256" in out


def test_estimate_max_where_nothing_fits_exits_2(capsys):
    assert main(["estimate", GPT2, "--seq-len", "32", "-b", "max", "--budget", "1MiB"]) == 2
    _one_line_error(capsys, "not even batch size 1 fits the budget of 1.00 MiB", "it needs")


@pytest.mark.parametrize("argv, words", [
    (["estimate", GPT2, "-b", "max", "--seq-len", "max"], ["--batch-size and --seq-len are both max"]),
    (["profile", GPT2, "-b", "max"], ["--batch-size max is for memfit estimate and memfit plan"]),
    (["estimate", GPT2, "-b", "2", "--budget", "1GiB"], ["--budget is for a size given as max"]),
    (["estimate", GPT2, "--resolution", "max"], ["--resolution max applies to the image- and video-generation built-ins (dit-lumina2"]),
    (["estimate", GPT2, "-b", "max", "--micro-batch-size", "2"], ["one step holds at once"]),
    (["plan", GPT2, "-b", "max", "--methods", "full,lora"], ["max plans one method on one device"]),
    (["estimate", GPT2, "--from", str(DATA / "lora-llama.yml")], ["give a workload or --from", "not both"]),
    (["estimate", "--from", str(DATA / "deepspeed.yml")], ["deepspeed: memfit does not model DeepSpeed"]),
    (["estimate"], ["name a workload", "--from config.yml"]),
    (["fit", GPT2, "--devices", "rtx4060,rtx9999"], ["unknown device 'rtx9999'", "rtx4060, rtx3070"]),
    (["fit", GPT2, "--budget", "2GiB"], ["give a share of each card"]),
    (["fit"], ["name a workload", "--from config.yml"]),
])
def test_bad_input_is_one_line(capsys, argv, words):
    assert main(argv) == 2
    _one_line_error(capsys, *words)


@pytest.mark.slow  # (minutes on 2 cores: keeps the default suite under 10 minutes)
def test_plan_batch_max_on_a_gpu_preset(capsys):
    assert main(["plan", LLAMA6, "--seq-len", "64", "-b", "max", "--device", "rtx4060", "--budget", "600MiB",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    largest, best = out["largest"], out["best"]
    assert largest["used_bytes"] <= 600 * 2**20 < largest["next_used_bytes"]
    assert 1 <= out["best_value"] <= largest["value"] and best["chosen"]["used_bytes"] <= 600 * 2**20
    assert out["throughput"] > 0 and out["throughput_unit"] == "tokens/s"
    assert any(s["value"] == largest["value"] for s in out["searched"])


def _tiny_llama_folder(tmp_path) -> Path:
    d = tmp_path / "tiny-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 512,
        "max_position_embeddings": 512}))
    return d


@pytest.mark.slow  # (keeps the default suite under 10 minutes on 2 cores)
def test_estimate_from_an_axolotl_config(tmp_path, capsys):
    config = tmp_path / "lora.yml"
    config.write_text(f"base_model: {_tiny_llama_folder(tmp_path)}\nadapter: lora\nlora_r: 4\nlora_target_linear: true\n"
                      "sequence_len: 64\nmicro_batch_size: 2\ngradient_accumulation_steps: 2\nbf16: true\n"
                      "gradient_checkpointing: true\nneftune_noise_alpha: 5\nlearning_rate: 0.0002\n")
    assert main(["estimate", "--from", str(config), "--device", "rtx4060"]) == 0
    captured = capsys.readouterr()
    assert captured.err.strip() == (f"memfit: warning: axolotl config {config}: neftune_noise_alpha is not mapped; the "
                                    "estimate ignores it")
    assert (f"from {config}: {tmp_path / 'tiny-llama'} · batch 4 (2 a micro-batch x 2 accumulated) · seq 64 · "
            "adapter=lora:r=4,targets=linear-modules, precision=bf16-base, micro_batch_size=2, checkpointing=blocks"
            ) in captured.out
    assert main(["estimate", "--from", str(config), "--device", "rtx4060", "-b", "max", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["micro_batch_size"] is None and out["batch_size"] == out["largest"]["value"] > 4


@pytest.mark.slow  # (minutes on 2 cores: keeps the default suite under 10 minutes)
def test_fit_table_json_markdown_png(tmp_path, capsys):
    png = tmp_path / "fit.png"
    argv = ["fit", LLAMA6, "--seq-len", "64", "--devices", "rtx4060,rtx3070", "--methods", "full,lora",
            "--budget", "4.5%"]
    assert main([*argv, "--json", "--png", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cells = {(c["card"], c["method"]): c for c in out["cells"]}
    assert set(cells) == {(d, m) for d in ("rtx4060", "rtx3070") for m in ("full", "lora")}
    assert all(c["fits_one_card"] and c["batch"] >= 1 and c["throughput"] > 0 for c in cells.values())
    assert out["architectures"] == 2 and out["traces"] > 0
    assert main([*argv, "--markdown"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("`memfit fit` llama · seq 64 · 2 cards (2 architectures) · ")
    assert lines[2] == "| card | memory | full | lora |" and lines[4].startswith("| rtx4060 | 7.88 GiB | b=")
    assert lines[7].startswith("b: the largest batch that fits")
