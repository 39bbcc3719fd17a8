"""The plan fields a user gives ``memfit plan`` (``--precision bf16``, ``--checkpointing blocks``): the search
space narrowed to them, and each checked against the workload before any candidate is timed or traced."""

from __future__ import annotations

from memfit.devices import Device
from memfit.errors import UserError
from memfit.fake_mode import fake_mode
from memfit.plans import Plan, technique_of, with_what_it_needs
from memfit.quiet import silenced_warnings
from memfit.step import build_step
from memfit.target import Target
from memfit.workload import Workload


def constrain(space, fixed: dict, dev: Device, bs: int) -> tuple[dict, dict]:
    """Narrow ``space`` to the plan fields the user fixed. Returns the fields left to apply to every
    candidate (outside the space: ema, bf16_update) and the space dimensions fixed (name -> value).
    A value that leaves a choice to the planner (``Config.choices``) becomes a space dimension.
    Values the planner cannot search with are refused here, before any trace; a value that means
    something per device (``precision: auto``) is resolved for this one."""
    given = Plan().replace(**fixed)
    given.check_implemented()
    for name in list(fixed):
        technique = technique_of(name)
        config = given.config(technique.name).resolve(dev)
        choices = config.choices(dev)
        if len(choices) > 1:  # the user left this choice to the planner (ema: {device: auto})
            del fixed[name]
            space.values[name] = [c.values()[name] for c in choices]
            continue
        fixed.update(choices[0].values())
    split = {k: fixed.pop(k) for k in ("micro_batch_size", "grad_accum_steps") if k in fixed}
    if split:
        micro, _ = Plan(**split).micro_batches(bs)
        space.micro_batches = [micro]
    constrained = {}
    for name in [n for n in fixed if n in space.values]:
        constrained[name] = fixed.pop(name)
        space.values[name] = [constrained[name]]
    return fixed, constrained


def check_suits(target: Target, constrained: dict, given: dict) -> None:
    """Build the step (on fake tensors: no memory) with each value the user fixed, so that one that does
    not suit the workload (loss_chunks on a model that is no causal LM, checkpointing without repeated
    blocks) is refused before any candidate is timed or traced. A value is built alone, or with the other
    given field it needs (an activation budget needs compile). One that fails alone where the user gave
    other fields too is left to the walk's traces, which build it with them all (swap_blocks needs the
    given adapter's frozen weights)."""
    for name, value in constrained.items():
        alone = _alone_or_with(name, value, given)
        config = alone.config(technique_of(name).name)
        if config.technique.depends_on_model and not config.is_default:
            try:
                with silenced_warnings(), fake_mode():
                    build_step(target.with_plan(alone))
            except UserError as e:
                if alone == Plan(**given):
                    raise unsuited(target.workload, name, value, str(e)) from None


def _alone_or_with(name: str, value, given: dict) -> Plan:
    """``name=value`` alone, or with the one other given field it needs, or else with them all."""
    found = with_what_it_needs(name, value, given.items())
    return found[0] if found else Plan(**given)


def unsuited(wl: Workload, name: str, value, why: str) -> UserError:
    shown = "[" + ",".join(value) + "]" if isinstance(value, tuple) else str(value)
    return UserError(f"plan: the given {name}={shown} does not suit {wl.name}: "
                     f"{why.removeprefix('plan: ')}; remove --{name.replace('_', '-')} to let the planner choose")
