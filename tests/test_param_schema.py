"""The API's parameter table (`contracts.params.describe`) against the engine's config dataclasses."""

from __future__ import annotations

import dataclasses

import pytest

from blade_core.methods import METHOD_NAMES, get_method
from blade_service.contracts.errors import ParamError
from blade_service.contracts.methods import NOT_TUNABLE
from blade_service.contracts.params import describe, validate_params

METHOD_PARAMS = {name: describe(name) for name in METHOD_NAMES}


def test_every_method_has_a_schema():
    assert set(METHOD_PARAMS) == set(METHOD_NAMES)


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_schema_matches_engine_config(method):
    config_class = get_method(method).config_class
    fields = {f.name for f in dataclasses.fields(config_class)} - NOT_TUNABLE
    assert set(METHOD_PARAMS[method]) == fields
    defaults = {
        f.name: getattr(config_class(), f.name)
        for f in dataclasses.fields(config_class)
        if f.name not in NOT_TUNABLE
    }
    defaults = {k: list(v) if isinstance(v, tuple) else v for k, v in defaults.items()}
    assert validate_params(method, defaults) == defaults  # every default is inside its declared range


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"tau": 0}, "tau"),
        ({"tau": 1.5}, "tau"),
        ({"max_steps": 0}, "max_steps"),
        ({"max_steps": 2.5}, "max_steps"),
        ({"max_steps": True}, "max_steps"),
        ({"eps_mul": "big"}, "eps_mul"),
        ({"eps_mul": float("nan")}, "eps_mul"),
        ({"no_such_field": 1}, "no_such_field"),
        ({"forget_tokens": "some"}, "forget_tokens"),
        ({"lambda0": 0.05}, "lambda0"),
        ({"use_lora": 1}, "use_lora"),
    ],
)
def test_bad_params_name_the_field(params, field):
    with pytest.raises(ParamError) as info:
        validate_params("blade", params)
    assert info.value.field == field


def test_every_field_at_fault_is_named_the_first_as_the_field():
    with pytest.raises(ParamError) as info:
        validate_params("npo", {"beta": "x", "nope": 1, "gamma": None})
    assert info.value.field == "beta"
    assert [e.field for e in info.value.all()] == ["beta", "nope", "gamma"]
    assert str(info.value).count("NPOConfig.") == 3


def test_good_params_pass_and_ints_normalise():
    assert validate_params("blade", {"max_steps": 5.0, "tau": 0.6, "epsilon": None}) == {
        "max_steps": 5,
        "tau": 0.6,
        "epsilon": None,
    }
    assert validate_params("npo", None) == {}
    with pytest.raises(ParamError) as info:
        validate_params("nope", {})
    assert info.value.field == "method"
