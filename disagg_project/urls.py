from django.conf import settings
from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("", include("messages_api.urls")),
    # ADMIN_URL (default `admin/`): docs/security.md on where to serve it.
    path(settings.ADMIN_URL, admin.site.urls),
]

# Django's error pages in Anthropic's envelope: a request target Django does not serve (`*`,
# `/V1/MESSAGES`, an absolute URL, `/..%2f..%2fetc/passwd`) answers JSON, as the API does.
handler400 = "messages_api.views.bad_request"
handler404 = "messages_api.views.not_found"
handler500 = "messages_api.views.server_error"
