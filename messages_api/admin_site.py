"""The gateway's admin site: Django's, with an operator's console on top.

- the index says what the cluster is doing (a strip of live numbers) and links to
- the cluster overview (messages_api/overview.py), also listed first in the sidebar;
- every page keeps Django's own look; the site is installed by `GatewayAdminConfig`
  (messages_api/apps.py) in place of `django.contrib.admin`.

Staff only (the admin's login); what the overview shows follows the user's view permissions.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, URLResolver, path, reverse

from messages_api import overview


class GatewayAdminSite(admin.AdminSite):
    site_header = "Disaggregated gateway"
    site_title = "Gateway admin"
    index_title = "Operator's console"
    index_template = "admin/gateway/index.html"
    # No app sidebar: it took 300 of a 1440 px screen from every page, and the widest tables (the
    # audit, the endpoints) did not fit beside it and the filters. The index and the breadcrumbs
    # lead everywhere it did.
    enable_nav_sidebar = False

    def get_urls(self) -> list[URLResolver | URLPattern]:
        return [
            path("overview/", self.admin_view(self.overview_view), name="cluster_overview"),
            path("overview/live/", self.admin_view(self.overview_live_view), name="cluster_overview_live"),
            *super().get_urls(),
        ]

    def get_app_list(self, request: HttpRequest, app_label: str | None = None) -> list[Any]:
        apps = super().get_app_list(request, app_label)
        if app_label is None and overview.access(request).anything:
            url = reverse("admin:cluster_overview", current_app=self.name)
            apps.insert(0, {
                "name": "Operations", "app_label": "operations", "app_url": url, "has_module_perms": True,
                "models": [{
                    "name": "Cluster overview", "object_name": "ClusterOverview", "admin_url": url, "add_url": None,
                    "view_only": True, "perms": {"view": True},
                }],
            })  # fmt: skip
        return apps

    def index(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> TemplateResponse:
        return super().index(request, {"console": overview.summary(request), **(extra_context or {})})

    def overview_view(self, request: HttpRequest) -> HttpResponse:
        every = self._refresh_s(request)
        live_url = reverse("admin:cluster_overview_live", current_app=self.name)
        context = {
            **self.each_context(request),
            **self._live(request),
            "title": "Cluster overview",
            "live_url": f"{live_url}?every={every:g}" if every != overview.REFRESH_S else live_url,
            "refresh_ms": int(every * 1000),
        }
        return TemplateResponse(request, "admin/gateway/overview.html", context)

    def overview_live_view(self, request: HttpRequest) -> HttpResponse:
        response = TemplateResponse(
            request, "admin/gateway/overview_live.html", {**self._live(request), "refresh_ms": int(self._refresh_s(request) * 1000)}
        )
        # The page's script swaps in only answers that carry this header: a login page (an
        # expired session) or an error page is never swapped into the overview.
        response["X-Overview-Live"] = "1"
        return response

    def _live(self, request: HttpRequest) -> dict[str, Any]:
        if not overview.access(request).anything:
            raise PermissionDenied
        return overview.context(request)

    @staticmethod
    def _refresh_s(request: HttpRequest) -> float:
        """`?every=N` seconds between refreshes (1 to 300), default REFRESH_S."""
        try:
            every = float(request.GET.get("every", overview.REFRESH_S))
        except ValueError:
            every = overview.REFRESH_S
        return min(300.0, max(1.0, every)) if every == every else overview.REFRESH_S
