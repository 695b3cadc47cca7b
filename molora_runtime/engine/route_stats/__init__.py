"""Routing observability: attribution per token, gate statistics and telemetry per composition,
and the gate summary a request asks for."""
