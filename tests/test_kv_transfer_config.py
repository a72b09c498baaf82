"""PD disaggregation's configuration: vLLM's --kv-transfer-config shape, the kv_transfer: YAML
section, and errors that name the key."""
from __future__ import annotations

import pytest

from llm_serving.cli import build_parser, cli_engine_overrides
from llm_serving.config import EngineArgs
from llm_serving.distributed.kv_transfer.config import KVTransferConfig
from llm_serving.errors import ConfigError
from llm_serving.serving_config import load_config


def test_vllm_shaped_json_from_the_flag_and_the_yaml_section_give_the_same_config(tmp_path):
    text = ('{"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_consumer", '
            '"kv_connector_extra_config": {"master_server_address": "127.0.0.1:50051"}}')
    args = build_parser().parse_args(["serve", "--kv-transfer-config", text])
    flag = cli_engine_overrides(args)["kv_transfer_config"]
    p = tmp_path / "c.yaml"
    p.write_text("llm_serving: {model: /m}\nkv_transfer:\n  kv_connector: MooncakeStoreConnector\n"
                 "  kv_role: kv_consumer\n  kv_connector_extra_config:\n"
                 "    master_server_address: 127.0.0.1:50051\n")
    yaml_kw = load_config(p).engine_kwargs
    assert yaml_kw["kv_transfer_config"] == flag
    cfg = KVTransferConfig.from_dict(EngineArgs(**yaml_kw).kv_transfer_config)
    assert (cfg.kv_connector, cfg.kv_role, cfg.is_producer, cfg.is_consumer) == (
        "MooncakeStoreConnector", "kv_consumer", False, True)
    assert cfg.extra("master_server_address") == "127.0.0.1:50051"
    # our defaults: a bounded transfer, and the decode side recomputes on failure
    assert (cfg.kv_transfer_timeout, cfg.kv_failure_policy) == (30.0, "recompute")
    # the flag wins over the file
    over = load_config(p, {"kv_transfer_config": {"kv_connector": "MooncakeConnector"}})
    assert over.engine_kwargs["kv_transfer_config"] == {"kv_connector": "MooncakeConnector"}


def test_p2p_needs_no_extra_config_and_round_trips():
    cfg = KVTransferConfig.from_dict({"kv_connector": "MooncakeConnector",
                                      "kv_role": "kv_producer"})
    assert cfg.is_producer and not cfg.is_consumer
    assert KVTransferConfig.from_dict(cfg.to_dict()) == cfg
    assert KVTransferConfig.from_dict(None) is None


@pytest.mark.parametrize("data, key", [
    ({"kv_role": "kv_producer"}, "kv_transfer.kv_connector"),
    ({"kv_connector": "NixlConnector"}, "kv_transfer.kv_connector"),
    ({"kv_connector": "MooncakeConnector", "kv_role": "producer"}, "kv_transfer.kv_role"),
    ({"kv_connector": "MooncakeConnector", "kv_rol": "kv_producer"}, "kv_transfer.kv_rol"),
    ({"kv_connector": "MooncakeConnector", "kv_transfer_timeout": 0},
     "kv_transfer.kv_transfer_timeout"),
    ({"kv_connector": "MooncakeConnector", "kv_failure_policy": "retry"},
     "kv_transfer.kv_failure_policy"),
    ({"kv_connector": "MooncakeConnector", "kv_connector_extra_config": [1]},
     "kv_transfer.kv_connector_extra_config"),
    ({"kv_connector": "MooncakeConnector", "kv_connector_extra_config": {"mastr": "x"}},
     "kv_transfer.kv_connector_extra_config.mastr"),
    ({"kv_connector": "MooncakeStoreConnector"},
     "kv_transfer.kv_connector_extra_config.master_server_address"),
    ({"kv_connector": "MooncakeStoreConnector",
      "kv_connector_extra_config": {"master_server_address": "localhost"}},
     "kv_transfer.kv_connector_extra_config.master_server_address"),
])
def test_a_bad_key_is_named(data, key):
    with pytest.raises(ConfigError) as e:
        EngineArgs(model="/m", kv_transfer_config=data)
    assert str(e.value).startswith(key + ":"), str(e.value)


def test_vllms_own_keys_are_taken():
    """vLLM 0.32's KVTransferConfig names the failure policy kv_load_failure_policy, and CPU
    examples set kv_buffer_device; a vLLM user's JSON works unchanged."""
    cfg = KVTransferConfig.from_dict({"kv_connector": "MooncakeConnector",
                                      "kv_role": "kv_consumer", "kv_buffer_device": "cpu",
                                      "kv_load_failure_policy": "fail"})
    assert (cfg.kv_role, cfg.kv_failure_policy) == ("kv_consumer", "fail")
    assert KVTransferConfig.from_dict(cfg.to_dict()) == cfg
    for bad, key in (({"kv_buffer_device": "cuda"}, "kv_buffer_device"),
                     ({"kv_load_failure_policy": "retry"}, "kv_load_failure_policy"),
                     ({"kv_load_failure_policy": "fail", "kv_failure_policy": "recompute"},
                      "kv_load_failure_policy")):
        with pytest.raises(ConfigError) as e:
            KVTransferConfig.from_dict({"kv_connector": "MooncakeConnector", **bad})
        assert str(e.value).startswith(f"kv_transfer.{key}:"), str(e.value)


def test_the_pool_reads_vllms_mooncake_config_file(tmp_path, monkeypatch):
    """As vLLM's MooncakeStoreConnector: the store's settings from the file MOONCAKE_CONFIG_PATH
    names, sizes with units; kv_connector_extra_config wins; what we do not run is refused."""
    f = tmp_path / "mooncake_config.json"
    f.write_text('{"mode": "embedded", "metadata_server": "P2PHANDSHAKE", '
                 '"master_server_address": "10.0.0.5:50051", "global_segment_size": "1.5GB", '
                 '"local_buffer_size": "512MB", "protocol": "tcp", "device_name": ""}')
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(f))
    cfg = KVTransferConfig.from_dict({"kv_connector": "MooncakeStoreConnector",
                                      "kv_role": "kv_both"})
    assert cfg.extra("master_server_address") == "10.0.0.5:50051"
    assert cfg.extra("global_segment_size") == 3 << 29
    assert cfg.extra("local_buffer_size") == 512 << 20
    assert cfg.extra("metadata_server") == "P2PHANDSHAKE"
    over = KVTransferConfig.from_dict({"kv_connector": "MooncakeStoreConnector",
                                       "kv_connector_extra_config": {
                                           "master_server_address": "10.0.0.6:50051",
                                           "global_segment_size": 4096}})
    assert over.extra("master_server_address") == "10.0.0.6:50051"
    assert over.extra("global_segment_size") == 4096
    # P2P does not read the pool's file
    assert KVTransferConfig.from_dict({"kv_connector": "MooncakeConnector"}).extra(
        "master_server_address") is None
    for text, key in (('{"mode": "standalone-store"}', ".mode"),
                      ('{"enable_offload": true}', ".enable_offload"),
                      ('{"master_server": "x:1"}', ".master_server"),
                      ('[1]', ""), ('{"mode": ', "")):
        f.write_text(text)
        with pytest.raises(ConfigError) as e:
            KVTransferConfig.from_dict({"kv_connector": "MooncakeStoreConnector"})
        assert str(e.value).startswith(f"MOONCAKE_CONFIG_PATH ({f}){key}:"), str(e.value)
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH")
    for size in ("4 XB", "-1GB", 0, True, "0"):
        with pytest.raises(ConfigError) as e:
            KVTransferConfig.from_dict({"kv_connector": "MooncakeStoreConnector",
                                        "kv_connector_extra_config": {
                                            "master_server_address": "h:1",
                                            "local_buffer_size": size}})
        assert str(e.value).startswith(
            "kv_transfer.kv_connector_extra_config.local_buffer_size:"), str(e.value)


def test_a_bad_yaml_section_is_named_before_anything_starts(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("llm_serving: {model: /m}\nkv_transfer: {kv_connector: MooncakeConnector, "
                 "kv_role: kv_decoder}\n")
    with pytest.raises(ConfigError) as e:
        EngineArgs(**load_config(p).engine_kwargs)
    assert str(e.value).startswith("kv_transfer.kv_role:")
    p.write_text("llm_serving: {model: /m}\nkv_transfer: [1, 2]\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value).startswith("kv_transfer")


def test_the_kv_pool_key_names_resolved_dtypes(tiny_model_dir):
    # A prefill instance started with the defaults and a decode instance given float32
    # explicitly store and look up the same blocks; a bf16 KV cache's blocks are others.
    from llm_serving.distributed.kv_transfer.factory import kv_model_tag

    def tag(**kw):
        kw.setdefault("device", "cpu")
        return kv_model_tag(EngineArgs(model=tiny_model_dir, num_blocks=64, **kw)
                            .create_engine_config())

    assert tag() == tag(dtype="float32", kv_cache_dtype="float32")
    assert tag(kv_cache_dtype="bfloat16") != tag()
    # two 16-bit caches of the same bytes per block, but not the same values
    assert tag(kv_cache_dtype="float16") not in (tag(), tag(kv_cache_dtype="bfloat16"))
    # fp8 is E4M3: the same blocks by either name, and not E5M2's
    assert tag(kv_cache_dtype="fp8") == tag(kv_cache_dtype="fp8_e4m3")
    assert tag(kv_cache_dtype="fp8") != tag(kv_cache_dtype="fp8_e5m2")
    assert tag(dtype="bfloat16") != tag()
    # On Ascend, auto KV is float16: another block than the CPU's float32 one.
    assert "kv:float16" in tag(device="ascend") and "kv:float32" in tag()
