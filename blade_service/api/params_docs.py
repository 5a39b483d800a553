"""One schema per method in /openapi.json: the `params` a request may send with each `method`.

The schemas come from the method configs themselves (`contracts.params.params_schema`: type, bounds, default
and help of every tunable field), so the document cannot drift from what `POST /unlearn-requests` accepts.
They are components (`<Config>Params`); the request body's `params` names them per method under
`x-params-schemas`, since which one applies depends on the sibling field `method`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from blade_service.api.openapi_docs import extend_openapi
from blade_service.contracts.methods import CONFIGS, METHOD_NAMES
from blade_service.contracts.params import params_schema

REQUEST_SCHEMA = "UnlearnRequestIn"  # api/schemas.py: the body of POST /unlearn-requests


def component_name(method: str) -> str:
    return f"{CONFIGS[method].__name__}Params"


def _declare(document: dict[str, Any]) -> dict[str, Any]:
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for method in METHOD_NAMES:
        schemas[component_name(method)] = params_schema(method)
    params = schemas.get(REQUEST_SCHEMA, {}).get("properties", {}).get("params")
    if params is not None:
        params["x-params-schemas"] = {
            method: {"$ref": f"#/components/schemas/{component_name(method)}"} for method in METHOD_NAMES
        }
        params["description"] = (
            f"{params.get('description', '')}; the fields of each method are in the schemas named by "
            "x-params-schemas (" + ", ".join(component_name(m) for m in METHOD_NAMES) + ")"
        )
    return document


def install_params_schemas(app: FastAPI) -> None:
    """Wrap `app.openapi` so the document carries every method's params schema."""
    extend_openapi(app, _declare)
