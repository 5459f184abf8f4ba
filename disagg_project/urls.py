from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("", include("messages_api.urls")),
    path("admin/", admin.site.urls),
]

# Django's error pages in Anthropic's envelope: a request target Django does not serve (`*`,
# `/V1/MESSAGES`, an absolute URL, `/..%2f..%2fetc/passwd`) answers JSON, as the API does.
handler400 = "messages_api.views.bad_request"
handler404 = "messages_api.views.not_found"
handler500 = "messages_api.views.server_error"
