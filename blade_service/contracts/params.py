"""One validator for a method's parameters, whoever sets them: the API (`params`, JSON values), `blade unlearn
--set key=value` (text) and the engine (`build_config`: defaults <- preset <- overrides).

Text is first read as the field's JSON type (`"0.6"` -> 0.6, `"none"` -> null, `"q,v"` -> a list); from there
both paths share the same type check (a JSON boolean is not a number, 5.0 is the integer 5) and the same model
(`contracts.methods`: bounds, cross-field checks), so they accept the same values and give the same
`ParamError` (field, message) for a bad one.

    validate_params("blade", {"max_steps": 50, "tau": 0.6})  # -> the params; ParamError naming the field
    make_config("blade", preset="muse", overrides={"tau": "0.6"})  # -> BladeConfig
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

import annotated_types
from pydantic import TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from blade_service.contracts.errors import ParamError
from blade_service.contracts.methods import CONFIGS, NOT_TUNABLE, PRESETS, MethodConfig, check_method

Kind = Literal["int", "float", "bool", "str", "str_list"]
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
NULL_WORDS = ("none", "null", "")


def tunable_fields(config_class: type[MethodConfig]) -> dict[str, FieldInfo]:
    """The fields a client may set, by name, with their pydantic field info (type, bounds, help)."""
    fields: dict[str, FieldInfo] = config_class.__pydantic_fields__  # type: ignore[attr-defined]
    return {name: info for name, info in fields.items() if name not in NOT_TUNABLE}


def _kind(info: FieldInfo) -> tuple[Kind, bool, tuple[str, ...]]:
    """(JSON kind, nullable, choices) of a field's annotation."""
    annotation, nullable = info.annotation, False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation, nullable = args[0], True
    if typing.get_origin(annotation) is Literal:
        return "str", nullable, tuple(typing.get_args(annotation))
    if typing.get_origin(annotation) is tuple:
        return "str_list", nullable, ()
    kinds: dict[Any, Kind] = {bool: "bool", int: "int", float: "float", str: "str"}
    return kinds[annotation], nullable, ()


def describe_field(info: FieldInfo) -> str:
    """What a field accepts, in words: `float in (0, 1]`, `one of all, answer`, `true or false`."""
    kind, nullable, choices = _kind(info)
    low: Any = None
    high: Any = None
    low_open = high_open = False
    for m in info.metadata:
        if isinstance(m, annotated_types.Gt | annotated_types.Ge):
            low, low_open = (m.gt, True) if isinstance(m, annotated_types.Gt) else (m.ge, False)
        elif isinstance(m, annotated_types.Lt | annotated_types.Le):
            high, high_open = (m.lt, True) if isinstance(m, annotated_types.Lt) else (m.le, False)
    if choices:
        text = "one of " + ", ".join(choices)
    elif kind in ("int", "float") and (low is not None or high is not None):
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        text = f"{kind} in {'(' if low_open else '['}{lo}, {hi}{')' if high_open else ']'}"
    else:
        text = {"bool": "true or false", "str_list": "a non-empty list of strings", "str": "a string"}.get(
            kind, kind
        )
    return f"{text} (or null)" if nullable else text


def from_text(info: FieldInfo, value: Any) -> Any:
    """A `--set` string as the field's JSON type; anything it cannot read stays as given (the type check
    then names it). Non-strings pass through."""
    if not isinstance(value, str):
        return value
    kind, nullable, _ = _kind(info)
    word = value.strip().lower()
    if nullable and word in NULL_WORDS:
        return None
    if kind == "bool" and word in TRUE_WORDS + FALSE_WORDS:
        return word in TRUE_WORDS
    if kind == "str_list":
        return [v.strip() for v in value.split(",") if v.strip()]
    if kind in ("int", "float"):
        for parse in (int, float):
            try:
                return parse(value.strip())
            except ValueError:
                continue
    return value


def finite_number(value: Any) -> bool:
    """A JSON number a float can hold: not a bool, NaN or an infinity, nor an integer beyond float's range
    (JSON allows any number of digits, and float() of a 400-digit integer raises OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_type(name: str, info: FieldInfo, value: Any, owner: str) -> Any:
    """`value` if it has the field's JSON type (ints given as 5.0 become 5, lists of strings stay lists);
    ParamError otherwise. Bounds are the model's to check."""
    kind, nullable, _ = _kind(info)

    def bad(what: str | None = None) -> ParamError:
        expected = what or describe_field(info)
        if isinstance(value, str) and kind not in ("str", "str_list"):  # a word where a number belongs
            return ParamError(name, f"cannot use {value!r:.60}: must be {expected}", owner)
        return ParamError(name, f"must be {expected}, got {value!r:.60}", owner)

    if value is None:
        if nullable:
            return None
        raise bad()
    if kind == "bool":
        if not isinstance(value, bool):
            raise bad()
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise bad()
        return value
    if kind == "str_list":
        if (
            not isinstance(value, list | tuple)
            or not value
            or not all(isinstance(v, str) and v for v in value)
        ):
            raise bad()
        return list(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad()
    if not finite_number(value):
        raise bad("a finite number")
    if kind == "int":
        if isinstance(value, float) and not value.is_integer():
            raise bad("an integer")
        return int(value)
    return value


def _build(config_class: type[MethodConfig], values: Mapping[str, Any]) -> MethodConfig:
    """The config from already type-checked values; bounds and cross checks as a ParamError."""
    owner = config_class.__name__
    try:
        return config_class(**values)
    except ValidationError as exc:
        fields = config_class.__pydantic_fields__  # type: ignore[attr-defined]
        faults = []
        for error in exc.errors():
            cause = (error.get("ctx") or {}).get("error")
            if isinstance(cause, ParamError):  # a check across fields, which has its own words
                faults.append(cause)
                continue
            name = str(error["loc"][0]) if error["loc"] else "params"
            value = values.get(name, error.get("input"))
            what = describe_field(fields[name]) if name in fields else error["msg"]
            faults.append(ParamError(name, f"must be {what}, got {value!r:.60}", owner))
        raise ParamError.of(faults) from None


def check_params(
    method: str,
    params: Mapping[str, Any] | None,
    *,
    text: bool = False,
    config_class: type[MethodConfig] | None = None,
    internal: bool = False,
) -> dict[str, Any]:
    """`params` checked against the method's config (`text`: values may be `--set` strings): JSON values,
    ints normalised; ParamError naming the field (`internal`: the engine's callers may also set the fields
    NOT_TUNABLE lists, e.g. show_progress). The checks that need every field (BLADE's lambda0 >=
    lambda_min) see the defaults for the fields not given."""
    config_class = config_class or CONFIGS[check_method(method)]
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise ParamError("params", "must be an object mapping config field names to values")
    fields = tunable_fields(config_class)
    if internal:
        fields = dict(config_class.__pydantic_fields__)  # type: ignore[attr-defined]
    owner = config_class.__name__
    checked: dict[str, Any] = {}
    faults: list[ParamError] = []  # every field's, so one answer names them all
    known = "; known: " + ", ".join(sorted(fields))  # said with the first unknown name only
    for name, value in params.items():
        if name not in fields:
            faults.append(
                ParamError(
                    name,
                    f"unknown parameter {name!r} for method {method!r} (value {value!r:.60}){known}",
                    owner,
                )
            )
            known = ""
            continue
        try:
            checked[name] = check_type(
                name, fields[name], from_text(fields[name], value) if text else value, owner
            )
        except ParamError as exc:
            faults.append(exc)
    if faults:
        raise ParamError.of(faults)
    _build(config_class, checked)  # the checks across fields, once each field is usable
    return checked


def validate_params(method: str, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """A request's `params` (JSON values) for `method`, checked; ParamError naming the field."""
    return check_params(method, params)


def make_config(
    method: str,
    *,
    preset: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    max_steps: int | None = None,
    seed: int | None = None,
    config_class: type[MethodConfig] | None = None,
) -> MethodConfig:
    """The method's config: defaults <- preset <- overrides (JSON or `--set` strings) <- max_steps/seed.

    `config_class` is the engine's class when it extends the contract's with torch-side methods (RMU)."""
    config_class = config_class or CONFIGS[check_method(method)]
    values: dict[str, Any] = {}
    if preset is not None:
        presets = PRESETS[method]
        if preset not in presets:
            raise ParamError(
                "preset",
                f"unknown preset {preset!r} for method {method!r}; "
                f"choose one of: {', '.join(presets) or 'none'}",
            )
        values.update(presets[preset])
    values.update(overrides or {})
    if max_steps is not None:
        values["max_steps"] = max_steps
    if seed is not None:
        values["seed"] = seed
    return _build(
        config_class, check_params(method, values, text=True, config_class=config_class, internal=True)
    )


def params_schema(method: str) -> dict[str, Any]:
    """The JSON schema of a method's `params`: every tunable field with its type, bounds, default, help."""
    config_class = CONFIGS[check_method(method)]
    schema = TypeAdapter(config_class).json_schema()
    for name in NOT_TUNABLE:
        schema.get("properties", {}).pop(name, None)
    schema["title"] = f"{config_class.__name__} params"
    return schema


def describe(method: str) -> dict[str, dict[str, Any]]:
    """The method's tunable fields as JSON-ready descriptions (for docs and error messages)."""
    return {
        name: {
            "type": _kind(info)[0],
            "range": describe_field(info),
            "nullable": _kind(info)[1],
            "help": info.description or "",
        }
        for name, info in tunable_fields(CONFIGS[check_method(method)]).items()
    }
