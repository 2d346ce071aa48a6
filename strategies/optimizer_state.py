"""Where the optimizer's state lives: on the device, on the host, or on the device in 8 bits.

- "device": the optimizer as the model file builds it.
- "host" (ZeRO-Offload style): the optimizer runs on the host over fp32 copies
  of the parameters, so its state (AdamW: two tensors per parameter) never
  takes device memory. Each gradient goes to the host as soon as backward has
  it (accumulated there over micro-batches), so gradients do not stay on the
  device either; each step runs the optimizer there and copies the
  parameters back. It is the model file's own optimizer (class,
  hyper-parameters, groups) on other tensors, so the update is the same
  arithmetic. On a CPU the host is the device: the copies, the
  gradients' buffers, the state and the update's temporaries are then made
  inside ``host_allocation()``, which the cpu and simulated meters count as
  host memory, not in the device peak (as activation offload's copies are),
  so that a plan for a GPU simulated here measures what host state saves.
- "8bit": ``torchao.optim.AdamW8bit`` (or ``Adam8bit``) with the model file's
  hyper-parameters: block-wise quantized moments, a quarter of the state
  bytes. Lossy: a declared change of the training arithmetic, never chosen
  silently. Needs the model file's optimizer to be AdamW or Adam, and torchao.
"""
from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn

from autofit._torch_private import without_dispatch_modes
from autofit.errors import UserError
from autofit.measure.host import host_allocation
from strategies.base import OptimizerBuilder, Strategy

OptimizerStateChoice = Literal["device", "host", "8bit"]
"""Where the optimizer's state lives: the closed set the plan file, ``TrainingConfig`` and the CLI share."""
OPTIMIZER_STATES: tuple[OptimizerStateChoice, ...] = get_args(OptimizerStateChoice)


@dataclass(kw_only=True, slots=True)
class OptimizerStateConfig:
    optimizer_state: OptimizerStateChoice = "device"
    """"device", "host" (state and update on the host) or "8bit" (torchao's 8-bit AdamW; lossy)."""

    def __post_init__(self) -> None:
        if self.optimizer_state not in OPTIMIZER_STATES:
            raise UserError(
                f"optimizer state {self.optimizer_state!r} is unknown; choose one of {', '.join(OPTIMIZER_STATES)}"
            )


class OptimizerState(Strategy):
    """Builds the optimizer with its state where the configuration says.

    Args:
        config: where the state lives.
        device: where the model trains.
        master_weights: the "bf16-master" precision: ``apply`` keeps an fp32 master copy of each trained weight
            on the host and leaves the device's in bf16; the optimizer then runs on the host over the masters
            (``HostOptimizer``), whatever ``config`` says (the configuration refuses any other state with it).
    """

    def __init__(
        self, config: OptimizerStateConfig, *, device: torch.device | str, master_weights: bool = False, pure_bf16: bool = False,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.master_weights = master_weights
        self.pure_bf16 = pure_bf16
        """The "bf16-pure" precision: the weights cast to bf16 with no master, AdamW with stochastic rounding."""
        self.masters: dict[int, torch.Tensor] = {}
        """id(parameter) -> its fp32 master on the host (with ``master_weights``, once applied)."""

    def apply(self, model: nn.Module) -> nn.Module:
        """With ``master_weights``: each trained weight's fp32 value kept on the host, the device's cast to bf16; with
        ``pure_bf16`` the cast alone.

        The masters are copied before the cast, so they hold the weights exactly; frozen weights (an adapter's
        base) go to bf16 with no master. Normalization layers keep theirs in fp32 on the device (a few values per
        channel, next to fp32 running statistics that a bf16 weight could not be used with), and buffers
        (running statistics, rotary tables) stay as they are.
        """
        if not (self.master_weights or self.pure_bf16):
            return model
        # Pinned masters where the weights train on a GPU (they are cast here, before or after the move there).
        pin = self.master_weights and (self.device.type == "cuda" or any(p.is_cuda for p in model.parameters()))
        with torch.no_grad():
            for param, cast in _weights_to_cast(model):
                if param.requires_grad and self.master_weights:
                    with host_allocation():
                        master = torch.empty(param.shape, dtype=torch.float32, pin_memory=pin)
                        self.masters[id(param)] = master.copy_(param)
                if cast:
                    param.data = param.data.to(torch.bfloat16)
        return model

    def wrap_optimizer_builder(self, build: OptimizerBuilder) -> OptimizerBuilder:
        where = self.config.optimizer_state
        if self.master_weights:
            return lambda params: HostOptimizer(params, build=build, masters=self.masters)
        if self.pure_bf16:
            return lambda params: stochastic_bf16_adamw(build(params), eight_bit=where == "8bit")
        if where == "host":
            return lambda params: HostOptimizer(params, build=build)
        if where == "8bit":
            return lambda params: eight_bit_adam(build(params))
        return build


class HostOptimizer(torch.optim.Optimizer):
    """The optimizer ``build`` makes, run on the host over copies of ``params``.

    Each gradient leaves the device as soon as backward has accumulated it (a
    post-accumulate-grad hook, as ZeRO-Offload moves gradients during
    backward): it is copied into the parameter's host buffer on the first
    micro-batch after ``zero_grad``, added to it on the later ones, and freed
    on the device. So gradients never all exist on the device, with or
    without accumulation. The host buffer adds the micro-batches' gradients in
    the order backward would add them on the device, so the sum is the same.
    ``step()`` steps the optimizer on the host and copies the updated values
    back into the parameters (a gradient set by hand rather than by backward
    is copied to the host there). ``param_groups`` and ``state`` are the host
    optimizer's own objects, so a learning-rate schedule, ``state_dict()`` and
    fp16's GradScaler (which unscales the host gradients) act on it directly.

    Everything it keeps on the host (the parameters' copies, the gradients'
    buffers, the state) and the update's temporaries are made inside
    ``host_allocation()``: where the host is this same CPU, the meters count
    them as host bytes (``host_tensors()`` lists those made before a
    measurement began).

    On a GPU the first copy of each step is asynchronous (into pinned memory,
    on the compute stream); a later micro-batch's gradient is copied and
    added synchronously.

    Args:
        params: the parameters (on the device).
        build: params -> Optimizer (the model file's).
        host: where the copies and the state live ("cpu"; the tests use it
            with CPU parameters to compare the arithmetic with a plain optimizer).
    """

    def __init__(
        self, params: Iterable[nn.Parameter], *, build: OptimizerBuilder, host: torch.device | str = "cpu",
        masters: dict[int, torch.Tensor] | None = None,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.host = torch.device(host)
        self.has_masters = masters is not None
        pin = any(p.is_cuda for p in self.params)
        with host_allocation():
            # fp32 copies in pinned memory (when the parameters are on a GPU: copies run asynchronously); with
            # bf16 weights on the device, the fp32 masters kept before the cast (``OptimizerState.apply``).
            self.copies = [
                masters[id(p)] if masters is not None else _host_empty_like(p, self.host, pin=pin).copy_(p.detach())
                for p in self.params
            ]
            self.grad_buffers = [_host_empty_like(copy, self.host, pin=pin) for copy in self.copies]
            self.inner = build(self.copies)
        super().__init__(self.copies, dict(self.inner.defaults))
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(self._gradient_to_host(index))

    def _gradient_to_host(self, index: int):
        # The hook holds the host tensors, not this optimizer: a parameter's hooks live where the garbage collector
        # cannot follow them, so a cycle through them (parameter -> hook -> optimizer -> parameter) is never freed,
        # and each probe of a plan left its model's weights on the card.
        copy, buffer, host = self.copies[index], self.grad_buffers[index], self.host

        @torch.no_grad()
        def move(param: nn.Parameter) -> None:
            if param.grad is None:
                return
            with host_allocation():
                if copy.grad is None:  # the first micro-batch since zero_grad()
                    copy.grad = buffer.copy_(param.grad, non_blocking=True)
                else:
                    copy.grad.add_(param.grad.to(host))  # waits for the gradient (and the earlier copies)
            param.grad = None  # on a GPU the allocator reuses it only after the copy, on the same stream

        return move

    @torch.no_grad()
    def gather_gradients(self) -> list[torch.Tensor]:
        """The host copies, each holding the step's gradient once every copy has landed: what the step updates
        from, so what clipping (or anything else that reads the gradients before the step) must act on."""
        with host_allocation():
            for param, copy, buffer in zip(self.params, self.copies, self.grad_buffers):
                if param.grad is not None:  # set by hand, not by backward (whose hook moved it already)
                    copy.grad = buffer.copy_(param.grad, non_blocking=True)
                    param.grad = None  # moved, as the hook moves it: a second gather keeps what was done to the copy
        _wait_for_copies(self.params)  # the gradients are on the host
        return self.copies

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise UserError("optimizer state on the host does not take a closure in step()")
        self.gather_gradients()
        with host_allocation():
            self.inner.step()  # its state and temporaries are host memory
        for param, copy in zip(self.params, self.copies):
            if copy.grad is not None:
                param.copy_(copy, non_blocking=True)  # waited for by the next step's gradient copy
        return None

    def host_tensors(self) -> list[torch.Tensor]:
        """What this optimizer keeps in host memory: the parameters' copies, the gradients' buffers, the state."""
        state = [v for values in self.inner.state.values() for v in values.values() if isinstance(v, torch.Tensor)]
        return [*self.copies, *self.grad_buffers, *state]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for tensor in [*self.params, *self.copies]:
            if set_to_none:
                tensor.grad = None
            elif tensor.grad is not None:
                tensor.grad.zero_()

    def state_dict(self) -> dict:
        """The host optimizer's, and with bf16 weights the fp32 masters (the device holds them rounded)."""
        state = self.inner.state_dict()
        return {**state, "master_weights": list(self.copies)} if self.has_masters else state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop("master_weights", None)
        with host_allocation(), torch.no_grad():
            self.inner.load_state_dict(state_dict)
            if masters is not None and self.has_masters:
                for copy, master, param in zip(self.copies, masters, self.params):
                    copy.copy_(master)
                    param.copy_(copy)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state


def stepped_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors whose gradients ``optimizer.step()`` updates from, those gradients in place: a ``HostOptimizer``'s
    host copies (the device's gradients have left for them), else the optimizer's own parameters."""
    if isinstance(optimizer, HostOptimizer):
        return optimizer.gather_gradients()
    return [param for group in optimizer.param_groups for param in group["params"]]


def held_weight_bytes(model: nn.Module, *, cast: bool, nf4: Collection[nn.Parameter] = ()) -> int:
    """Every parameter's bytes on one process's device, trained and frozen: as built, or (``cast``) once
    ``OptimizerState.apply`` has cast them to bf16 (bf16-master, bf16-pure); a tied weight once. Those in ``nf4``
    (frozen linear weights ``frozen_nf4.FrozenNF4`` may hold) count their NF4 codes alone, half a byte per
    element: a lower bound."""
    held = {id(param) for param in nf4}
    return sum(
        param.numel() // 2 if id(param) in held else param.numel() * (2 if cast and to_cast else param.element_size())
        for param, to_cast in _weights_to_cast(model)
    )


def _weights_to_cast(model: nn.Module) -> Iterator[tuple[nn.Parameter, bool]]:
    """Each parameter once (tied weights: one), and whether bf16-master and bf16-pure cast it to bf16: floating
    weights outside normalization layers."""
    seen: set[int] = set()
    for module in model.modules():
        keep = _is_norm(module)
        for param in module.parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            yield param, param.is_floating_point() and not keep


_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm)


def _is_norm(module: nn.Module) -> bool:
    """A normalization layer (torch's, or a library's RMSNorm/LayerNorm class by its name)."""
    return isinstance(module, _NORMS) or type(module).__name__.endswith(("Norm", "Norm2d"))


def _host_empty_like(param: torch.Tensor, host: torch.device, *, pin: bool) -> torch.Tensor:
    return torch.empty(param.shape, dtype=param.dtype, device=host, pin_memory=pin and host.type == "cpu")


def _wait_for_copies(params: list[nn.Parameter]) -> None:
    devices = {p.device for p in params if p.is_cuda}
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


def eight_bit_adam(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """torchao's 8-bit AdamW (Adam) with ``optimizer``'s groups and hyper-parameters.

    Raises:
        UserError: torchao is not installed, or ``optimizer`` is not AdamW/Adam
            or uses an option the 8-bit one lacks.
    """
    kind = type(optimizer)
    if kind not in (torch.optim.AdamW, torch.optim.Adam):
        raise UserError(
            f"optimizer state '8bit' replaces AdamW or Adam, but the model's optimizer is {kind.__name__}; "
            "use optimizer state 'device' or 'host'"
        )
    try:
        with quiet_torch_pytree():  # torchao's import registers enums torch now warns about on stderr
            from torchao.optim import Adam8bit, AdamW8bit
    except ImportError as error:
        raise UserError(f"optimizer state '8bit' needs torchao ({error}); pip install torchao, or use 'device' or 'host'") from None
    _make_quantization_maps()
    groups = _torchao_groups(optimizer, refused="optimizer state '8bit'", way_out="use 'device' or 'host'")
    kind_8bit = AdamW8bit if kind is torch.optim.AdamW else Adam8bit
    return kind_8bit(groups, lr=groups[0]["lr"])


def stochastic_bf16_adamw(optimizer: torch.optim.Optimizer, *, eight_bit: bool = False) -> torch.optim.Optimizer:
    """torchao's AdamW (8-bit with ``eight_bit``) with ``optimizer``'s groups and hyper-parameters, rounding its bf16
    updates stochastically (``bf16_stochastic_round``): for "bf16-pure", whose weights and state are bf16.

    Raises:
        UserError: torchao is not installed, or ``optimizer`` is not AdamW or uses an option torchao's lacks.
    """
    if type(optimizer) is not torch.optim.AdamW:
        raise UserError(
            f"precision bf16-pure replaces AdamW with torchao's stochastically rounding one, but the model's optimizer is "
            f"{type(optimizer).__name__}; use bf16 or bf16-master"
        )
    try:
        with quiet_torch_pytree():
            from torchao.optim import AdamW8bit, _AdamW
    except ImportError as error:
        raise UserError(f"precision bf16-pure needs torchao ({error}); pip install torchao, or use bf16 or bf16-master") from None
    if eight_bit:
        _make_quantization_maps()
    groups = _torchao_groups(optimizer, refused="precision bf16-pure", way_out="use bf16 or bf16-master")
    kind = AdamW8bit if eight_bit else _AdamW
    return kind(groups, lr=groups[0]["lr"], bf16_stochastic_round=True)


def _torchao_groups(optimizer: torch.optim.Optimizer, *, refused: str, way_out: str) -> list[dict]:
    """``optimizer``'s parameter groups with the hyper-parameters torchao's AdamW takes; one line for an option it lacks."""
    groups = []
    for group in optimizer.param_groups:
        unsupported = [name for name in ("maximize", "differentiable", "capturable") if group.get(name)]
        if unsupported:
            raise UserError(f"{refused} does not support {', '.join(unsupported)}=True; {way_out}")
        groups.append({name: group[name] for name in ("params", "lr", "betas", "eps", "weight_decay", "amsgrad")})
    return groups


def _make_quantization_maps() -> None:
    """Build torchao's 8-bit quantization maps now, with real tensors.

    torchao builds them on first use with ``.tolist()`` and keeps them
    (``lru_cache``); first used under the simulated meter's fake tensors, that
    would fail, and the simulation fall back to real tensors for the whole model.
    """
    try:
        from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned
    except ImportError:  # another torchao layout: its maps are its own business
        return
    with without_dispatch_modes():
        get_qmap_signed()
        get_qmap_unsigned()


@contextmanager
def quiet_torch_pytree() -> Iterator[None]:
    """Silence ``torch.utils._pytree``'s deprecation warnings while a library registers its types.

    A warning on stderr would break every command's promise of one line per
    error (torchao 0.18 registers two Enum classes that torch 2.14 reports).
    """
    logger = logging.getLogger("torch.utils._pytree")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
