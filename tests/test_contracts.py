"""The contracts layer: a method's parameter is declared once (blade_service/contracts/methods), every entry
point follows.

For every field of every method: the API's validator and `blade unlearn --set` accept it with the same type
coercion and give the same error for an out-of-range value; a field added to a config class reaches the API,
the CLI and the OpenAPI schema with no other edit; the engine runs the contracts' classes; nothing in
`contracts` loads torch.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Annotated, Any

import pytest
from pydantic import Field
from pydantic.dataclasses import dataclass

from blade_service.cli.unlearn import parse_overrides
from blade_service.contracts.errors import ParamError
from blade_service.contracts.methods import CONFIGS, METHOD_NAMES, BladeConfig
from blade_service.contracts.methods.base import CONFIG
from blade_service.contracts.params import (
    _kind,
    describe,
    make_config,
    params_schema,
    tunable_fields,
    validate_params,
)

FIELDS = [(method, name) for method in METHOD_NAMES for name in tunable_fields(CONFIGS[method])]


def _bounds(method: str, name: str) -> dict[str, Any]:
    return params_schema(method)["properties"][name]


def _other_value(method: str, name: str) -> Any:
    """A valid JSON value for the field that differs from its default."""
    info = tunable_fields(CONFIGS[method])[name]
    kind, _, choices = _kind(info)
    default = info.default
    if choices:
        return next(c for c in choices if c != default)
    if kind == "bool":
        return not default
    if kind == "str_list":
        return ["q_proj", "v_proj"]
    if kind == "str":
        return "mlp.up_proj"
    if default is None:
        return 3 if kind == "int" else 0.5
    if kind == "int":
        return default + 1
    return default / 2 if default else 0.5


def _as_text(value: Any) -> str:
    """How a user writes the value after `--set name=`."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(value)
    return "none" if value is None else str(value)


def _cli_config(method: str, name: str, text: str) -> Any:
    from blade_core.unlearn import build_config

    return build_config(method, overrides=parse_overrides([f"{name}={text}"]))


@pytest.mark.parametrize(("method", "name"), FIELDS)
def test_every_field_is_accepted_by_the_api_and_by_set_alike(method, name):
    value = _other_value(method, name)
    assert validate_params(method, {name: value}) == {name: value}
    config = _cli_config(method, name, _as_text(value))
    assert getattr(config, name) == (tuple(value) if isinstance(value, list) else value)
    assert name in params_schema(method)["properties"] and name in describe(method)


def _out_of_range(method: str, name: str) -> Any | None:
    prop = _bounds(method, name)
    prop = next((p for p in prop.get("anyOf", [prop]) if p.get("type") in ("integer", "number")), prop)
    if "maximum" in prop:
        return prop["maximum"] * 10 + 1
    if "exclusiveMaximum" in prop:
        return prop["exclusiveMaximum"]
    return None


NUMERIC = [(m, n) for m, n in FIELDS if _out_of_range(m, n) is not None]


@pytest.mark.parametrize(("method", "name"), NUMERIC)
def test_an_out_of_range_value_is_the_same_error_from_the_api_and_from_set(method, name):
    value = _out_of_range(method, name)
    with pytest.raises(ParamError) as api:
        validate_params(method, {name: value})
    with pytest.raises(ParamError) as cli:
        _cli_config(method, name, _as_text(value))
    assert (
        (api.value.field, api.value.message)
        == (cli.value.field, cli.value.message)
        == (
            name,
            api.value.message,
        )
    )
    assert repr(value) in api.value.message or str(value) in api.value.message


@pytest.mark.parametrize(("method", "name"), NUMERIC)
def test_a_word_for_a_number_is_the_same_error_from_both(method, name):
    with pytest.raises(ParamError) as api:
        validate_params(method, {name: "lots"})
    with pytest.raises(ParamError) as cli:
        _cli_config(method, name, "lots")
    assert (api.value.field, api.value.message) == (cli.value.field, cli.value.message)
    assert "'lots'" in api.value.message


def test_only_json_types_reach_the_api_while_set_reads_text():
    with pytest.raises(ParamError, match="true or false"):
        validate_params("blade", {"early_stop": "false"})  # a JSON string is not a boolean
    with pytest.raises(ParamError, match="int in"):
        validate_params("blade", {"max_steps": True})
    assert _cli_config("blade", "early_stop", "off").early_stop is False
    assert _cli_config("blade", "max_steps", "40").max_steps == 40


def test_a_field_added_to_a_config_class_reaches_every_entry_point(monkeypatch):
    @dataclass(config=CONFIG)
    class WithKnob(BladeConfig):
        knob: Annotated[float, Field(gt=0, le=2, description="a new hyperparameter")] = 1.0  # test only

    monkeypatch.setitem(CONFIGS, "blade", WithKnob)
    assert validate_params("blade", {"knob": 1.5}) == {"knob": 1.5}
    assert make_config("blade", overrides={"knob": "0.25"}).knob == 0.25  # type: ignore[attr-defined]
    assert params_schema("blade")["properties"]["knob"]["description"] == "a new hyperparameter"
    assert describe("blade")["knob"]["range"] == "float in (0, 2]"
    for bad in ({"knob": 3}, {"knob": 0}):
        with pytest.raises(ParamError) as api:
            validate_params("blade", bad)
        with pytest.raises(ParamError) as cli:
            make_config("blade", overrides={"knob": str(bad["knob"])})
        assert api.value.message == cli.value.message == f"must be float in (0, 2], got {bad['knob']}"


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_the_engine_runs_the_contracts_classes(method):
    from blade_core.methods import get_method

    engine = get_method(method).config_class
    assert issubclass(engine, CONFIGS[method])  # RMU's adds only `lora_targets`, which needs the model
    assert [f.name for f in dataclasses.fields(engine)] == [
        f.name for f in dataclasses.fields(CONFIGS[method])
    ]


def test_the_blade_cross_check_names_the_field_everywhere():
    with pytest.raises(ParamError) as api:
        validate_params("blade", {"lambda0": 0.05})
    with pytest.raises(ParamError) as cli:
        _cli_config("blade", "lambda0", "0.05")
    assert api.value.field == cli.value.field == "lambda0"
    assert api.value.message == cli.value.message == "must be >= lambda_min (0.1), got 0.05"


def test_contracts_load_no_torch_and_the_worker_names_are_theirs():
    code = (
        "import sys\n"
        "from blade_service.contracts import errors, names, params\n"
        "assert not {'torch', 'transformers', 'peft', 'blade_core'} & set(sys.modules), sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    from blade_service.contracts import names as contract_names
    from blade_service.worker import reconcile_task, unlearn_task

    assert unlearn_task.TaskName is contract_names.TaskName is reconcile_task.TaskName


def test_the_openapi_document_has_one_params_schema_per_method(tmp_path):
    from fastapi.testclient import TestClient
    from openapi_spec_validator import validate

    from blade_service.api.main import create_app
    from blade_service.persistence.settings import Settings

    doc = TestClient(create_app(Settings(data_dir=tmp_path))).get("/openapi.json").json()
    validate(doc)
    schemas = doc["components"]["schemas"]
    refs = schemas["UnlearnRequestIn"]["properties"]["params"]["x-params-schemas"]
    assert set(refs) == set(METHOD_NAMES)
    for method, ref in refs.items():
        schema = schemas[ref["$ref"].rsplit("/", 1)[1]]
        assert set(schema["properties"]) == set(tunable_fields(CONFIGS[method]))
    assert schemas["BladeConfigParams"]["properties"]["tau"]["exclusiveMinimum"] == 0
    assert "show_progress" not in schemas["NPOConfigParams"]["properties"]


def test_blade_submit_set_reads_values_as_blade_unlearn_set_does():
    from blade_service.cli.client_verbs import _parse_sets

    items = [
        "lambda_max=none",
        "lora_target_modules=q_proj,v_proj",
        "early_stop=off",
        "max_steps=60",
        "tau=0.6",
    ]
    params = _parse_sets(items, "blade")
    assert params == {
        "lambda_max": None,
        "lora_target_modules": ["q_proj", "v_proj"],
        "early_stop": False,
        "max_steps": 60,
        "tau": 0.6,
    }
    assert validate_params("blade", params) == params  # what the API then accepts
    config = make_config("blade", overrides=parse_overrides(items))  # what `blade unlearn --set` builds
    assert {k: getattr(config, k) for k in params} == {**params, "lora_target_modules": ("q_proj", "v_proj")}
    assert _parse_sets(['metadata_key={"a": 1}']) == {"metadata_key": {"a": 1}}  # no method: JSON as before
