"""The PD disaggregation proxy (``llm-serving proxy``): routes each request through a prefill
and a decode instance. It talks to the instances over HTTP only; nothing here imports the
engine."""
