from django.apps import AppConfig


class MessagesApiConfig(AppConfig):
    name = "messages_api"
    verbose_name = "Anthropic Messages API"
    default_auto_field = "django.db.models.BigAutoField"
