from django.apps import AppConfig


class MessagesApiConfig(AppConfig):
    name = "messages_api"
    verbose_name = "Anthropic Messages API"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from messages_api.audit import close_abandoned_requests
        from messages_api.batches.runner import release_abandoned
        from messages_api.usage import get_recorder
        from workers import process_abandoned

        process_abandoned.connect(close_abandoned_requests, dispatch_uid="messages_api.close_abandoned_requests")
        # A dead process's batch items go back to the queue.
        process_abandoned.connect(release_abandoned, dispatch_uid="messages_api.batches.release_abandoned")
        # The audit rows carry their requests' usage: the row writer writes both in one transaction.
        get_recorder()
