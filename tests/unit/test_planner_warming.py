"""What the GPU-preset planner traces ahead: for optimizers that compile a graph per weight dtype
(torchao's), the weight dtypes the walk will meet."""

from types import SimpleNamespace

from memfit.planner.gpu_time import GpuStepModel
from memfit.planner.space import SearchSpace
from memfit.plans import Plan


def test_torchao_optimizers_are_traced_ahead_at_each_weight_dtype_searched():
    space = SearchSpace(values={"precision": ["fp32", "bf16", "bf16-pure"],
                                "optimizer": ["adamw", "adamw8bit", "adamw8bit-ao", "adamw4bit-ao"]})
    model = SimpleNamespace(space=space)
    base = Plan(precision="bf16")
    alone = [base.replace(optimizer=o) for o in ("adamw8bit", "adamw8bit-ao", "adamw4bit-ao")]
    alone.append(base.replace(precision="bf16-pure"))
    warm = GpuStepModel._warming(model, alone)
    # fp32 and bf16 autocast hold fp32 weights (the alone plans' own): only bf16-pure is new
    assert warm == [base.replace(optimizer="adamw8bit-ao", precision="bf16-pure"),
                    base.replace(optimizer="adamw4bit-ao", precision="bf16-pure")]
