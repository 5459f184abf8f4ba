"""Message Batches (`/v1/messages/batches`): Anthropic's API, durable in the database, their items
run as ordinary `/v1/messages` requests of the admission queue's `batch` class.

    schema.py      the create body checked whole, the batch object, the list's paging (no database)
    store.py       every read and write of the rows: claims with a lease, fenced results, the sweep
    consumers.py   the six routes' consumers (create, list, retrieve, cancel, delete, results)
    runner.py      the task in each gateway process that claims items and answers them

docs/batches.md says what a batch promises and how; the rows are `MessageBatch` and `BatchItem`
(messages_api/models.py).
"""
