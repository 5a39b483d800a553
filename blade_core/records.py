"""The dataset record formats live in the torch-free contracts layer (`blade_service/contracts/records.py`);
re-exported here for the engine's modules."""

from __future__ import annotations

from blade_service.contracts.records import (
    PERTURBED_FIELDS,
    QA_FIELDS,
    TEXT_FIELDS,
    DatasetError,
    DatasetKind,
    Row,
    detect_kind,
    load_dataset_rows,
    read_records,
    validate_rows,
)

__all__ = [
    "PERTURBED_FIELDS",
    "QA_FIELDS",
    "TEXT_FIELDS",
    "DatasetError",
    "DatasetKind",
    "Row",
    "detect_kind",
    "load_dataset_rows",
    "read_records",
    "validate_rows",
]
