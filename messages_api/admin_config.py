"""Django's admin app with the gateway's site (messages_api/admin_site.py), installed in its place:
`INSTALLED_APPS` names `messages_api.admin_config.GatewayAdminConfig` instead of
`django.contrib.admin`. A module of its own: an app's `apps.py` with two configs is ambiguous."""

from django.contrib.admin.apps import AdminConfig


class GatewayAdminConfig(AdminConfig):
    default_site = "messages_api.admin_site.GatewayAdminSite"
