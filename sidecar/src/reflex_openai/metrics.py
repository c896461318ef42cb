"""The Prometheus series `/metrics` serves, in a registry of their own."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("reflex_openai_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=registry)
        self.queue_depth = Gauge("reflex_openai_queue_depth", "requests waiting for the engine (not the one it serves)",
                                 registry=registry)
        self.engine_ready = Gauge("reflex_openai_engine_ready", "1 while the engine child can serve, else 0",
                                  registry=registry)
        self.time_to_first_token = Histogram(
            "reflex_openai_time_to_first_token_seconds", "from a request's arrival to its first generated token "
            "(queueing included)", registry=registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.tokens_per_second = Histogram(
            "reflex_openai_tokens_per_second", "decode rate of one generation, after its first token", registry=registry,
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000))
        self.generated_tokens = Counter("reflex_openai_generated_tokens", "tokens generated, all requests",
                                        registry=registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
