from django.apps import AppConfig


class WorkersConfig(AppConfig):
    name = "workers"
    verbose_name = "Worker cluster"
    default_auto_field = "django.db.models.BigAutoField"
