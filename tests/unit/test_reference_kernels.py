"""NOTE [ Kernel libraries missing here ]: a model whose transformers code runs a GPU kernel library where it
is installed, and its PyTorch reference here, is predicted as the reference, and the report says so,
naming the function and the library; a library installed here is not listed, and listing changes no byte."""

import importlib.util

import torch
from torch import nn
from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

from memfit.memory.estimate import estimate
from memfit.memory.reference_kernels import FELL_BACK
from memfit.plans import Plan
from memfit.workload import Workload


@use_kernel_func_from_hub_with_fallback("memfit_toy_scan", "memfit_no_such_kernels")
def toy_scan(x):
    return torch.cumsum(x, dim=-1)


@use_kernel_func_from_hub_with_fallback("relu", "torch.nn.functional")  # (a package that imports: its kernel runs)
def toy_relu(x):
    return x.clamp(min=0)


class _Scanned(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64)

    def forward(self, x):
        return toy_relu(toy_scan(self.proj(x)))


def _workload() -> Workload:
    return Workload(model=_Scanned, batch=lambda n: torch.randn(n, 64), loss=lambda m, b: m(b).square().mean(),
                    default_batch_size=8, name="scanned")


def _fell_back(report) -> list[str]:
    return [str(a) for a in report.approximations if FELL_BACK in str(a)]


def test_a_function_that_falls_back_here_is_listed_with_its_library_and_changes_no_byte():
    report = estimate(_workload(), Plan(), batch_size=8, device="rtx4090")
    listed = _fell_back(report)
    assert len(listed) == 1 and listed[0].endswith("at memfit_toy_scan (memfit_no_such_kernels) (x2)"), listed
    assert toy_scan.__name__ == "toy_scan" and "_fn" not in toy_scan.__code__.co_varnames  # (put back after)

    def plain(m, b):
        return torch.relu(torch.cumsum(m.proj(b), dim=-1)).square().mean()
    twin = estimate(Workload(model=_Scanned, batch=lambda n: torch.randn(n, 64), loss=plain, default_batch_size=8,
                             name="twin"), Plan(), batch_size=8, device="rtx4090")
    assert report.peak_bytes == twin.peak_bytes and report.reserved_bytes == twin.reserved_bytes


def test_qwen3_next_names_its_gated_delta_rule_where_flash_linear_attention_is_missing(tmp_path):
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                             linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
                             linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                             layer_types=["linear_attention", "full_attention"])
    config.save_pretrained(tmp_path)
    listed = _fell_back(estimate(str(tmp_path), Plan(), batch_size=1, seq_len=32, device="rtx4090"))
    fla_here = importlib.util.find_spec("fla") is not None
    assert any("at chunk_gated_delta_rule (flash-linear-attention)" in a for a in listed) != fla_here, listed
    assert any("at causal_conv1d_fn (causal-conv1d)" in a for a in listed) != \
        (importlib.util.find_spec("causal_conv1d") is not None), listed


def test_a_plan_says_which_kernel_libraries_its_figures_lack_and_a_plain_models_says_none():
    """``memfit plan`` reads them from the model's modules (no trace needed): every plan it lists is of the
    reference."""
    from memfit.memory.reference_kernels import missing_libraries_note
    from memfit.planner.search import plan

    (note,) = missing_libraries_note(_Scanned())
    assert note.startswith("the model's transformers code runs memfit_no_such_kernels where installed"), note
    assert missing_libraries_note(nn.Sequential(nn.Linear(4, 4))) == []
    result = plan(_workload(), device="cpu", batch_size=8, optimizers=("adamw",), max_traces=4)
    assert result.approximations == [note] and result.to_json()["approximations"] == [note]
