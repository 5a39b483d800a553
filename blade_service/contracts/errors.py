"""Typed domain errors every layer raises and catches by type, never by matching message text."""

from __future__ import annotations

MAX_FAULTS_NAMED = 10  # faults one error names, the rest counted: a thousand bad keys or rows stay short


class ContractError(ValueError):
    """An input that breaks the interface contract (a bad parameter, an unknown method or preset)."""


class ParamError(ContractError):
    """An unusable parameter: `field` is its name (e.g. `tau`), `message` what is wrong with it.

    `owner` is the config class the field belongs to (e.g. `BladeConfig`), so `str()` reads
    `BladeConfig.tau: must be float in (0, 1], got 1.5`; the API shows `params.tau: <message>` instead.
    `others`: the further parameters at fault in the same params (ParamErrors); `str()` names them too."""

    def __init__(
        self,
        field: str,
        message: str,
        owner: str = "",
        others: tuple[ParamError, ...] = (),
        unreported: int = 0,
    ):
        self.field = field
        self.message = message
        self.owner = owner
        self.others = others
        self.unreported = unreported  # faults found beyond MAX_FAULTS_NAMED, counted only
        super().__init__(self.describe())

    @classmethod
    def of(cls, faults: list[ParamError]) -> ParamError:
        """One error for several faults (at least one): the first, carrying the next ones up to
        MAX_FAULTS_NAMED in all and the count of the rest."""
        first, *rest = faults
        kept = rest[: MAX_FAULTS_NAMED - 1]
        return cls(first.field, first.message, first.owner, tuple(kept), len(rest) - len(kept))

    def all(self) -> list[ParamError]:
        """This fault and the others, in the order they were found."""
        return [ParamError(self.field, self.message, self.owner), *self.others]

    def describe(self, prefix: str | None = None) -> str:
        """Every fault as `<prefix><field>: <message>`, '; '-joined, then the count of the unnamed ones; the
        prefix defaults to each fault's `Owner.` (the API's is `params.`)."""

        def one(e: ParamError) -> str:
            where = prefix if prefix is not None else f"{e.owner}." if e.owner else ""
            return f"{where}{e.field}: {e.message}"

        more = [f"and {self.unreported} more"] if self.unreported else []
        return "; ".join([one(self), *(one(e) for e in self.others), *more])


class BaseModelUnavailable(FileNotFoundError):
    """The base model (or its tokenizer) could not be loaded from its directory or hub id; the message names
    the reference and the cause. Raised where the engine loads a model, never by training."""
