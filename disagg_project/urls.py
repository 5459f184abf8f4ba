from django.contrib import admin
from django.urls import path

from messages_api import views

urlpatterns = [
    path("", views.root),
    path("health", views.health),
    path("ready", views.ready),
    path("metrics", views.metrics),
    path("admin/", admin.site.urls),
]
