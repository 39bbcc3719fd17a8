"""Where the GPU-preset planner measures the optimizers that compile a graph per weight dtype
(torchao's): once, at the smallest weights it searches (NOTE [ Compiled updates measured at the
smallest weights ])."""

from types import SimpleNamespace

from memfit.planner.baseline import Baseline
from memfit.plans import Plan


def _model(n_params: int, budget_bytes: int, base: Plan, world: int = 1):
    book = SimpleNamespace(n_params=n_params, budget=SimpleNamespace(bytes=budget_bytes), world=world)
    baseline = SimpleNamespace(base=base, book=book)
    baseline._weights_fit = lambda plan: Baseline._weights_fit(baseline, plan)
    return baseline


def test_torchao_is_measured_at_the_smallest_weights_searched_fitting_or_not():
    """GPT-2 for 2 GiB: fp32 weights fit, but torchao's update is compiled for bf16 weights only
    (bf16-pure with it, against bf16-pure alone); Llama-2-7B on a 24 GB card: fp32 weights (25 GiB)
    exceed the budget, and the same holds."""
    base = Plan(precision="bf16")
    alone = {("optimizer", o): base.replace(optimizer=o) for o in ("adamw8bit", "adamw8bit-ao", "adamw4bit-ao")}
    alone[("precision", "fp32")] = base.replace(precision="fp32")
    alone[("precision", "bf16-pure")] = pure = base.replace(precision="bf16-pure")
    expected = {("optimizer", o): (pure.replace(optimizer=o), pure) for o in ("adamw8bit-ao", "adamw4bit-ao")}
    for n, budget in ((124_439_808, 2 * 2**30), (6_738_415_616, int(21.28 * 2**30)), (6_738_415_616, 70 * 2**30)):
        assert Baseline._measured_elsewhere(_model(n, budget, base), alone) == expected, (n, budget)
    assert Baseline._measured_elsewhere(_model(6_738_415_616, 21 * 2**30, base, world=4), alone) == expected


def test_torchao_is_measured_at_the_base_where_no_smaller_weights_are_searched_or_fit():
    base = Plan(precision="bf16")
    alone = {("optimizer", "adamw8bit-ao"): base.replace(optimizer="adamw8bit-ao"),
             ("precision", "fp32"): base.replace(precision="fp32")}
    assert Baseline._measured_elsewhere(_model(124_439_808, 2 * 2**30, base), alone) == {}
    alone[("precision", "bf16-pure")] = base.replace(precision="bf16-pure")
    assert Baseline._measured_elsewhere(_model(6_738_415_616, 12 * 2**30, base), alone) == {}  # 13.5 GB of bf16
    pure = Plan(precision="bf16-pure")
    alone = {("optimizer", "adamw8bit-ao"): pure.replace(optimizer="adamw8bit-ao"),
             ("precision", "bf16"): pure.replace(precision="bf16")}
    assert Baseline._measured_elsewhere(_model(124_439_808, 2 * 2**30, pure), alone) == {}
