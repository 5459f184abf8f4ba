"""The OTLP/HTTP span exporter the gateway installs: the official one (`opentelemetry-exporter-
otlp-proto-http`: its configuration from OTEL_EXPORTER_OTLP_*, its HTTP client, retries,
compression and size limit), its batches encoded by disagg_project/otlp_encoding.py, which writes
the same bytes as the official encoder at about a third of its CPU (the export thread's largest
cost per traced request).

`export` is the official method's source with its one encoding line changed: it is pinned in
disagg_project/relied_on.py, so that a change upstream is looked at rather than drifted from.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from opentelemetry.exporter.otlp.proto.http._common import RequestPayloadTooLargeError, _is_request_too_large
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.semconv.attributes.http_attributes import HTTP_RESPONSE_STATUS_CODE

from disagg_project.otlp_encoding import encode_spans

__all__ = ["OtlpSpanExporter"]

# The official exporter's logger: its messages read as they would without this subclass.
_logger = logging.getLogger("opentelemetry.exporter.otlp.proto.http.trace_exporter")


class OtlpSpanExporter(OTLPSpanExporter):
    """`OTLPSpanExporter`, encoding with `disagg_project.otlp_encoding.encode_spans`."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shutdown:
            _logger.warning("Exporter already shutdown, ignoring batch")
            return SpanExportResult.FAILURE

        with self._metrics.export_operation(len(spans)) as result:
            try:
                serialized_data = encode_spans(spans)  # the official: encode_spans(spans).SerializePartialToString()
            except Exception as error:
                _logger.error("Failed to encode span batch: %s", error)
                result.error = error
                return SpanExportResult.FAILURE

            if _is_request_too_large(serialized_data, self._max_request_size):
                _logger.warning(
                    "Dropping span batch: serialized size %d bytes exceeds max_request_size %d bytes.",
                    len(serialized_data),
                    self._max_request_size,
                )
                result.error = RequestPayloadTooLargeError(
                    f"Serialized span request size {len(serialized_data)} "
                    f"bytes exceeds max_request_size "
                    f"{self._max_request_size} bytes."
                )
                return SpanExportResult.FAILURE

            export_result = self._client.export(serialized_data)
            if not export_result.success:
                result.error = export_result.error
                result.error_attrs = (
                    {HTTP_RESPONSE_STATUS_CODE: export_result.status_code} if export_result.status_code is not None else None
                )
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS
