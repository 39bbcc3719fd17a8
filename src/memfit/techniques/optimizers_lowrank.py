"""Low-rank and state-light optimizers: GaLore and APOLLO, different optimizers with far smaller states.

Memory/compute trade-off, for a weight matrix of m x n (m >= n) and rank r (AdamW: 2mn of moments):

- ``galore`` (:class:`GaLore`): ``galore_torch.GaLoreAdamW``. Each step projects the gradient onto
  r directions (r x n), runs AdamW there (2rn of moments) and projects the update back; every
  ``update_proj_gap`` steps the directions are recomputed by an SVD of the gradient (fp32 scratch
  the size of the matrix and its factors, a few times the gradient, one matrix at a time). States:
  2rn + rm for the projection. Zhao et al., "GaLore", 2024.
- ``galore8bit`` (:class:`GaLore8bit`): ``galore_torch.GaLoreAdamW8bit``, the same with bitsandbytes'
  8-bit moments (2rn bytes). Its update first clones the whole weight (``p.saved_data``, the
  library's own "suboptimal implementation"): one weight's size more at the update, one at a time.
- ``apollo`` (:class:`Apollo`): ``apollo_torch.APOLLOAdamW`` with a random projection (no SVD: a
  seeded Gaussian r x n, regenerated every ``update_proj_gap`` steps): AdamW's moments in the
  projected space only estimate a per-channel scale, and the raw gradient, scaled, is the update.
  States 2rn. Zhu et al., "APOLLO", 2024.
- ``apollo-mini`` (:class:`ApolloMini`): APOLLO at rank 1 with one scale per tensor (x128): SGD-like
  memory (2n per matrix).

Only the weights of ``nn.Linear`` layers inside the model's repeated blocks are projected (GaLore's
and APOLLO's own scripts target the attention and MLP layers); the rest (embeddings, norms, output
head, biases) get the same optimizer without projection, i.e. AdamW. A model without repeated blocks
projects every ``nn.Linear`` weight. These change what the update computes ("different optimizer"):
the planner searches them only when named (``--optimizers``). Optional extras: ``pip install
'memfit[galore]'`` / ``'memfit[apollo]'``. Stepped in backward (``optimizer_in_backward``) they are
the papers' per-layer variants (transformers' ``*_layerwise``), and train exactly as stepped after.
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from memfit.errors import UserError
from memfit.techniques.optimizer_variant import (
    OptimizerVariant,
    hyperparameters,
    refuse_sharded_or_offloaded,
    regroup,
    trained_and_workloads,
)

STEADY_ITER = 1
"""The optimizer's own step count (``state["step"]``) in memfit's steady step, the second."""


@dataclass(frozen=True)
class LowRankVariant(OptimizerVariant):
    """A low-rank optimizer: its rank, how often it renews the projection, and the update's scale."""

    projection_rank: int = 128
    """Directions the gradient of each projected matrix is projected onto (the option ``rank``)."""
    update_proj_gap: int = 200
    """Steps between renewals of the projection (an SVD for GaLore, a new random matrix for APOLLO)."""
    scale: float = 0.25
    """Factor on the projected-back update."""

    rank = None  # (memory order: not comparable with the other optimizers')
    package: ClassVar[str] = ""
    """The module to import (galore_torch, apollo_torch)."""
    extra: ClassVar[str] = ""
    """memfit's extra that installs it."""
    requirement: ClassVar[str] = ""

    def values(self) -> dict:
        default = type(self)()
        options = [f"{option}={getattr(self, field):g}" for option, field in OPTIONS.items()
                   if getattr(self, field) != getattr(default, field)]
        return {"optimizer": f"{self.name}:{','.join(options)}" if options else self.name}

    def label(self, batch_size):
        return self.name


    def problem(self) -> str | None:
        """Why this optimizer cannot run here (None: it can): its library is missing."""
        if importlib.util.find_spec(self.package) is None:
            return (f"plan: optimizer {self.name} needs {self.requirement.split('>')[0]}, which is not installed; "
                    f"pip install 'memfit[{self.extra}]' ({self.requirement})")
        return None

    def check(self, plan) -> None:
        problem = self.problem()
        if problem:
            raise UserError(problem)
        refuse_sharded_or_offloaded(plan, self.name, "its projection needs each whole gradient matrix, a rank holds "
                                    "a shard", ": its states are already small and its projection runs beside the "
                                    "gradient; remove one of them")

    def apply(self, parts) -> None:
        found = trained_and_workloads(parts)
        if found is None:
            return
        params, like = found
        projected = {id(p) for p in projected_parameters(parts.model)}
        seeds = {id(p): i + 1 for i, p in enumerate(params)}  # (APOLLO's seed per parameter, as for the whole model)
        options = self.group_options()
        cls = self.optimizer_class()
        defaults = hyperparameters(like.defaults)

        def build(ps):
            plain = regroup([p for p in ps if id(p) not in projected], like, hyperparameters)
            low = regroup([p for p in ps if id(p) in projected], like, lambda g: {**hyperparameters(g), **options})
            return cls([g for g in plain + low if g["params"]], seeds=seeds, **defaults)
        parts.optimizer_factory = build

    def group_options(self) -> dict:
        return {"rank": self.projection_rank, "update_proj_gap": self.update_proj_gap, "scale": self.scale, "proj_type": "std"}

    def optimizer_class(self) -> type:
        raise NotImplementedError

    def export(self, into) -> None:
        into.not_carried(self)


@dataclass(frozen=True)
class GaLore(LowRankVariant):
    """galore-torch's GaLoreAdamW: AdamW on the gradient's r leading singular directions."""

    name = "galore"
    numerics = "different optimizer: GaLore (low-rank projected AdamW)"
    package = "galore_torch"
    extra = "galore"
    requirement = "galore-torch>=1.0,<1.1"

    def optimizer_class(self) -> type:
        return galore_class("GaLoreAdamW")

    def notes(self) -> list[str]:
        return [f"{self.name}: the projection is renewed at the second step as well as every {self.update_proj_gap} "
                "steps, so the step traced and measured is the one with the SVD (NOTE [ The projection step is the "
                "step traced ]); on a GPU preset cuSOLVER's SVD workspace is not modelled"]


@dataclass(frozen=True)
class GaLore8bit(GaLore):
    """galore-torch's GaLoreAdamW8bit: GaLore with bitsandbytes' 8-bit moments."""

    name = "galore8bit"
    numerics = "different optimizer: GaLore with 8-bit AdamW states"

    def optimizer_class(self) -> type:
        return galore_class("GaLoreAdamW8bit")

    def trace_context(self):
        from memfit.techniques.bnb_optim import real_quantization_tables
        return real_quantization_tables()


@dataclass(frozen=True)
class Apollo(LowRankVariant):
    """apollo-torch's APOLLOAdamW: a random projection estimates a per-channel scale of the gradient."""

    name = "apollo"
    scale: float = 1.0
    """Factor on the scaled gradient (APOLLO's default 1)."""
    numerics = "different optimizer: APOLLO (channel-wise scaled gradient)"
    package = "apollo_torch"
    extra = "apollo"
    requirement = "apollo-torch>=1.0.3,<1.1"
    scale_type: ClassVar[str] = "channel"

    def group_options(self) -> dict:
        return {**super().group_options(), "proj": "random", "scale_type": self.scale_type}

    def optimizer_class(self) -> type:
        return apollo_class()

    def trace_context(self):
        return real_seeds()


@dataclass(frozen=True)
class ApolloMini(Apollo):
    """APOLLO-Mini: rank 1, one scale per tensor, scale 128 (the APOLLO paper's settings)."""

    name = "apollo-mini"
    projection_rank: int = 1
    scale: float = 128.0
    numerics = "different optimizer: APOLLO-Mini (tensor-wise scaled gradient)"
    scale_type: ClassVar[str] = "tensor"


VARIANTS = {cls.name: cls for cls in (GaLore, GaLore8bit, Apollo, ApolloMini)}
OPTIONS = {"rank": "projection_rank", "update_proj_gap": "update_proj_gap", "scale": "scale"}
"""A plan value's options (``galore:rank=64``) -> the config's fields."""


def parse_lowrank(text: str) -> LowRankVariant:
    """``galore``, ``galore:rank=64,update_proj_gap=100,scale=0.25`` and the same for the others."""
    name, _, options = str(text).partition(":")
    cls = VARIANTS[name]
    values = {}
    for part in filter(None, options.split(",")):
        key, _, value = part.partition("=")
        if key not in OPTIONS or not value:
            raise UserError(f"plan: optimizer {text!r}: options are {', '.join(OPTIONS)} (e.g. {name}:rank=64)")
        try:
            number = float(value) if key == "scale" else int(value)
        except ValueError:
            raise UserError(f"plan: optimizer {text!r}: {key} must be a number") from None
        if number <= 0:
            raise UserError(f"plan: optimizer {text!r}: {key} must be above 0")
        values[OPTIONS[key]] = number
    return replace(cls(), **values)


def projected_parameters(model: torch.nn.Module) -> list:
    """The weights GaLore and APOLLO project: ``nn.Linear`` weights inside the repeated blocks, or
    every ``nn.Linear`` weight of a model without them."""
    from memfit.techniques.checkpointing import find_blocks
    blocks = find_blocks(model)
    roots = [b for _, children in blocks for b in children] or [model]
    return [m.weight for root in roots for m in root.modules()
            if isinstance(m, torch.nn.Linear) and m.weight.requires_grad]


# NOTE [ The projection step is the step traced ]
# GaLore and APOLLO renew their projection when ``iter % update_proj_gap == 0`` (and at the first
# step): every 200 steps an SVD of each projected gradient, with fp32 scratch a few times the matrix,
# at the update's peak. memfit traces and measures the second step, which would never be one. So
# memfit's projector renews it at the second step too (``STEADY_ITER``), with the old projection alive
# as at every later renewal: the step the estimate and the profile see is the worst one of a run,
# and a run renews once more than the library would (right after its first step, where the
# gradient's subspace moves most). Nothing else of the library's update changes.
class _RenewedAtTheSteadyStep:
    """A projector mixin: renew at the steady step too (NOTE [ The projection step is the step traced ])."""

    def project(self, full_rank_grad, iter):
        if iter != STEADY_ITER:
            return super().project(full_rank_grad, iter)
        gap, self.update_proj_gap = self.update_proj_gap, 1
        try:
            return super().project(full_rank_grad, iter)
        finally:
            self.update_proj_gap = gap


_CLASSES: dict[str, type] = {}


def galore_class(name: str) -> type:
    """galore-torch's ``name`` (GaLoreAdamW, GaLoreAdamW8bit) with memfit's projector."""
    if name not in _CLASSES:
        import galore_torch
        from galore_torch.galore_projector import GaLoreProjector
        base = getattr(galore_torch, name)
        projector = type("GaLoreProjector", (_RenewedAtTheSteadyStep, GaLoreProjector), {})

        def __init__(self, params, *, seeds, lr, betas, eps, weight_decay):
            if name == "GaLoreAdamW":
                base.__init__(self, params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                              no_deprecation_warning=True)
            else:  # NOTE [ galore-torch's 8-bit AdamW on bitsandbytes >= 0.44 ]
                from bitsandbytes.optim.optimizer import Optimizer2State
                Optimizer2State.__init__(self, "adam", params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                         optim_bits=8, min_8bit_size=4096)

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"] if "rank" in group else ():
                    state = self.state[p]
                    if p.grad is not None and "projector" not in state:
                        state["projector"] = projector(group["rank"], update_proj_gap=group["update_proj_gap"],
                                                       scale=group["scale"], proj_type=group["proj_type"])
            with _cuda_sync_only_on_cuda(self):
                return base.step(self, closure)

        _CLASSES[name] = type(name, (base,), {"__init__": __init__, "step": step, "__module__": __name__})
    return _CLASSES[name]


# NOTE [ galore-torch's 8-bit AdamW on bitsandbytes >= 0.44 ]
# galore-torch 1.0 passes ``percentile_clipping=100, block_wise=True`` positionally to bitsandbytes'
# ``Optimizer2State``, whose parameters there are now ``max_unorm`` and ``skip_zeros``: its 8-bit
# GaLore would clip the update norm and skip zero gradients, and keep a norm buffer per tensor. memfit
# calls ``Optimizer2State`` with keywords (bitsandbytes' defaults: no clipping, zeros not skipped), and
# its ``step`` calls ``torch.cuda.synchronize()`` after each update even for CPU tensors, which raises
# on a machine without a driver: that call does nothing while the parameters are not on CUDA.
@contextlib.contextmanager
def _cuda_sync_only_on_cuda(optimizer):
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(p.device.type == "cuda" for p in params):
        yield
        return
    real = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *args, **kwargs: None
    try:
        yield
    finally:
        torch.cuda.synchronize = real


def apollo_class() -> type:
    """apollo-torch's APOLLOAdamW with memfit's projector, each parameter seeded by its place in the
    model (the library numbers the parameters of each optimizer from 1: per parameter, stepped in
    backward, every projection would share seed 1)."""
    if "APOLLOAdamW" not in _CLASSES:
        from apollo_torch import APOLLOAdamW
        from apollo_torch.random_projector import GradientProjector
        projector = type("GradientProjector", (_RenewedAtTheSteadyStep, GradientProjector), {})

        def __init__(self, params, *, seeds, lr, betas, eps, weight_decay):
            APOLLOAdamW.__init__(self, params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
            for group in self.param_groups:
                for p in group["params"]:
                    if p.requires_grad:
                        self.state[p]["seed"] = seeds.get(id(p), self.state[p]["seed"])

        def _initialize_projector(self, group, state):
            return projector(group["rank"], update_proj_gap=group["update_proj_gap"], scale=group["scale"],
                             proj_type=group["proj_type"], seed=state["seed"])

        _CLASSES["APOLLOAdamW"] = type("APOLLOAdamW", (APOLLOAdamW,), {
            "__init__": __init__, "_initialize_projector": _initialize_projector, "__module__": __name__})
    return _CLASSES["APOLLOAdamW"]


# NOTE [ APOLLO's seeds are computed for real ]
# Each renewal of APOLLO's random projection draws the next seed with ``torch.randint(...,
# generator=...).tolist()`` (``random_projector.next_seed``): on fake tensors every value read would be
# an assumed 0, listed hundreds of times in the report. The seed is a pure function of the previous
# one, so it is computed for real, outside every mode, during a fake trace: exact, and only a
# 120-byte temporary of the real run's update goes uncounted.
@contextlib.contextmanager
def real_seeds():
    """APOLLO's ``next_seed`` outside fake mode and memfit's tracker (NOTE [ APOLLO's seeds are computed
    for real ])."""
    from apollo_torch import random_projector
    from torch.utils._python_dispatch import _disable_current_modes
    original = random_projector.next_seed

    def next_seed(seed, *args, **kwargs):
        with _disable_current_modes():
            return original(seed, *args, **kwargs)
    random_projector.next_seed = next_seed
    try:
        yield
    finally:
        random_projector.next_seed = original
