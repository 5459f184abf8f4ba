"""The plain-Django routes of the front door: the probes Claude Code and load balancers send, and
the metrics scrape (the API routes are Channels consumers: `messages_api.routes`)."""

from django.urls import path

from messages_api import views

urlpatterns = [
    path("", views.root),
    # Claude Code 2.1.220-2.1.289 check that the gateway answers with HEAD /api/hello.
    path("api/hello", views.root),
    path("ready", views.ready),
    path("metrics", views.metrics),
]
