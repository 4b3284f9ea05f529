"""[both] Hooks: user code called at every stage of the training loop, on every rank.

A hook method names only the keyword arguments it wants; :class:`HookSet` inspects each
method once and passes exactly those names. The order of stages in one fit is::

    before_run
    for each epoch:
        before_train_epoch
        for each batch:
            before_train_iter        may return a replacement batch
            [train_step]             one hook may replace the forward/backward/step below
            before_backward          may return a replacement loss
            after_backward
            before_optimizer_step
            after_optimizer_step
            after_train_iter
        before_val_epoch             only with validation rows
            before_val_iter / after_val_iter
        after_val_epoch
        after_train_epoch
    after_run
    on_exception                     when any stage raised
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import numpy as np
import torch

from spark_torch_est.errors import InvalidInputError, UserCodeError, described

__all__ = ["Hook", "Control", "HookSet", "STAGES", "STAGE_ARGUMENTS", "bind_keywords", "normalize_hooks",
           "storable_state"]

_COMMON = (
    "model", "ddp_model", "optimizer", "scheduler", "loss_fn", "epoch", "batch_idx",
    "global_step", "rank", "world_size", "config", "state", "control", "device", "scaler",
)
_BATCH = ("batch", "inputs", "labels", "weights")
_STEP = _BATCH + ("outputs", "loss")

#: The keyword arguments on offer at each stage.
STAGE_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "before_run": _COMMON,
    "before_train_epoch": _COMMON,
    "before_train_iter": _COMMON + _BATCH,
    "train_step": _COMMON + _BATCH,
    "before_backward": _COMMON + _STEP,
    "after_backward": _COMMON + _STEP,
    "before_optimizer_step": _COMMON + _STEP,
    "after_optimizer_step": _COMMON + _STEP,
    "after_train_iter": _COMMON + _STEP,
    "before_val_epoch": _COMMON,
    "before_val_iter": _COMMON + _BATCH,
    "after_val_iter": _COMMON + _STEP,
    "after_val_epoch": _COMMON + ("metrics",),
    "after_train_epoch": _COMMON + ("metrics",),
    "after_run": _COMMON + ("metrics",),
    "on_exception": _COMMON + ("exception", "stage"),
}

_PER_STEP = ("before_train_iter", "before_backward", "after_backward", "before_optimizer_step",
             "after_optimizer_step", "after_train_iter")

#: Every stage in loop order (``train_step`` is an override, not a notification).
STAGES: tuple[str, ...] = tuple(s for s in STAGE_ARGUMENTS if s != "train_step")


@dataclass
class Control:
    """Requests hooks make to the loop. Any rank may set a flag; the loop combines the
    flags of all ranks after ``before_run``, ``before_train_epoch`` and each epoch, so every
    rank stops at the same step. A request made in a per-step stage is acted on after that
    step only if some hook names ``control`` in a per-step stage (``train_step`` or
    ``before_train_iter`` to ``after_train_iter``): that asks for a vote of the ranks after
    every step (one small all-reduce per step). Otherwise it is acted on at the epoch's end.

    Attributes:
        stop_training: End the fit after the current step (the run can be resumed).
        stop_epoch: End the current epoch after the current step.
        step_scheduler_per_epoch: Whether the loop steps the LR scheduler after each epoch;
            a hook that steps it itself (see ``builtin_hooks.SchedulerPerIteration``) sets
            this to False in ``before_run``.
    """

    stop_training: bool = False
    stop_epoch: bool = False
    step_scheduler_per_epoch: bool = True


class Hook:
    """Base class for hooks. Override the stages you need; each method declares only the
    keyword arguments it uses (see :data:`STAGE_ARGUMENTS`), or ``**kwargs`` for all. (The
    stages here take ``*args, **kwargs``, so that type checkers accept any such override.)

    A hook may also define ``train_step(model, batch, loss_fn, optimizer, ...)`` to replace
    the forward, backward and optimizer step (at most one hook may); it returns the loss or
    ``(loss, outputs)``. Hook objects are pickled to every rank; whatever ``state_dict``
    returns on rank 0 is saved in the checkpoint, restored on every rank at the next fit
    and loaded into the driver's hook object when ``fit`` returns.
    """

    def before_run(self, *args: Any, **kwargs: Any) -> None:
        """Once per fit, after resuming and wrapping the model in DDP."""

    def before_train_epoch(self, *args: Any, **kwargs: Any) -> None:
        """At the start of every epoch (not when a fit resumes mid-epoch)."""

    def before_train_iter(self, *args: Any, **kwargs: Any) -> Any:
        """Before each training batch; may return a replacement ``(inputs, labels)``."""

    def before_backward(self, *args: Any, **kwargs: Any) -> Any:
        """After the loss is computed; may return a replacement loss."""

    def after_backward(self, *args: Any, **kwargs: Any) -> None:
        """After ``loss.backward()``; gradients are synchronized across ranks."""

    def before_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """Before ``optimizer.step()`` (gradient clipping goes here)."""

    def after_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """After ``optimizer.step()``; ``global_step`` includes this step from here on."""

    def after_train_iter(self, *args: Any, **kwargs: Any) -> None:
        """After each training batch; ``global_step`` includes this step."""

    def before_val_epoch(self, *args: Any, **kwargs: Any) -> None:
        """Before validation, when there are validation rows."""

    def before_val_iter(self, *args: Any, **kwargs: Any) -> None:
        """Before each validation batch."""

    def after_val_iter(self, *args: Any, **kwargs: Any) -> None:
        """After each validation batch."""

    def after_val_epoch(self, *args: Any, **kwargs: Any) -> None:
        """After validation; ``metrics`` holds this epoch's validation values (numbers a
        hook adds are recorded in the history)."""

    def after_train_epoch(self, *args: Any, **kwargs: Any) -> None:
        """After every epoch; ``metrics`` is the epoch's history entry: numbers a hook adds
        to it are recorded in the history (rank 0's values)."""

    def after_run(self, *args: Any, **kwargs: Any) -> None:
        """Once per fit, after the last step of this fit."""

    def on_exception(self, *args: Any, **kwargs: Any) -> None:
        """When a stage raised; ``exception`` and ``stage`` say what and where."""

    def state_dict(self) -> dict:
        """Returns the state to keep across fits: tensors and plain data only (see
        :func:`storable_state`; numpy values come back as Python numbers and tensors)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restores what :meth:`state_dict` returned."""


#: Values a checkpoint stores as they are: ``torch.load(weights_only=True)`` reads them back.
_STORABLE = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.Tensor, torch.nn.Parameter,
             torch.Size, torch.dtype, torch.device)
_SEQUENCES = (list, tuple, set)
_MAPPINGS = (dict, collections.OrderedDict, collections.Counter)


def storable_state(name: str, state: Any) -> dict:
    """Hook ``name``'s ``state_dict()`` as a checkpoint stores it: numpy scalars as Python
    numbers, numpy arrays as tensors, everything else as it is.

    Raises:
        InvalidInputError: ``state`` is not a dict, or holds a value that
            ``torch.load(weights_only=True)`` cannot read back (a lock, a client, an
            object of the user's class, ...), naming the hook and the value's key.
    """
    if type(state) not in _MAPPINGS:
        raise InvalidInputError(f"hook {name!r}: state_dict() must return a dict, got {type(state).__name__}")
    return _storable(state, name, "")


def _storable(value: Any, name: str, path: str) -> Any:
    """``value`` (at ``path`` in hook ``name``'s state) with its numpy values converted."""
    if isinstance(value, np.generic):
        value = value.item()
    elif isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
        return torch.tensor(value)
    if type(value) in _STORABLE:
        return value
    if type(value) in _MAPPINGS:
        return type(value)((_storable(k, name, f"{path} key {k!r}"), _storable(v, name, f"{path}[{k!r}]"))
                           for k, v in value.items())
    if type(value) in _SEQUENCES:
        return type(value)(_storable(item, name, f"{path}[{i}]") for i, item in enumerate(value))
    raise InvalidInputError(
        f"hook {name!r}: state_dict(){path} holds a {type(value).__module__}.{type(value).__qualname__}, which a "
        "checkpoint cannot store: checkpoints are read with torch.load(weights_only=True), which takes tensors, "
        "numbers, strings, bytes, None and dicts, lists, tuples and sets of them (numpy numbers and arrays are "
        "converted). Return plain data from the hook's state_dict() and rebuild the rest in its load_state_dict() "
        "(hooks= argument)")


def normalize_hooks(hooks: Iterable[Hook] | Mapping[str, Hook] | None) -> dict[str, Hook]:
    """Returns hooks as an ordered ``{name: hook}`` dict; list entries get unique names.

    Raises:
        InvalidInputError: An entry is not a :class:`Hook`, or ``hooks`` is not a list/dict.
    """
    if hooks is None:
        return {}
    if isinstance(hooks, Hook):
        hooks = [hooks]
    if isinstance(hooks, Mapping):
        named = dict(hooks)
    elif isinstance(hooks, (list, tuple)):
        named = {}
        for hook in hooks:
            base = type(hook).__name__
            name, n = base, 1
            while name in named:
                n += 1
                name = f"{base}_{n}"
            named[name] = hook
    else:
        raise InvalidInputError(f"hooks must be a list of Hook or a {{name: Hook}} dict, got {type(hooks).__name__}")
    for name, hook in named.items():
        if not isinstance(name, str) or not isinstance(hook, Hook):
            raise InvalidInputError(
                f"hooks[{name!r}] must be a spark_torch_est.Hook instance, got {type(hook).__name__}"
            )
    return named


_Call = tuple[str, Callable[[Mapping[str, Any]], Any], "tuple[str, ...] | None"]


def _is_loss(value: Any) -> bool:
    """Whether ``value`` is a loss the loop takes: a tensor holding one value (its shape is
    read, never its value)."""
    return isinstance(value, torch.Tensor) and value.numel() == 1


def _is_batch(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[1], torch.Tensor)


def _is_step(value: Any) -> bool:
    return _is_loss(value) or (isinstance(value, tuple) and len(value) == 2 and _is_loss(value[0]))


#: What a hook may return at the stages whose value the loop takes (None always: no change),
#: checked where the hook hands it over: (check, what is expected, how to fix it).
_RETURNS: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "before_train_iter": (_is_batch, "None or a replacement batch (inputs, labels) with the labels a tensor",
                          "return the batch argument, changed, or nothing"),
    "before_backward": (_is_loss, "None or a replacement loss: a tensor holding one value",
                        "return the loss argument, changed (e.g. loss * 0.5), or nothing"),
    "train_step": (_is_step, "the step's loss (a tensor holding one value) or a tuple (loss, outputs)",
                   "return the loss tensor, not loss.item()"),
}


#: The stages whose ``metrics`` is a history entry hooks may add to: what they add is stored in
#: checkpoints, so it is checked (and numpy values converted) after each hook.
_ENTRY_STAGES = ("after_val_epoch", "after_train_epoch", "after_run")


def _check_entry(name: str, hook: Hook, stage: str, metrics: Any) -> None:
    """Converts the numpy values ``hook`` added to the history entry ``metrics`` at ``stage``
    (as :func:`storable_state` does) and refuses what a checkpoint cannot store.

    Raises:
        UserCodeError: A key is not a string, or a value is neither a number, a tensor, a
            string nor a container of them, naming the hook and the key.
    """
    if not isinstance(metrics, dict):
        return
    for key, value in list(metrics.items()):
        try:
            if not isinstance(key, str):
                raise InvalidInputError("the key is not a string")
            metrics[key] = _storable(value, name, "")
        except InvalidInputError:
            raise UserCodeError(
                f"hook {name!r} ({type(hook).__name__}).{stage}() put {described(value)} in metrics[{key!r}]; "
                "expected string keys and numbers, tensors or strings (or lists and dicts of them): the history "
                "is stored in checkpoints, which are read with torch.load(weights_only=True); add a number, "
                "e.g. float(value)") from None


def _check_return(name: str, hook: Hook, stage: str, value: Any) -> None:
    """Refuses a value ``hook`` returned at ``stage`` that the loop cannot take, naming the
    hook, the stage and what was expected.

    Raises:
        UserCodeError: The value is not of the kind the stage takes.
    """
    check, expected, fix = _RETURNS[stage]
    if not check(value):
        raise UserCodeError.returned(f"hook {name!r} ({type(hook).__name__}).{stage}()", value, expected, fix)


def _invoker(method: Callable[..., Any], names: tuple[str, ...] | None, positional: bool) -> Callable[..., Any]:
    """A function of the context that calls ``method`` with exactly ``names`` (made once:
    the per-call work is one C-level item lookup where the signature allows)."""
    if names is None:
        return lambda context: method(**context)
    if not names:
        return lambda context: method()
    if positional and len(names) == 1:
        key = names[0]
        return lambda context: method(context[key])
    if positional:
        get = itemgetter(*names)
        return lambda context: method(*get(context))
    return lambda context: method(**{n: context[n] for n in names})


def bind_keywords(method: Callable[..., Any], stage: str, allowed: tuple[str, ...],
                  owner: str) -> tuple[Callable[[Mapping[str, Any]], Any], tuple[str, ...] | None]:
    """Inspects ``method`` once: returns a function of a context mapping that calls it with
    exactly the names it declares, and those names (None for ``**kwargs``: everything).

    Args:
        method: A bound method, e.g. ``hook.after_train_iter``.
        stage: Its name, for the error message.
        allowed: The names on offer.
        owner: Who defines it, for the error message (``"hook 'Name'"``).

    Raises:
        InvalidInputError: The method asks for a name that is not on offer (and has no default).
    """
    names: list[str] = []
    positional = True
    for param in inspect.signature(method).parameters.values():
        if param.kind is param.VAR_KEYWORD:
            return _invoker(method, None, False), None
        if param.kind is param.VAR_POSITIONAL:
            continue
        if param.name not in allowed:
            if param.default is not param.empty:
                positional = False  # later arguments must then be passed by name
                continue
            raise InvalidInputError(
                f"{owner}: {stage}() asks for unknown argument {param.name!r}; "
                f"the arguments on offer at {stage} are: {', '.join(allowed)}"
            )
        positional = positional and param.kind is param.POSITIONAL_OR_KEYWORD
        names.append(param.name)
    return _invoker(method, tuple(names), positional), tuple(names)


def _names(method: Callable[..., Any], argument: str) -> bool:
    """Whether ``method`` declares ``argument`` by name (not merely through ``**kwargs``)."""
    parameter = inspect.signature(method).parameters.get(argument)
    return parameter is not None and parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL)


def _plan(name: str, hook: Hook, stage: str) -> _Call | None:
    """Inspects one hook method: returns (hook name, invoker, argument names or None for
    ``**kwargs``), or None when the hook does not override the stage."""
    method = getattr(hook, stage, None)
    if method is None or getattr(type(hook), stage, None) is getattr(Hook, stage, None):
        return None
    return (name, *bind_keywords(method, stage, STAGE_ARGUMENTS[stage], f"hook {name!r}"))


class HookSet:
    """The hooks of one fit with their call plans, made once by inspecting signatures.

    Args:
        hooks: ``{name: hook}`` as returned by :func:`normalize_hooks`.

    Raises:
        InvalidInputError: A method asks for an argument its stage does not offer, or more
            than one hook defines ``train_step``.
    """

    def __init__(self, hooks: Mapping[str, Hook]) -> None:
        self.hooks = dict(hooks)
        self._plans: dict[str, list[_Call]] = {
            stage: [p for p in (_plan(n, h, stage) for n, h in self.hooks.items()) if p]
            for stage in STAGE_ARGUMENTS
        }
        steppers = self._plans.pop("train_step")
        if len(steppers) > 1:
            raise InvalidInputError(
                "at most one hook may define train_step; found it in "
                + ", ".join(repr(p[0]) for p in steppers)
            )
        self.train_step: _Call | None = steppers[0] if steppers else None
        self.current_hook: str | None = None
        per_step = [(stage, name) for stage in ("train_step", *_PER_STEP) for name in self._named(stage)]
        #: Whether a hook asks for a vote after every step by naming ``control`` in a per-step
        #: stage (then the loop combines the ranks' flags after every step; otherwise at the
        #: epoch's end only). Receiving it through ``**kwargs`` does not ask for one.
        self.votes_per_step = any(_names(getattr(self.hooks[name], stage), "control") for stage, name in per_step)

    def __bool__(self) -> bool:
        return bool(self.hooks)

    def _named(self, stage: str) -> list[str]:
        """The hooks that override ``stage``."""
        if stage == "train_step":
            return [self.train_step[0]] if self.train_step is not None else []
        return [name for name, _, _ in self._plans[stage]]

    def has(self, stage: str) -> bool:
        """Whether any hook overrides ``stage``."""
        return bool(self._plans[stage])

    def call(self, stage: str, context: Mapping[str, Any]) -> Any:
        """Calls every hook's ``stage`` method; returns the last non-None return value.
        If one raises, returns what its stage cannot take (``before_train_iter``: a batch,
        ``before_backward``: a loss) or adds to a history entry what a checkpoint cannot
        store, ``current_hook`` names it (numpy values it adds become numbers and tensors).

        Raises:
            UserCodeError: A hook returned a value its stage cannot take, or added one to
                ``metrics`` that a checkpoint cannot store.
        """
        result = None
        plans = self._plans[stage]
        checked, entry = stage in _RETURNS, stage in _ENTRY_STAGES
        index = 0
        try:
            for index, (name, invoke, _) in enumerate(plans):  # noqa: B007 - index names the hook that raises
                value = invoke(context)
                if entry:
                    _check_entry(name, self.hooks[name], stage, context.get("metrics"))
                if value is not None:
                    if checked:
                        _check_return(name, self.hooks[name], stage, value)
                    result = value
        except BaseException:
            self.current_hook = plans[index][0]
            raise
        return result

    def run_train_step(self, context: Mapping[str, Any]) -> Any:
        """Calls the overriding ``train_step`` with the arguments it names; returns the loss or
        ``(loss, outputs)``.

        Raises:
            UserCodeError: It returned something else.
        """
        name, invoke, _ = self.train_step  # type: ignore[misc]
        try:
            value = invoke(context)
            _check_return(name, self.hooks[name], "train_step", value)
            return value
        except BaseException:
            self.current_hook = name
            raise

    def state_dict(self) -> dict[str, dict]:
        """Returns ``{hook name: hook.state_dict()}`` as a checkpoint stores it (see :func:`storable_state`).

        Raises:
            InvalidInputError: A hook's state holds a value a checkpoint cannot store.
        """
        return {name: storable_state(name, hook.state_dict()) for name, hook in self.hooks.items()}

    def load_state_dict(self, states: Mapping[str, dict]) -> None:
        """Loads saved states into the hooks with the same names; others are left alone."""
        for name, hook in self.hooks.items():
            if name in states:
                hook.load_state_dict(states[name])
