"""Did a run converge? One answer for the API, the dashboard, the CLI and the certificate.

The engine ends a run as `converged` (its convergence test passed), `max_steps` (it hit the step cap without
passing it), or `collapsed`/`cancelled`. A run that stopped at the cap is not a failure (its adapter is
registered), but nothing says the forget objective was met, so it is flagged wherever the request is shown.
"""

from __future__ import annotations


def converged(run_status: str | None) -> bool | None:
    """True for a converged run, False for one that ended otherwise, None while nobody knows yet."""
    if not run_status:
        return None
    return run_status == "converged"


def convergence_note(run_status: str | None, *, steps: int | None, step_cap: int | None) -> str | None:
    """A plain sentence for a run that did not converge (None when it did or has not ended)."""
    if converged(run_status) is not False:
        return None
    if run_status == "max_steps":
        cap = f" of {step_cap}" if step_cap else ""
        return (
            f"Not converged: the run stopped at its step cap{cap} after {steps} outer steps without meeting "
            "its convergence criterion; the forget objective may not have been reached."
        )
    return f"Not converged: the run ended as {run_status!r}."
