"""An endpoint's KV-event settings are validated where the admin saves them."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from workers.models import WorkerEndpoint


@pytest.mark.parametrize(
    ("fields", "bad"),
    [
        ({"kv_events_address": "http://10.0.0.5:5557"}, "kv_events_address"),
        ({"kv_events_address": "tcp://*:5557"}, "kv_events_address"),
        ({"kv_events_address": "tcp://10.0.0.5"}, "kv_events_address"),
        ({"kv_events_replay_address": "tcp://10.0.0.5:5558"}, "kv_events_replay_address"),
    ],
)
def test_bad_settings_name_their_field(fields: dict[str, str], bad: str) -> None:
    with pytest.raises(ValidationError) as caught:
        WorkerEndpoint(**fields).clean()
    assert bad in caught.value.message_dict


@pytest.mark.parametrize(
    "fields",
    [{}, {"kv_events_address": "tcp://10.0.0.5:5557", "kv_events_replay_address": "tcp://10.0.0.5:5558"}, {"kv_events_address": "ipc:///tmp/kv"}],
)
def test_good_settings_pass(fields: dict[str, str]) -> None:
    WorkerEndpoint(**fields).clean()
