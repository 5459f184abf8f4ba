"""The admin's base classes, for the admins of both apps.

`GuardedAdmin` keeps a model's secrets in: they are never rendered as a value and no changelist
filters on them, through a relation either. `ReadOnlyAdmin` is for rows the gateway writes:
operators read them, never edit them.
"""

from __future__ import annotations

from typing import Any, TypeVar

from django.contrib import admin
from django.contrib.admin import AdminSite
from django.contrib.admin.exceptions import NotRegistered
from django.core import checks
from django.core.exceptions import FieldDoesNotExist
from django.db.models import Model
from django.db.models.constants import LOOKUP_SEP
from django.http import HttpRequest

__all__ = ["GuardedAdmin", "reaches_secret", "ReadOnlyAdmin", "secrets_of"]

_M = TypeVar("_M", bound=Model)


def secrets_of(site: AdminSite, model: type[Model]) -> tuple[str, ...]:
    """The secret fields of `model`, as its admin on `site` declares them (none if unregistered)."""
    try:
        model_admin = site.get_model_admin(model)
    except NotRegistered:
        return ()
    return tuple(getattr(model_admin, "secret_fields", ()))


def reaches_secret(site: AdminSite, model: type[Model], lookup: str) -> bool:
    """Whether the lookup path (`pool__handoff_signing_key__startswith`) names a secret field of
    `model` or of any model it reaches through relations."""
    for part in lookup.split(LOOKUP_SEP):
        if part in secrets_of(site, model):
            return True
        try:
            field = model._meta.get_field(part)
        except FieldDoesNotExist:
            return False  # a transform or lookup (`startswith`): the path ends here
        related = field.related_model
        if related is None or isinstance(related, str):
            return False
        model = related
    return False


class GuardedAdmin(admin.ModelAdmin[_M]):
    """A model admin that keeps its model's secrets in.

    `secret_fields` are never rendered as a value: to a user who may change the object they are at
    most a write-only input (its form's business), to anyone else they are not on the page at all.
    No changelist filters on them, here or through a relation from another model's admin: a filter
    such as `?handoff_signing_key__startswith=a` would tell the secret one character at a time by
    the result count (Django allows any lookup on a model's own fields). `edit_only_fields` are
    form fields shown only to users who may change the object (a "clear the key" box)."""

    secret_fields: tuple[str, ...] = ()
    edit_only_fields: tuple[str, ...] = ()

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest | None = None) -> bool:
        if reaches_secret(self.admin_site, self.model, lookup):
            return False
        return super().lookup_allowed(lookup, value, request)

    def get_fieldsets(self, request: HttpRequest, obj: _M | None = None) -> Any:
        fieldsets = super().get_fieldsets(request, obj)
        may_edit = self.has_change_permission(request, obj) if obj is not None else self.has_add_permission(request)
        hidden = set(self.secret_fields) & set(self.get_readonly_fields(request, obj))
        if not may_edit:
            hidden |= {*self.secret_fields, *self.edit_only_fields}
        if not hidden:
            return fieldsets
        kept = []
        for name, options in fieldsets:
            fields = [f for f in _without(options.get("fields", ()), hidden) if f != ()]
            kept.append((name, {**options, "fields": fields}))
        return kept

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        errors = super().check(**kwargs)
        places = {
            "list_display": self.list_display, "readonly_fields": self.readonly_fields, "list_filter": self.list_filter,
            "search_fields": [f.lstrip("^=@") for f in self.search_fields], "ordering": [f.lstrip("-") for f in self.ordering or ()],
            "date_hierarchy": [self.date_hierarchy] if self.date_hierarchy else [],
        }  # fmt: skip
        for place, names in places.items():
            for name in names:
                if isinstance(name, str) and reaches_secret(self.admin_site, self.model, name):
                    errors.append(checks.Error(
                        f"{type(self).__name__}.{place} names the secret field {name!r}: it would be shown or filterable.",
                        obj=type(self), id="workers.E101",
                    ))  # fmt: skip
        return errors


def _without(fields: Any, hidden: set[str]) -> Any:
    """A fieldset's `fields` (names, or tuples of names on one line) without the `hidden` ones."""
    kept: list[Any] = []
    for entry in fields:
        if isinstance(entry, (list, tuple)):
            line = tuple(f for f in entry if f not in hidden)
            if line:
                kept.append(line)
        elif entry not in hidden:
            kept.append(entry)
    return type(fields)(kept) if isinstance(fields, tuple) else kept


class ReadOnlyAdmin(GuardedAdmin[_M]):
    """Rows written by the gateway: operators read them, never edit them."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False
