"""Multi-stream: split a step into two micro-batches at a request boundary and overlap one
micro-batch's communication with the other's compute (seed 000's API; docs/multistream.md).

- ``config.py``: the knobs (``MultiStreamConfig``);
- ``split.py``: the split decision, one pure function, taken once on the master;
- ``metadata.py``: ``make_multistream_metadata`` and the per-micro-batch attention metadata;
- ``layers.py``: ``MultiStreamPreTransformerLayer`` / ``MultiStreamPostTransformerLayer``;
- ``decorators.py``: ``@support_multi_stream`` for decoder layers;
- ``interfaces.py``: ``SupportsMultiStream``;
- ``overlap.py``: how the micro-batches' phases run (sequential or overlapped).

Kept light: importing this package imports no MindSpore.
"""
