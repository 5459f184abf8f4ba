from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("", include("messages_api.urls")),
    path("admin/", admin.site.urls),
]
