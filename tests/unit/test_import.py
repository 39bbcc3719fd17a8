"""`import memfit` imports neither torch nor transformers, and never initialises CUDA."""

import subprocess
import sys

import pytest


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_import_is_light():
    """What makes `import memfit` fast is what it does not import (no timing here: see bench/)."""
    out = _run("import sys; import memfit; print('torch' in sys.modules, 'transformers' in sys.modules)")
    assert out.split() == ["False", "False"]


def test_estimate_for_a_gpu_preset_does_not_initialise_cuda():
    out = _run("import memfit, torch; memfit.estimate('mha', batch_size=2, device='h100-80gb'); "
               "print(torch.cuda.is_initialized())")
    assert out.endswith("False")


@pytest.mark.parametrize("fields, module", [
    ("precision='bf16-pure'", "peft"),  # (its check for peft's layers imported peft in the trace: 2 KiB once)
    pytest.param("adapter='lora:r=4'", "peft", marks=pytest.mark.slow),
    ("optimizer='adamw8bit'", "bitsandbytes"),
    pytest.param("optimizer='galore'", "galore_torch", marks=pytest.mark.slow)])
# (slow: further libraries whose import is checked as the first two cases' are; keeps the default suite short)
def test_a_process_first_trace_of_a_plan_is_its_second(fields, module):
    """peft and bitsandbytes make tensors as they load (LoHa's ``torch.tensor(1)`` defaults, the 4-bit
    quantization tables; galore-torch imports bitsandbytes): imported by the first trace of a process,
    they were that trace's allocations, so two workers traced one plan differently and memfit fit's
    architectures shared fewer plans, run to run, and the tables stayed fake tensors in the library for the rest
    of the process (NOTE [ Modules loaded during a trace ])."""
    out = _run("import sys; from memfit.planner.trace_job import Tracer; from memfit.memory.budget import Budget;\n"
               "from memfit.devices import get_device; from memfit.plans import Plan; from memfit.target import Target\n"
               "from memfit.workloads import load_workload; from memfit.planner.space import model_facts\n"
               "from memfit.quiet import silenced_warnings\n"
               "w = load_workload('llama:num_hidden_layers=6,hidden_size=64,intermediate_size=128,num_attention_heads=4,"
               "num_key_value_heads=2,vocab_size=512', seq_len=64); card = get_device('rtx4090')\n"
               "with silenced_warnings():\n"
               "    tracer = Tracer(Target(w, Plan(), 1, card), model_facts(w).model, Budget.of_device(card))\n"
               f"    plan = Plan({fields}); assert '{module}' not in sys.modules\n"
               "    a, b = tracer((plan, 2, 1)), tracer((plan, 2, 1))\n"
               "import torch; from bitsandbytes.backends import utils\n"  # (a table the library computes with later)
               "print(type(utils._NF4_QUANT_TABLE) is torch.Tensor, a.stream.tokens == b.stream.tokens,"
               " a.peak_bytes == b.peak_bytes, len(a.stream.tokens))")
    assert out.split()[-4:-1] == ["True", "True", "True"]
