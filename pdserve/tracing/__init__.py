"""OpenTelemetry traces, shared by the router, the simulator, the operator and the renderers.

On the ground floor beside the wire formats: it knows no service. :mod:`.endpoint` is pure
(what an ``--otlp-traces-endpoint`` URL means, and how vLLM is told the same); :mod:`.sdk` loads
the OpenTelemetry SDK, which nothing imports unless tracing is turned on, so a process without
``--otlp-traces-endpoint`` starts as fast and pays nothing per request.
"""
