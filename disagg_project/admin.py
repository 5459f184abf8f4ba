"""Users and groups in the admin: only superusers add, change or delete them.

In stock Django a staff user holding `auth.change_user` can make itself a superuser (or give itself
every permission, or reset a superuser's password), and one holding `auth.change_group` can put
itself in a group with every permission: either permission is all of them. Here they are managed
by superusers only; other staff with the view permission may still look. (disagg_project is an app
for this module alone: Django finds admin modules in apps.)
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group, User
from django.http import HttpRequest


class SuperuserOnly:
    """Add, change and delete for superusers only (a mixin for a ModelAdmin)."""

    def has_add_permission(self, request: HttpRequest, *args: Any) -> bool:
        return bool(request.user.is_active and request.user.is_superuser)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return bool(request.user.is_active and request.user.is_superuser)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return bool(request.user.is_active and request.user.is_superuser)


class SuperuserOnlyUserAdmin(SuperuserOnly, UserAdmin):  # type: ignore[type-arg]
    pass


class SuperuserOnlyGroupAdmin(SuperuserOnly, GroupAdmin):
    pass


for model, model_admin in ((User, SuperuserOnlyUserAdmin), (Group, SuperuserOnlyGroupAdmin)):
    if admin.site.is_registered(model):
        admin.site.unregister(model)
    admin.site.register(model, model_admin)
