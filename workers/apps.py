from django.apps import AppConfig
from django.core import checks


class WorkersConfig(AppConfig):
    name = "workers"
    verbose_name = "Worker cluster"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from workers.checks import check_pool_protocols, check_retired_settings

        checks.register(check_pool_protocols, checks.Tags.models)
        checks.register(check_retired_settings)
