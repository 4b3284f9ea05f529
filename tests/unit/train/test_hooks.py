import pytest
import torch

from spark_torch_est import Hook
from spark_torch_est.errors import InvalidInputError, UserCodeError
from spark_torch_est.train.hooks import STAGE_ARGUMENTS, HookSet, normalize_hooks


class Recorder(Hook):
    def __init__(self):
        self.calls = []

    def after_train_iter(self, loss, batch_idx):
        self.calls.append((loss, batch_idx))

    def state_dict(self):
        return {"n": len(self.calls)}

    def load_state_dict(self, state):
        self.calls = [None] * state["n"]


class TakesAll(Hook):
    def before_backward(self, **kwargs):
        self.seen = sorted(kwargs)
        return REPLACED


REPLACED = torch.tensor(0.5)


def test_each_method_gets_exactly_the_arguments_it_names():
    hook = Recorder()
    hooks = HookSet({"rec": hook})
    context = {name: name for name in STAGE_ARGUMENTS["after_train_iter"]}
    hooks.call("after_train_iter", context)
    assert hook.calls == [("loss", "batch_idx")]


def test_var_keyword_gets_everything_and_return_value_is_passed_back():
    hook = TakesAll()
    context = {name: 1 for name in STAGE_ARGUMENTS["before_backward"]}
    assert HookSet({"all": hook}).call("before_backward", context) is REPLACED
    assert hook.seen == sorted(STAGE_ARGUMENTS["before_backward"])


def test_stages_not_overridden_are_not_planned():
    hooks = HookSet({"rec": Recorder()})
    assert hooks.has("after_train_iter") and not hooks.has("before_run")


def test_unknown_argument_is_rejected_with_the_valid_names():
    class Typo(Hook):
        def after_train_iter(self, los):
            pass

    with pytest.raises(InvalidInputError) as error:
        HookSet({"typo": Typo()})
    assert "'los'" in str(error.value) and "loss" in str(error.value) and "'typo'" in str(error.value)


def test_batch_is_not_offered_before_the_run():
    class Early(Hook):
        def before_run(self, batch):
            pass

    with pytest.raises(InvalidInputError, match="before_run"):
        HookSet({"early": Early()})


def test_two_train_step_overrides_are_an_error():
    class Step(Hook):
        def train_step(self, model, batch):
            return 0

    with pytest.raises(InvalidInputError, match="at most one hook"):
        HookSet(normalize_hooks([Step(), Step()]))


def test_list_hooks_get_unique_names_and_dict_names_are_kept():
    assert list(normalize_hooks([Recorder(), Recorder()])) == ["Recorder", "Recorder_2"]
    assert list(normalize_hooks({"mine": Recorder()})) == ["mine"]
    with pytest.raises(InvalidInputError, match="Hook instance"):
        normalize_hooks([object()])


def test_state_round_trips_by_name():
    source = HookSet({"rec": Recorder()})
    source.hooks["rec"].calls = [1, 2, 3]
    target = HookSet({"rec": Recorder(), "other": Recorder()})
    target.load_state_dict(source.state_dict())
    assert len(target.hooks["rec"].calls) == 3 and target.hooks["other"].calls == []


def test_ranks_vote_on_stop_flags_every_step_only_when_a_step_stage_names_control():
    class Reads(Hook):
        def after_train_iter(self, loss):
            pass

    class StopsPerStep(Hook):
        def after_train_iter(self, control):
            pass

    class StepsItself(Hook):
        def train_step(self, model, batch, control):
            pass

    class StopsPerEpoch(Hook):
        def after_train_epoch(self, control):
            pass

    class TakesAll(Hook):
        def before_backward(self, **kwargs):
            pass

    class NamesItBesideTheRest(Hook):
        def before_backward(self, control, **kwargs):
            pass

    assert not HookSet({"r": Reads()}).votes_per_step
    assert not HookSet({"e": StopsPerEpoch()}).votes_per_step
    assert not HookSet({"a": TakesAll()}).votes_per_step  # **kwargs alone asks for no vote
    assert HookSet({"s": StopsPerStep()}).votes_per_step
    assert HookSet({"t": StepsItself()}).votes_per_step
    assert HookSet({"a": TakesAll(), "n": NamesItBesideTheRest()}).votes_per_step


def test_a_replacement_of_the_wrong_kind_names_the_hook_its_class_and_stage_and_what_was_expected():
    hooks = HookSet({"first": TakesAll(), "junk": Junk()})
    context = {name: 1 for name in STAGE_ARGUMENTS["before_backward"]}
    with pytest.raises(UserCodeError) as error:
        hooks.call("before_backward", context)
    assert str(error.value).startswith("hook 'junk' (Junk).before_backward() returned a dict with keys 'loss'; "
                                       "expected None or a replacement loss: a tensor holding one value")
    assert hooks.current_hook == "junk"


class Junk(Hook):
    def before_backward(self, loss):
        return {"loss": loss}
