"""The base of every manifest model: frozen, unknown members refused, except in a newer minor.

Every pydantic model of the manifest (:mod:`ucformat.format.models` and the optional sections of
:mod:`~ucformat.format.megatron`, :mod:`~ucformat.format.pipeline`,
:mod:`~ucformat.format.experts`, :mod:`~ucformat.format.tensor_parallel`) derives from
:class:`ManifestModel`, so the forward-compatibility rule of docs/format.md §5 holds at every
level: a manifest of a newer minor version is validated with :data:`IGNORE_UNKNOWN` as context,
and members this reader does not know are dropped (they were digested before).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, model_validator

__all__ = ["IGNORE_UNKNOWN", "ManifestModel"]

#: Validation context for a manifest of a newer minor version: unknown members are ignored.
IGNORE_UNKNOWN: dict[str, bool] = {"ignore_unknown_members": True}


class ManifestModel(BaseModel):
    """Frozen; unknown members refused unless the context is :data:`IGNORE_UNKNOWN`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_unknown_members(cls, data: Any, info: ValidationInfo) -> Any:
        context = info.context
        if (
            isinstance(data, dict)
            and isinstance(context, dict)
            and context.get("ignore_unknown_members")
        ):
            known = {field.alias or name for name, field in cls.model_fields.items()}
            return {key: value for key, value in data.items() if key in known}
        return data
