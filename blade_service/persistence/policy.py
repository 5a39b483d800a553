"""The unlearning policy of a base model: the gate an adapter passes before it goes live.

After training, the worker measures the candidate stack (the effective model plus the new adapter) against
the effective model on a canary set, and the forget set after the request, and `evaluate` applies the rules:

| rule | passes when | default |
| --- | --- | --- |
| `min_retain_prob_ratio` | canary Prob after / before ≥ limit | 0.5 |
| `min_retain_rouge_ratio` | canary ROUGE-L after / before ≥ limit | 0.5 |
| `max_forget_prob` | forget Prob after ≤ limit | null (off) |
| `max_forget_rouge` | forget ROUGE-L after ≤ limit | null (off) |
| `max_mia_auc_gap` | the loss MIA AUC after (forget vs reference rows) within limit of 0.5 | null (off) |

Why these defaults: halving retained utility is the collapse the BLADE paper reports for the baselines under
sequential requests (HM 0.58 -> 0.02); healthy runs keep retain Prob/ROUGE within a few percent (the demo
request: 0.90/0.97). What counts as "forgotten" depends on the data (a fact the base model half-knew from
pre-training), so the forget limits are off until an operator sets them per model. The MIA rule reads the
request's loss attack after training (forget rows against the holdout, else the retain sample): an AUC far
from 0.5 either way tells an attacker which rows were the forget set, too well remembered (near 1) or
forgotten past the model's other rows (near 0, the over-unlearning the demo's BLADE request shows: 0.008).
Off by default, as a memorised world's forget and retain rows read alike before unlearning and far apart
after almost any run that forgets.

The canary set is the base model's `canary_dataset_id` when registered (measured before and after on the
same rows), else the request's own retain sample (the before/after metrics). A failing adapter is stored
disabled, its request ends `rejected` with the verdict in `request.gate`; an admin may enable it anyway with
a reason (`registry.enable` records the override in the gate and the audit log).
"""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy.orm import Session

from blade_service.contracts.params import finite_number
from blade_service.persistence import audit
from blade_service.persistence.errors import Invalid
from blade_service.persistence.models import BaseModel, Dataset

# rule -> (default, kind): "min_ratio" compares canary after/before, "max" compares forget after, "max_gap"
# the MIA AUC's distance from chance
RULES: dict[str, tuple[float | None, str]] = {
    "min_retain_prob_ratio": (0.5, "min_ratio"),
    "min_retain_rouge_ratio": (0.5, "min_ratio"),
    "max_forget_prob": (None, "max"),
    "max_forget_rouge": (None, "max"),
    "max_mia_auc_gap": (None, "max_gap"),
}
_UPPER = {"min_ratio": 10.0, "max": 1.0, "max_gap": 0.5}  # the largest limit each kind can mean
DEFAULT_POLICY: dict[str, Any] = {"enabled": True, **{rule: default for rule, (default, _) in RULES.items()}}
_FIGURE = {  # rule -> the figure it reads: of the canary metrics (ratios), forget metrics (max), MIA (gap)
    "min_retain_prob_ratio": "Prob",
    "min_retain_rouge_ratio": "ROUGE",
    "max_forget_prob": "Prob",
    "max_forget_rouge": "ROUGE",
    "max_mia_auc_gap": "auc",
}


def parse(raw: dict[str, Any] | None) -> dict[str, Any]:
    """The full policy: defaults overlaid with `raw` (validated; Invalid names the bad field)."""
    if raw is None:
        return dict(DEFAULT_POLICY)
    if not isinstance(raw, dict):
        raise Invalid("policy: must be an object", field="policy")
    policy = dict(DEFAULT_POLICY)
    for name, value in raw.items():
        if name == "enabled":
            if not isinstance(value, bool):
                raise Invalid("policy.enabled: must be true or false", field="policy.enabled")
            policy[name] = value
            continue
        if name not in RULES:
            known = ", ".join(["enabled", *RULES])
            raise Invalid(f"policy.{name}: unknown rule (known: {known})", field=f"policy.{name}")
        if value is not None:
            upper = _UPPER[RULES[name][1]]
            if not finite_number(value) or not 0.0 <= float(value) <= upper:
                raise Invalid(
                    f"policy.{name}: must be null or a number in [0, {upper:g}], got {value!r:.60}",
                    field=f"policy.{name}",
                )
            value = float(value)
        policy[name] = value
    return policy


def effective(model: BaseModel) -> dict[str, Any]:
    return parse(model.policy)


def _ratio(after: float | None, before: float | None) -> float | None:
    if after is None or before is None or (isinstance(after, float) and math.isnan(after)):
        return None
    if before <= 0:
        return 1.0 if after >= before else 0.0
    return after / before


def evaluate(
    policy: dict[str, Any],
    *,
    canary_before: dict[str, Any],
    canary_after: dict[str, Any],
    forget_after: dict[str, Any],
    canary_source: str,
    mia_after: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The gate's verdict: {"passed", "failed": [rules], "rules": [{rule, limit, value, passed}], ...}.
    `mia_after`: the request's `mia` block after training ({"auc", ...}); without it the MIA rule cannot
    fail."""
    rules, failed = [], []
    for rule, (_, kind) in RULES.items():
        limit = policy.get(rule)
        figure = _FIGURE[rule]
        if kind == "min_ratio":
            value = _ratio(canary_after.get(figure), canary_before.get(figure))
            before, after = canary_before.get(figure), canary_after.get(figure)
        elif kind == "max_gap":
            after = (mia_after or {}).get(figure)
            value, before = None, None
            if isinstance(after, int | float) and math.isfinite(after):
                value = abs(after - 0.5)
        else:
            value, before, after = forget_after.get(figure), None, forget_after.get(figure)
        if limit is None or not policy.get("enabled", True):
            ok = None  # not enforced
        elif value is None:
            ok = True  # nothing measurable (e.g. no text to continue): the rule cannot fail
        else:
            ok = value >= limit if kind == "min_ratio" else value <= limit
        if ok is False:
            failed.append(rule)
        rules.append(
            {"rule": rule, "limit": limit, "value": value, "before": before, "after": after, "passed": ok}
        )
    return {
        "passed": not failed,
        "failed": failed,
        "rules": rules,
        "policy": policy,
        "canary": canary_source,
    }


def failure_message(verdict: dict[str, Any]) -> str:
    """One line naming each failed rule with its measured value and limit."""
    parts = []
    for r in verdict["rules"]:
        if r["passed"] is not False:
            continue
        if r["rule"].startswith("earlier_forget_kept:"):  # a retrain's check (worker/stacks.py)
            b, a = r["before"], r["after"]
            parts.append(
                f"{r['rule']}: remembered again (Prob {b['Prob']:.3f} -> {a['Prob']:.3f}, "
                f"ROUGE {b['ROUGE']:.3f} -> {a['ROUGE']:.3f})"
            )
            continue
        op = "<" if r["rule"].startswith("min_") else ">"
        parts.append(f"{r['rule']}: measured {r['value']:.4f} {op} limit {r['limit']:g}")
    return "held back by the base model's policy: " + "; ".join(parts)


def check_canary(session: Session, *, dataset_id: str | None, tenant_id: str | None) -> Dataset | None:
    """The canary dataset if it exists and the caller may use it (NotFound-style Invalid otherwise)."""
    if dataset_id is None:
        return None
    dataset = session.get(Dataset, dataset_id)
    if dataset is None or (tenant_id is not None and dataset.tenant_id != tenant_id):
        raise Invalid(f"canary_dataset: no dataset {dataset_id!r}", field="canary_dataset")
    if getattr(dataset, "purged_at", None) is not None:
        raise Invalid(f"canary_dataset: dataset {dataset_id} has been purged", field="canary_dataset")
    return dataset


def set_policy(
    session: Session,
    *,
    model: BaseModel,
    policy: dict[str, Any] | None,
    canary_dataset_id: str | None,
    clear_canary: bool = False,
    reason: str | None,
    actor: str,
    actor_key_id: str | None = None,
    tenant_id: str | None = None,
) -> BaseModel:
    """Change a base model's policy and/or canary set (admin), audited with the old and new values."""
    if not reason or not reason.strip():
        raise Invalid("reason: a reason is required for a policy change", field="reason")
    old = {"policy": effective(model), "canary_dataset": model.canary_dataset_id}
    if policy is not None:
        model.policy = {k: v for k, v in parse({**(model.policy or {}), **policy}).items()}
    if canary_dataset_id is not None:
        canary = check_canary(session, dataset_id=canary_dataset_id, tenant_id=tenant_id)
        model.canary_dataset_id = canary.id if canary is not None else None
    elif clear_canary:
        model.canary_dataset_id = None
    session.flush()
    audit.append(
        session,
        action="base_model.policy",
        subject_type="base_model",
        subject_id=model.id,
        actor=actor,
        actor_key_id=actor_key_id,
        tenant_id=tenant_id,
        reason=reason.strip(),
        data={
            "name": model.name,
            "old": old,
            "new": {"policy": effective(model), "canary_dataset": model.canary_dataset_id},
        },
    )
    return model
