from setuptools import find_packages, setup

# PD disaggregation (KV transfer between instances): Mooncake's transfer engine and store, and
# the `mooncake_master` command. At run time it needs Debian's libibverbs1, libnl-3-200 and
# libnl-route-3-200 (installed by .ci/run). On Ascend use mooncake-transfer-engine-npu.
PD = ["mooncake-transfer-engine-non-cuda==0.3.13.post1"]
# --otlp-traces-endpoint (llm_serving/tracing.py): the OpenTelemetry SDK and its OTLP span
# exporters, grpc and http/protobuf (vLLM's otel extra)
TRACING = ["opentelemetry-sdk>=1.26", "opentelemetry-exporter-otlp>=1.26"]
# --kv-events-config (llm_serving/engine/kv_events.py): the ZeroMQ publisher and the msgpack
# encoder of vLLM's event structs
KV_EVENTS = ["pyzmq", "msgspec"]
# --profiler-config (llm_serving/profiler.py): VizTracer records each process's Python calls
# and the C calls they make, as Chrome trace JSON (Perfetto, chrome://tracing)
PROFILING = ["viztracer>=1.1,<2"]

setup(
    name="llm_serving",
    version="0.1.0",
    description="LLM inference serving on MindSpore: paged KV cache, continuous batching, "
    "llm-serving and OpenAI compatible HTTP APIs.",
    python_requires=">=3.10",
    packages=find_packages(include=["llm_serving", "llm_serving.*", "agents", "clients",
                                    "clients.*"]),
    package_data={
        "llm_serving": ["model_executor/*.cpp", "model_executor/attention/kernels/*.cpp",
                        "model_executor/layers/kernels/*.cpp", "data/*"],
        "clients": ["data/*.json"],
    },
    install_requires=[
        "mindspore==2.10.0",
        "numpy<2",
        "ml_dtypes>=0.5,<0.6",  # FP8 KV caches' numpy dtypes (0.6 needs numpy 2)
        "safetensors",
        "tokenizers",
        "sentencepiece",
        "jinja2",
        "pyyaml",
        "pydantic>=2",
        "tqdm",
        "fastapi",
        # The server's connection bounds (entrypoints/connections.py) subclass uvicorn's
        # httptools protocol, an internal: a new uvicorn minor version is taken once
        # tests/test_http_server.py's connection tests pass on it.
        "uvicorn>=0.54,<0.55",
        # uvicorn's C HTTP parser (picked when installed): ~10% less CPU in the server process
        # than its pure-Python h11 under W1's 200 streams.
        "httptools",
        "prometheus-client",
        "python-json-logger",   # --logging-config's json formatter, as vLLM's
        "llguidance>=1.9,<2",   # structured outputs: a Rust core, no torch
        "aiohttp",
        "httpx2",               # the PD proxy's and the consumer's async HTTP client
        # OpenBLAS with run-time CPU dispatch: one of the GEMMs the CPU linear layers probe.
        "scipy-openblas32",
        # collective_rpc / apply_model send callables to the WorkAgents as vLLM does
        "cloudpickle>=3,<4",
    ],
    extras_require={
        "test": [
            "pytest",
            "hypothesis",
            "torch==2.13.0",
            "transformers",
            "protobuf",
            "openai",
            "anthropic",
            "requests",
            "schemathesis",
            "jsonschema",
            "matplotlib",
            "optuna>=4",
            *PD,
            *TRACING,
            *KV_EVENTS,
            *PROFILING,
        ],
        "pd": PD,
        "tracing": TRACING,
        "kv_events": KV_EVENTS,
        "profiling": PROFILING,
        "clients": ["matplotlib"],
        # llm-serving tune: Optuna's TPE sampler and successive-halving pruner, the plot.
        "tune": ["optuna>=4", "matplotlib"],
    },
    entry_points={"console_scripts": ["llm-serving=llm_serving.cli:main"]},
)
