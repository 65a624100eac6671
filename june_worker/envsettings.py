"""One way to read the environment: a pydantic-settings model per process kind, one declared field per variable.

Each variable is a field of an :class:`EnvModel` made with :func:`var`: its name (the field's
``validation_alias``), its type, its default (or what it defaults to, ``default_doc``), a description and what
a value must look like (``expected``). A bad value is one :class:`~june_worker.errors.ConfigError` line naming the
variable, what it was and what is expected; docs/settings.md is generated from the same declarations
(:mod:`june_worker.settings_doc`).

The worker's model is :class:`june_worker.worker.settings.WorkerEnv`, the gateway's
:class:`june_worker.gateway.settings.GatewayEnv` and :class:`june_worker.gateway.slack_settings.SlackEnv`; each
module's frozen dataclass (``WorkerSettings``, ...) is built from its model once, where the process starts.

The rule a reader must not break: **a variable is declared once**, here-shaped, and read nowhere else.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BeforeValidator, Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from .errors import ConfigError

__all__ = ["EnvModel", "comma_list", "var"]

M = TypeVar("M", bound="EnvModel")

_ENV: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar("june_env", default=None)


def var(
    name: str,
    default: Any,
    description: str,
    *,
    expected: str,
    default_doc: str | None = None,
    keep_empty: bool = False,
    secret: bool = False,
    **constraints: Any,
) -> Any:
    """A field read from the variable ``name``.

    ``expected``: what a value must look like (the error message says it); ``default_doc``: the default as the
    table shows it when it is not the value itself (derived from another variable); ``keep_empty``: an empty value
    is validated (and refused) instead of meaning "unset"; ``secret``: never shown (its default is not printed)."""
    extra: dict[str, Any] = {
        "expected": expected,
        "default_doc": default_doc,
        "keep_empty": keep_empty,
        "secret": secret,
    }
    return Field(default, validation_alias=name, description=description, json_schema_extra=extra, **constraints)


def _split(value: Any) -> Any:
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    return value


comma_list = BeforeValidator(_split)
"""A comma-separated list read into a tuple of its stripped, non-empty parts."""


class _MappingSource(PydanticBaseSettingsSource):
    """The model's variables from a mapping (``os.environ``, or the one a caller passes): raw strings, validated by
    the model. An empty value means unset, unless its field keeps empty values (or the model refuses them)."""

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str]) -> None:
        super().__init__(settings_cls)
        self._env = env

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        alias = str(field.validation_alias)
        return self._env.get(alias), alias, False

    def __call__(self) -> dict[str, Any]:
        model: Any = self.settings_cls
        out: dict[str, Any] = {}
        for field in model.model_fields.values():
            alias = str(field.validation_alias)
            raw = self._env.get(alias)
            if raw is None:
                continue
            if not raw.strip() and not (field.json_schema_extra or {}).get("keep_empty"):
                if model.empty == "error":
                    raise ConfigError(f"{alias} is set but empty; unset it for the default or give a value")
                continue
            out[alias] = raw
        return out


class EnvModel(BaseSettings):
    """A process's variables; build one with :meth:`load`."""

    model_config = SettingsConfigDict(case_sensitive=True, extra="ignore", frozen=True)

    empty: ClassVar[Literal["unset", "error"]] = "unset"
    """What a variable set to an empty value means: its default, or a configuration error."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        env = _ENV.get()
        return (init_settings, _MappingSource(settings_cls, os.environ if env is None else env))

    @classmethod
    def load(cls: type[M], env: Mapping[str, str] | None = None) -> M:
        """The variables of ``env`` (``os.environ`` by default); a bad one is a one-line :class:`ConfigError`."""
        token = _ENV.set(env)
        try:
            return cls()
        except ValidationError as exc:
            raise ConfigError(cls._one_line(exc, os.environ if env is None else env)) from None
        finally:
            _ENV.reset(token)

    @classmethod
    def _one_line(cls, exc: ValidationError, env: Mapping[str, str]) -> str:
        error = exc.errors()[0]
        alias = str(error["loc"][0]) if error["loc"] else ""
        field = next((f for f in cls.model_fields.values() if f.validation_alias == alias), None)
        if field is None:
            return str(error["msg"])
        extra: Any = field.json_schema_extra or {}
        shown = "(hidden)" if extra.get("secret") else repr(env.get(alias, ""))
        ctx = error.get("ctx") or {}
        if error["type"] == "greater_than_equal":
            return f"{alias} must be at least {ctx['ge']:g}, not {env.get(alias, '').strip()}"
        return f"{alias}={shown}: expected {extra['expected']}"

    @classmethod
    def variables(cls) -> list[tuple[str, FieldInfo]]:
        """(variable, field) for each declared variable, in declaration order."""
        return [(str(f.validation_alias), f) for f in cls.model_fields.values()]
