"""Did a run converge? One answer for the API, the dashboard, the CLI and the certificate.

The engine ends a run as `converged` (its convergence test passed), `max_steps` (it hit the step cap without
passing it), or `collapsed`/`cancelled`. A run that stopped at the cap is not a failure (its adapter is
registered), but nothing says the forget objective was met, so it is flagged wherever the request is shown.
Only BLADE has a convergence test; a baseline that ran its published schedule to its end is not flagged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def has_stop_rule(method: str | None, params: Mapping[str, Any] | None) -> bool:
    """Whether the run tests for convergence: BLADE's reference stop, unless the request turned `early_stop`
    off. The baselines have no such test: they run their published schedule (or `max_steps`) to its end."""
    return method == "blade" and (params or {}).get("early_stop", True) is not False


def converged(run_status: str | None, *, method: str | None, params: Mapping[str, Any] | None) -> bool | None:
    """True for a converged run, False for one with a convergence test that ended otherwise, None while
    nobody knows yet and for a run without a test that ran its schedule to its end (`has_stop_rule`)."""
    if not run_status:
        return None
    if run_status == "max_steps" and not has_stop_rule(method, params):
        return None
    return run_status == "converged"


def convergence_note(
    run_status: str | None,
    *,
    method: str | None,
    params: Mapping[str, Any] | None,
    steps: int | None,
    step_cap: int | None,
) -> str | None:
    """A plain sentence for a run that did not converge, or that has no convergence test (None when it
    converged or has not ended)."""
    if run_status == "max_steps" and not has_stop_rule(method, params):
        return f"No convergence test: {method} ran its fixed schedule of {steps} steps to its end."
    if converged(run_status, method=method, params=params) is not False:
        return None
    if run_status == "max_steps":
        cap = f" of {step_cap}" if step_cap else ""
        return (
            f"Not converged: the run stopped at its step cap{cap} after {steps} outer steps without meeting "
            "its convergence criterion; the forget metrics after the run say how much it forgot."
        )
    return f"Not converged: the run ended as {run_status!r}."
