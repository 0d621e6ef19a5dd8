"""Tests of broker.service: the store and its repositories, the HTTP and node APIs, the planning cycle, cloud
control, tokens, limits, settings, the HTTP server and log redaction."""
