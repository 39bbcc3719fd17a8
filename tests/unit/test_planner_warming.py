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


def _model(n_params: int, budget_bytes: int, base: Plan, world: int = 1):
    model = SimpleNamespace(base=base, _n_params=n_params, budget=SimpleNamespace(bytes=budget_bytes), world=world)
    model._weights_fit = lambda plan: GpuStepModel._weights_fit(model, plan)
    return model


def test_where_the_base_s_weights_cannot_fit_torchao_is_measured_at_a_weight_dtype_that_may():
    """Llama-2-7B on a 24 GB card: fp32 weights (25 GiB) exceed the budget, so torchao's update is
    never compiled for them; its saving and cost come from bf16-pure with it against bf16-pure alone."""
    base = Plan(precision="bf16")
    alone = {("optimizer", o): base.replace(optimizer=o) for o in ("adamw8bit", "adamw8bit-ao", "adamw4bit-ao")}
    alone[("precision", "bf16-pure")] = pure = base.replace(precision="bf16-pure")
    n = 6_738_415_616
    tight = GpuStepModel._measured_elsewhere(_model(n, int(21.28 * 2**30), base), alone)
    assert tight == {("optimizer", o): (pure.replace(optimizer=o), pure) for o in ("adamw8bit-ao", "adamw4bit-ao")}
    assert GpuStepModel._measured_elsewhere(_model(n, 70 * 2**30, base), alone) == {}  # fp32 weights fit: as before
    assert GpuStepModel._measured_elsewhere(_model(n, 21 * 2**30, base, world=4), alone) == {}  # sharded ranks
